/* The structures the fused step (model_step.c) takes from Python: fused_step.py builds its ctypes copies by
 * reading this file (cpu_kernel.c_structs), and checks their sizes against step_struct_size() at load, so the
 * two cannot drift apart. Fields: pointers, int, int64_t, float, double only (what the reader knows). */
#ifndef PAGEDLLM_MODEL_STEP_H
#define PAGEDLLM_MODEL_STEP_H
#include <stdint.h>

typedef struct {
    const float *attn_norm, *ffn_norm; /* [hidden] float32 */
    const uint8_t *qkv, *o, *gate_up, *down;
    int qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    const float *qkv_bias; /* [(heads + 2 kv_heads) * head_dim] or NULL */
    void *k_cache, *v_cache;
    int64_t window;       /* > 0: the layer's sliding window (tokens a query sees, itself included) */
    float scale, softcap; /* softmax scale; softcap > 0: scores capped as softcap * tanh(score / softcap) */
} StepLayer;

typedef struct {
    int hidden, inter, heads, kv_heads, head_dim, layers, vocab, block_size, cache_kind, amx_min_rows;
    int dot; /* 1: matmuls round x to 16-bit integers per group of 32 (the dot route); 0: float32 x */
    int64_t num_blocks, max_positions;
    float eps;
    const float *final_norm;
    const uint8_t *embed, *lm_head;
    int embed_fmt, lm_head_fmt;
    const float *cos, *sin; /* [max_positions, head_dim] */
} StepModel;

typedef struct {
    const int64_t *tokens, *positions, *seq, *slots; /* [T]: id, position, sequence index, cache slot */
    const int64_t *block_tables;                      /* [S, max_blocks] */
    const int64_t *logit_rows;                        /* [R] rows whose logits are wanted */
    int T, S, max_blocks, R;
    float *logits; /* [R, vocab] */
    double *profile; /* NULL, or [N_PHASES] seconds added per phase (benchmarks/step_profile.py) */
} StepBatch;

int64_t step_struct_size(const char *name);
#endif
