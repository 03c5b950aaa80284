/* The routed experts of a mixture-of-experts layer (moe.c). moe_kernel.py builds its ctypes copy of MoeLayer by
 * reading this file (cpu_kernel.c_structs) and checks its size against moe_struct_size() at load. */
#ifndef PAGEDLLM_MOE_H
#define PAGEDLLM_MOE_H
#include <stdint.h>

/* The gated activation between an expert's gate_up and down matmuls (a = act(gate, up), per element). */
#define MOE_SILU 0       /* silu(gate) * up: SwiGLU (Qwen-MoE, Mixtral, OLMoE, Granite-MoE) */
#define MOE_GELU_TANH 1  /* gelu_tanh(gate) * up: GeGLU */
#define MOE_SWIGLU_OAI 2 /* gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g sigmoid(alpha g) */
#define MOE_RELU2 3      /* ungated: relu(up)^2, gate_up holding the up rows alone (N = ffn; Nemotron-H) */

typedef struct {
    const uint8_t **gate_up; /* [experts] quantized tiles, N = 2 ffn (gate rows, then up rows; MOE_RELU2: ffn up
                              * rows), K = hidden */
    const uint8_t **down;    /* [experts] quantized tiles, N = hidden, K = ffn */
    const float *gate_up_bias, *down_bias; /* NULL, or [experts][gate_up's N] and [experts][hidden] */
    int experts, hidden, ffn, gate_up_fmt, down_fmt, act;
    int dot; /* 1: activations rounded to 16-bit integers per group of 32 (the dot route); 0: float32 */
    float alpha, limit; /* MOE_SWIGLU_OAI's */
    /* > 0: an expert's matmul of at least this many rows (its routed rows in the step), of a format the int8 route
     * runs (qi8_runs), rounds its input to 8-bit integers per group of 32 instead (the int8 route,
     * --quantized-activations int8); 0: never */
    int i8_min_rows;
    /* > 0: a step of at least this many rows (kernel_choice.py's q-bf16 threshold: --dtype bfloat16 on a CPU with
     * AVX-512 BF16) rounds the experts' inputs to bfloat16 and runs their matmuls on vdpbf16ps (qmm_bf16.c), twice
     * the float32 rate; 0: never */
    int bf16_min_rows;
} MoeLayer;

int64_t moe_struct_size(const char *name);

/* A step's routed experts as phases of independent work items, each phase done before the next starts:
 * moe_group (one item: counts, slots, the matmuls' work items, the load counters), then moe_gather and
 * moe_activate over slots s < T * topk, moe_matmul over items i < moe_plan_items (gate_up: which 0, down: 1;
 * items past this step's are no-ops), moe_combine over tokens t < T (y[t] += the weighted sum). The plan holds
 * the buffers for up to max_slots slots of any layer of at most `experts` experts, `ffn` and that hidden
 * (`dot`, `i8`, `bf16`: with room for the rows rounded for the dot, the int8 and the bfloat16 route); the matmul
 * items take a panel of max(hidden, ffn) * 16 floats each. */
typedef struct MoePlan MoePlan;
MoePlan *moe_plan_new(int experts, int max_slots, int hidden, int ffn, int dot, int i8, int bf16,
                      int num_threads); /* NULL: OOM */
void moe_plan_free(MoePlan *p);
int moe_plan_items(const MoePlan *p);
int moe_plan_active(const MoePlan *p); /* the experts the last moe_group routed rows to */
/* 0, -2 (bad sizes: a layer the plan was not sized for, or one whose experts may take the int8 or the bfloat16
 * route on a plan without its room), -5 (as moe_experts); after a failure every item is a no-op. */
int moe_group(MoePlan *p, const MoeLayer *L, const int64_t *ids, int T, int topk, int64_t *load);
void moe_gather(const MoePlan *p, const float *x, int s);
void moe_matmul(const MoePlan *p, int which, int i, float *panel);
void moe_activate(const MoePlan *p, int s);
void moe_combine(const MoePlan *p, float *y, const float *weights, int t);
/* y[T, hidden] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t; load[e] += the rows routed to
 * expert e (NULL: not counted). 0, -1 (out of memory), -2 (bad sizes), -5 (an expert id out of range or an active
 * expert without weights). */
int moe_experts(float *y, const float *x, const int64_t *ids, const float *weights, int T, int topk,
                const MoeLayer *L, int64_t *load, int num_threads);
#endif
