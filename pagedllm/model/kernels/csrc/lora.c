/*
 * The LoRA term of a matmul of the fused step (lora.h): out[row] += B_a (A_a x[row]) for each row that runs under
 * an adapter a, the rows of a step grouped by adapter (model/lora.py groups them): a group of up to GROUP_ROWS
 * rows reads its adapter's A and B once for all of them (vLLM's sgmv, for a prefill chunk or many decode
 * tokens of one adapter), a group of one row is bgmv. Rows of no adapter are never touched, so they stay bit for
 * bit what the base matmul wrote.
 *
 * Two halves, each a phase of model_step.c's plan: lora_shrink (tmp[row] = A x[row], an item per group) and
 * lora_expand (out[row] += tmp[row] B^T, an item per group and block of COLS output columns). Every row's sums
 * run in the same order whatever else is in its group, so a row's result does not depend on the batch. Float32
 * throughout, as the torch path's LoRAHook computes the term (the adapters' matrices are a small part of a
 * step's bytes beside the base weights of a batch of rows).
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
            if (M->r < 0 || M->r > s->max_rank || (M->r && (!M->a || !M->bt))) return -2;
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

/* out[i] = a . x[i] for the n rows x[i] (K floats each), n a constant once inlined: one accumulator per row. */
static inline __attribute__((always_inline)) void dots(float *out, const float *a, const float *const *x, const int n,
                                                       int K) {
    vf acc[GROUP_ROWS];
    for (int i = 0; i < n; i++) acc[i] = (vf){0};
    int k = 0;
    for (; k + VW <= K; k += VW) {
        const vf av = ld(a + k);
        for (int i = 0; i < n; i++) acc[i] += av * ld(x[i] + k);
    }
    for (int i = 0; i < n; i++) {
        float sum = hsum(acc[i]);
        for (int kk = k; kk < K; kk++) sum += a[kk] * x[i][kk];
        out[i] = sum;
    }
}

/* out[i][c0, c1) += sum_j t[i][j] bt[j][c0, c1) for the n rows, n a constant once inlined. */
static inline __attribute__((always_inline)) void axpys(float *const *out, const float *const *t, const float *bt,
                                                        int r, int N, int c0, int c1, const int n) {
    int c = c0;
    for (; c + VW <= c1; c += VW) {
        vf acc[GROUP_ROWS];
        for (int i = 0; i < n; i++) acc[i] = (vf){0};
        for (int j = 0; j < r; j++) {
            const vf bv = ld(bt + (int64_t)j * N + c);
            for (int i = 0; i < n; i++) acc[i] += t[i][j] * bv;
        }
        for (int i = 0; i < n; i++) st(out[i] + c, ld(out[i] + c) + acc[i]);
    }
    for (; c < c1; c++)
        for (int i = 0; i < n; i++) {
            float sum = 0.0f;
            for (int j = 0; j < r; j++) sum += t[i][j] * bt[(int64_t)j * N + c];
            out[i][c] += sum;
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
    const float *xs[GROUP_ROWS];
    const int64_t *rows = s->rows + grp[1];
    for (int i = 0; i < n; i++) xs[i] = x + rows[i] * K;
    float tj[GROUP_ROWS];
    for (int j = 0; j < M->r; j++) {
#define SHRINK(c) dots(tj, M->a + (int64_t)j * K, xs, c, K)
        BY_ROWS(n, SHRINK)
#undef SHRINK
        for (int i = 0; i < n; i++) s->tmp[rows[i] * s->max_rank + j] = tj[i];
    }
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
    for (int i = 0; i < n; i++) {
        outs[i] = out + rows[i] * ld;
        ts[i] = s->tmp + rows[i] * s->max_rank;
    }
#define EXPAND(c) axpys(outs, ts, M->bt, M->r, N, c0, c1, c)
    BY_ROWS(n, EXPAND)
#undef EXPAND
}
