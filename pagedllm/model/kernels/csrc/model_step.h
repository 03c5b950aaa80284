/* The structures the fused step (model_step.c) takes from Python: fused_step.py builds its ctypes copies by
 * reading this file (cpu_kernel.c_structs), and checks their sizes against step_struct_size() at load, so the
 * two cannot drift apart. Fields: pointers, int, int64_t, float, double only (what the reader knows).
 *
 * What a family does beyond the plain Llama layer is data here, read from the decoder's own modules: a norm
 * weight is NULL where the layer has no such norm, and holds its offset already (Gemma's 1 + w), so the step
 * has one RMSNorm; the rest are a few numbers per layer or per model. */
#ifndef PAGEDLLM_MODEL_STEP_H
#define PAGEDLLM_MODEL_STEP_H
#include <stdint.h>

#include "lora.h"

enum { ROPE_NONE, ROPE_GLOBAL, ROPE_LOCAL }; /* StepLayer.rope */
enum { ACT_SILU, ACT_GELU_TANH, ACT_RELU2 }; /* StepModel.act (ACT_RELU2: ungated, gate_up holds up alone) */
enum { ROUTE_SOFTMAX_TOPK, ROUTE_TOPK_SOFTMAX, ROUTE_SIGMOID }; /* StepModel.router: moe.py's route() kinds */

typedef struct {
    const float *attn_norm, *ffn_norm;         /* [hidden] before attention / the MLP, or NULL (OLMo2: none) */
    const float *attn_out_norm, *ffn_out_norm; /* [hidden] on the attention / MLP output, or NULL (Gemma, OLMo2) */
    const float *q_norm, *k_norm; /* before RoPE, or NULL: [head_dim] per head, or the whole projection's */
    const uint8_t *qkv, *o, *gate_up, *down; /* gate_up / down: NULL in a sparse layer (but see moe_norm) */
    int qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    /* A sparse layer (a mixture of experts in the MLP's place; moe.py): its routed experts (moe.h's MoeLayer), the
     * router's float32 weight [experts, hidden] and bias [experts] or NULL, the rows each expert served added to
     * expert_load[experts] (the engine's counters); a shared expert (NULL: none) of StepModel.shared_inter, its
     * gate's weight [hidden] (NULL: ungated), and the shared expert's activation is StepModel.act. */
    const void *moe;
    const float *router, *router_bias;
    const float *score_bias; /* [experts] or NULL: ROUTE_SIGMOID's bias on the scores that choose the top k */
    int64_t *expert_load;
    const uint8_t *shared_gate_up, *shared_down;
    int shared_gate_up_fmt, shared_down_fmt;
    const float *shared_gate;
    /* StepModel.moe_latent > 0: the routed experts' input projection [moe_latent, hidden] of the MoE block's input
     * (the experts read it; the router and the shared expert read the input itself) and their weighted sum's back
     * [hidden, moe_latent], quantized (Nemotron-3-Super's fc1 / fc2_latent_proj); NULL where the model has none */
    const uint8_t *latent_in, *latent_out;
    int latent_in_fmt, latent_out_fmt;
    const float *sinks; /* [heads] or NULL: a learned logit per head in each softmax's sum (gpt-oss) */
    /* A sparse block beside a dense MLP (Gemma 4's 26B-A4B): a sparse layer whose gate_up / down are set runs that
     * MLP (of `inter`) on the MLP's input too. Its output normed by dense_out_norm, the sparse block's by
     * moe_out_norm (each NULL: as it is), the two summed, then ffn_out_norm and the residual add. moe_norm: the
     * experts (and the shared expert) read this norm of the stream (NULL: the MLP's input); router_norm: the router
     * reads this norm of the stream (the weight holds its learned scale times hidden^-0.5; NULL: the experts'
     * input); expert_scale [experts]: each routing weight times its expert's (NULL: none). */
    const float *moe_norm, *router_norm, *dense_out_norm, *moe_out_norm, *expert_scale;
    const float *qkv_bias; /* [(heads + 2 kv_heads) * head_dim] or NULL */
    const float *o_bias;   /* [hidden] or NULL */
    void *k_cache, *v_cache;
    int64_t window;       /* > 0: the layer's sliding window (tokens a query sees, itself included) */
    float scale, softcap; /* softmax scale; softcap > 0: scores capped as softcap * tanh(score / softcap) */
    int rope;             /* ROPE_NONE (NoPE), ROPE_GLOBAL, ROPE_LOCAL (Gemma 3's sliding layers' own base) */
    int qk_norm_full;     /* 1: q_norm / k_norm span all heads at once (OLMo2); 0: one head (Qwen3, Gemma 3) */
    int group;            /* the KV-cache group whose block table and slots the layer reads and writes */
    /* A linear layer (a hybrid model's): its recurrent mixer (recurrent.h's RecMixer) in attention's place, or
     * NULL: attention */
    const void *mixer;
    /* The layer's own attention shape (Gemma 4's full layers differ from its sliding ones; StepModel's head_dim,
     * kv_heads and inter are the largest): head size, KV heads, the rotary width of its RoPE table, the MLP's */
    int head_dim, kv_heads, rotary_dim, inter;
    /* K and V projections in qkv: 2; 1: keys are the values (V is K's projection before K's norm and RoPE); 0: the
     * layer projects none and reads the cache of an earlier layer (k_cache / v_cache are that layer's) */
    int kv_parts;
    int v_norm;          /* 1: V RMS-normed, without a weight */
    int64_t kv_stride;   /* cache elements (bytes if quantized) between a token's rows (paged_attention.h's Args) */
    const float *scalar; /* [1]: the layer's output times it (Gemma 4), or NULL */
    /* Gemma 4's per-layer input (NULL: none): h += norm(proj(act(gate(h)) * the layer's slice of the per-layer
     * embeddings)); gate [ple_width, hidden] and proj [hidden, ple_width] quantized, the norm [hidden] */
    const uint8_t *ple_gate, *ple_proj;
    int ple_gate_fmt, ple_proj_fmt;
    const float *ple_norm;
    /* A single-block layer (Nemotron-H): 1 where the layer has no mixer (its MLP only) / no MLP (its mixer only);
     * the block it lacks, that block's norms and its residual add are not planned */
    int no_mixer, no_mlp;
} StepLayer;

typedef struct {
    int hidden, inter, heads, kv_heads, head_dim, layers, vocab, block_size, cache_kind, amx_min_rows;
    int dot; /* 1: matmuls round x to 16-bit integers per group of 32 (the dot route); 0: float32 x */
    int i8_min_rows; /* matmuls of at least this many rows (of a format the int8 route runs) round x to 8 bits */
    /* ... those of the kinds whose bit is set: bit p for the matmuls of profile slot p (fused_step.PHASES: qkv, o,
     * gate_up, down, lm_head), bit len(PHASES) for those of no kind (recurrent mixers', per-layer inputs', latent
     * projections') */
    int i8_kinds;
    int act; /* the gate's activation: ACT_SILU (SwiGLU), ACT_GELU_TANH (GeGLU); ACT_RELU2: relu(up)^2, no gate */
    int rotary_dim; /* the leading dims of each head RoPE rotates (partial rotary: fewer than head_dim) */
    int64_t num_blocks, max_positions, max_local_positions;
    float eps;
    float embed_scale;    /* the embedding rows times this (Gemma: sqrt(hidden); Granite) */
    float residual_scale; /* each branch times this before its residual add (Granite) */
    float logit_divisor;  /* logits divided by this (Granite), then ... */
    float logit_softcap;  /* > 0: capped as softcap * tanh(logit / softcap) (Gemma 2) */
    const float *final_norm;
    const uint8_t *embed, *lm_head;
    int embed_fmt, lm_head_fmt;
    const float *cos, *sin;             /* [max_positions, rotary_dim] */
    const float *local_cos, *local_sin; /* [max_local_positions, rotary_dim], or NULL: no ROPE_LOCAL layer */
    /* The sparse layers' shape (experts 0: none): experts, top k, each expert's ffn, the shared expert's ffn (0:
     * none), the router (ROUTE_*; norm_topk: the top k renormalised to sum 1; ROUTE_SIGMOID over expert_groups
     * equal groups, at most 64: the top k within the topk_group groups whose two largest score + score_bias sum
     * highest, DeepSeek-V3's), and a counter the step adds the experts read to (one per active expert per sparse
     * layer). The experts and the shared expert take `act`'s form (ACT_RELU2: ungated, the experts' MOE_RELU2). */
    int experts, topk, moe_ffn, shared_inter, router, norm_topk, expert_groups, topk_group;
    int moe_latent; /* > 0: the routed experts' width (their MoeLayer.hidden), between StepLayer.latent_in / _out */
    float route_scale; /* ROUTE_SIGMOID: the routing weights' factor (routed_scaling_factor) */
    int64_t *expert_reads;
    int attn_gate; /* 1: attention's output times sigmoid(gate), each head's gate rows after its query's in qkv */
    /* Gemma 4's per-layer input embeddings (ple_width 0: none), [T, layers, ple_width] made once per step as
     * (norm(projection(h) / sqrt(hidden)) + table[token] * sqrt(ple_width)) / sqrt(2), h the scaled embedding:
     * the table [ple_vocab, layers * ple_width] and projection [layers * ple_width, hidden] quantized, the norm
     * [ple_width] */
    int ple_width, ple_vocab;
    const uint8_t *ple_embed, *ple_projection;
    int ple_embed_fmt, ple_projection_fmt;
    const float *ple_proj_norm;
} StepModel;

typedef struct {
    const int64_t *tokens, *positions, *seq; /* [T]: id, position, sequence index */
    const int64_t *slots;        /* [groups, T]: each token's cache slot through each KV-cache group's table */
    const int64_t *block_tables; /* [groups, S, max_blocks]: a sliding group's holds block 0 out of its window */
    const int64_t *logit_rows;   /* [R] rows whose logits are wanted */
    int T, S, max_blocks, R, groups;
    float *logits; /* [R, vocab] */
    double *profile; /* NULL, or [N_PHASES] seconds added per phase (benchmarks/step_profile.py) */
    const LoraStep *lora; /* NULL, or the rows that run under LoRA adapters and the adapters' matrices */
    const int64_t *state_slots; /* [S] each sequence's recurrent-state slot (NULL: a model without mixers) */
    /* NULL, or [S + 1]: sequence s's state marks are mark_at / mark_row[mark_first[s] .. mark_first[s + 1]): its
     * states after mark_at tokens also written to state row mark_row (recurrent.h's RecStep) */
    const int64_t *mark_first, *mark_at, *mark_row;
} StepBatch;

int64_t step_struct_size(const char *name);
/* One step of the whole model for the tokens of `b` (fused_step.py); 0, or a negative code. */
int model_step(const StepModel *m, const StepLayer *layers, const StepBatch *b, int num_threads);
/* n rows of D floats (rotated already) -> n quantized cache rows, as the step writes them; 0, or -2 (bad sizes). */
int kv_quantize_rows(uint8_t *dst, const float *src, int64_t n, int D, int kind);
#endif
