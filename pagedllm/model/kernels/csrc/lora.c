/*
 * The LoRA term of a matmul of the fused step (lora.h): out[row] += B_a (A_a x[row]) for each row that runs under
 * an adapter a, the rows of a step grouped by adapter (model/lora.py groups them): a group of up to GROUP_ROWS
 * rows reads its adapter's A and B once for all of them (vLLM's sgmv, for a prefill chunk or many decode
 * tokens of one adapter), a group of one row is bgmv. Rows of no adapter are never touched, so they stay bit for
 * bit what the base matmul wrote.
 *
 * Two halves, each a phase of model_step.c's plan: lora_shrink (tmp[row] = x[row] A^T, an item per group) and
 * lora_expand (out[row] += tmp[row] B^T, an item per group and block of COLS output columns), both as sums of
 * rows of A^T / B^T scaled by the row's values, vectorized along the output (no horizontal sums). Every row's sums
 * run in the same order whatever else is in its group, so a row's result does not depend on the batch. Float32
 * sums, as the torch path's LoRAHook computes the term; the matrices float32, or bfloat16 for a bfloat16 model
 * (vLLM keeps adapters in the model's dtype): a batch of decode rows over many adapters reads every adapter's
 * matrices each step, as many bytes as the quantized base weights.
 */
#include <string.h>

#include "lora.h"
#include "simd.h"

#define GROUP_ROWS 8 /* rows of one adapter per group: their accumulators stay in registers */
#define COLS 256     /* output columns per expand item */

int64_t lora_struct_size(const char *name) {
    if (!strcmp(name, "LoraMat")) return sizeof(LoraMat);
    if (!strcmp(name, "LoraStep")) return sizeof(LoraStep);
    return -1;
}

int lora_group_rows(void) { return GROUP_ROWS; }

static const LoraMat *mat(const LoraStep *s, int adapter, int layer, int slot) {
    return &s->adapters[adapter][layer * LORA_SLOTS + slot];
}

int lora_check(const LoraStep *s, int T, int layers) {
    if (s->A <= 0 || s->n < 0 || s->G < 0 || s->max_rank < 0 || s->layers != layers || !s->tmp) return -2;
    for (int a = 0; a < s->A; a++)
        for (int i = 0; i < layers * LORA_SLOTS; i++) {
            const LoraMat *M = &s->adapters[a][i];
            if (M->r < 0 || M->r > s->max_rank || (M->r && (!M->at || !M->bt || !M->pieces))) return -2;
            for (int p = 0; M->r && p < M->n_pieces; p++) {
                const int64_t *q = M->pieces + 4 * p;
                if (q[0] < 0 || q[1] < q[0] || q[2] < 0 || q[3] < q[2] || q[3] > M->r) return -2;
            }
        }
    for (int g = 0; g < s->G; g++) {
        const int64_t *grp = s->groups + 3 * (int64_t)g;
        if (grp[0] < 0 || grp[0] >= s->A || grp[1] < 0 || grp[2] < 1 || grp[2] > GROUP_ROWS || grp[1] + grp[2] > s->n)
            return -5;
    }
    for (int i = 0; i < s->n; i++)
        if (s->rows[i] < 0 || s->rows[i] >= T) return -5;
    return 0;
}

int lora_targets(const LoraStep *s, int layer, int slot) {
    for (int a = 0; a < s->A; a++)
        if (mat(s, a, layer, slot)->r) return 1;
    return 0;
}

int lora_items(const LoraStep *s, int N) { return N ? s->G * ((N + COLS - 1) / COLS) : s->G; }

/* VW values of row j of b from column c: float32, or bfloat16 widened (half). */
static inline __attribute__((always_inline)) vf load_b(const void *b, int64_t at, const int half) {
    return half ? ld_bf16((const uint16_t *)b + at) : ld((const float *)b + at);
}

static inline float scalar_b(const void *b, int64_t at, const int half) {
    if (!half) return ((const float *)b)[at];
    const uint32_t u = (uint32_t)((const uint16_t *)b)[at] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* out[i][c0, c1) (+)= sum_j t[i][j] b[j][c0, c1) for the n rows (b's rows N values apart, float32 or bfloat16),
 * n and half constants once inlined: per VW columns, one accumulator per row, each b vector loaded once for all
 * of them. Both halves are this product: A x as x [n, K] times A^T [K, r], then tmp [n, r] times B^T [r, N]. */
static inline __attribute__((always_inline)) void axpys(float *const *out, const float *const *t, const void *b,
                                                        int r, int N, int c0, int c1, const int add, const int half,
                                                        const int n) {
    int c = c0;
    for (; c + VW <= c1; c += VW) {
        vf acc[GROUP_ROWS];
        for (int i = 0; i < n; i++) acc[i] = (vf){0};
        for (int j = 0; j < r; j++) {
            const vf bv = load_b(b, (int64_t)j * N + c, half);
            for (int i = 0; i < n; i++) acc[i] += t[i][j] * bv;
        }
        for (int i = 0; i < n; i++) st(out[i] + c, add ? ld(out[i] + c) + acc[i] : acc[i]);
    }
    for (; c < c1; c++)
        for (int i = 0; i < n; i++) {
            float sum = 0.0f;
            for (int j = 0; j < r; j++) sum += t[i][j] * scalar_b(b, (int64_t)j * N + c, half);
            out[i][c] = add ? out[i][c] + sum : sum;
        }
}

#define BY_ROWS(n, call)                                                                                             \
    switch (n) {                                                                                                     \
    case 1: call(1); break;                                                                                          \
    case 2: call(2); break;                                                                                          \
    case 3: call(3); break;                                                                                          \
    case 4: call(4); break;                                                                                          \
    case 5: call(5); break;                                                                                          \
    case 6: call(6); break;                                                                                          \
    case 7: call(7); break;                                                                                          \
    default: call(8);                                                                                                \
    }

void lora_shrink(const LoraStep *s, int layer, int slot, const float *x, int K, int item) {
    const int64_t *grp = s->groups + 3 * (int64_t)item;
    const LoraMat *M = mat(s, (int)grp[0], layer, slot);
    const int n = (int)grp[2];
    if (!M->r) return;
    float *outs[GROUP_ROWS];
    const float *xs[GROUP_ROWS];
    const int64_t *rows = s->rows + grp[1];
    for (int i = 0; i < n; i++) {
        outs[i] = s->tmp + rows[i] * s->max_rank;
        xs[i] = x + rows[i] * K;
    }
#define SHRINK(c) axpys(outs, xs, M->at, K, M->r, 0, M->r, 0, 0, c)
#define SHRINK_BF16(c) axpys(outs, xs, M->at, K, M->r, 0, M->r, 0, 1, c)
    if (s->bf16) {
        BY_ROWS(n, SHRINK_BF16)
    } else {
        BY_ROWS(n, SHRINK)
    }
#undef SHRINK
#undef SHRINK_BF16
}

void lora_expand(const LoraStep *s, int layer, int slot, float *out, int N, int ld, int item) {
    const int blocks = (N + COLS - 1) / COLS, c0 = item % blocks * COLS, c1 = c0 + COLS < N ? c0 + COLS : N;
    const int64_t *grp = s->groups + 3 * (int64_t)(item / blocks);
    const LoraMat *M = mat(s, (int)grp[0], layer, slot);
    const int n = (int)grp[2];
    if (!M->r) return;
    float *outs[GROUP_ROWS];
    const float *ts[GROUP_ROWS];
    const int64_t *rows = s->rows + grp[1];
    for (int p = 0; p < M->n_pieces; p++) { /* the pieces (q, k, v; gate, up) in this block of columns */
        const int64_t *q = M->pieces + 4 * p;
        const int n0 = q[0] > c0 ? (int)q[0] : c0, n1 = q[1] < c1 ? (int)q[1] : c1, j0 = (int)q[2];
        if (n0 >= n1) continue;
        for (int i = 0; i < n; i++) {
            outs[i] = out + rows[i] * ld;
            ts[i] = s->tmp + rows[i] * s->max_rank + j0;
        }
        const char *b = (const char *)M->bt + (int64_t)j0 * N * (s->bf16 ? 2 : 4);
#define EXPAND(c) axpys(outs, ts, b, (int)q[3] - j0, N, n0, n1, 1, 0, c)
#define EXPAND_BF16(c) axpys(outs, ts, b, (int)q[3] - j0, N, n0, n1, 1, 1, c)
        if (s->bf16) {
            BY_ROWS(n, EXPAND_BF16)
        } else {
            BY_ROWS(n, EXPAND)
        }
#undef EXPAND
#undef EXPAND_BF16
    }
}
