/*
 * Weight-only quantized matmuls on CPU: out[M, N] (+)= x[M, K] @ W[N, K]^T with W stored as 4-bit or 8-bit
 * integers in groups of 32 along K, dequantized in registers.
 *
 * Why: one decode step of a small model reads every weight once, so its speed is the weights' bytes over the
 * memory bandwidth. A GGUF's Q4_1 weights are 0.625 bytes each against 2 (bfloat16) or 4 (float32) dense.
 * torch's int4 CPU kernel is fast only with bfloat16 activations and rounds the scales to bfloat16; this one
 * takes float32 activations and dequantizes to exactly the file's values (w = d * q + m, d and m the file's
 * float16 numbers), so the only difference from a dense float32 matmul is the order of the sums.
 *
 * Layout ("tiles"): columns (output features) in blocks of 16, K in groups of 32. One (column block, group)
 * tile holds the 16 columns' scales as float16, then their 512 weights in 16 rows r = 0..15, row r holding
 * k = 2r and 2r + 1 of every column, i.e. the VNNI order of an AMX bfloat16 B tile:
 *   q4: d[16] f16, m[16] f16, then 16 rows of 16 bytes: byte j: low nibble = column j/2, high nibble = column
 *       8 + j/2, both at k = 2r + j%2 (320 bytes per tile = 0.625 bytes a weight, as the GGUF)
 *   q8: d[16] f16, then 16 rows of 32 signed bytes: byte e = column e/2 at k = 2r + e%2 (m = 0)
 * A row dequantizes into two float vectors (columns 0..7 and 8..15, each k pair side by side); a lane
 * accumulates w * x over the even or the odd k of its column, and the two lanes are added at the end.
 *
 * Every output element is summed in the same order whatever M is and whichever path serves it (dequantize
 * per row block, or a whole column panel dequantized into a buffer once for many rows), so a sequence's
 * result does not depend on what else is in the batch. The SIMD is GCC/Clang vector types: 16 floats are one
 * AVX-512 register, two AVX2 ones, four on NEON. Compiled without -ffast-math so that nothing reassociates.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_matmul.h"

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16), aligned(1)));
typedef int8_t v16sb __attribute__((vector_size(16), aligned(1)));
typedef _Float16 v16h __attribute__((vector_size(32), aligned(2)));
typedef double v8d __attribute__((vector_size(64)));

#ifdef __AVX512F__
#define MR 6 /* rows of x per register block: 2 accumulators each, 32 registers */
#else
#define MR 2 /* 16 (AVX2) or 32 (NEON) registers of half or a quarter the width */
#endif

int qtile_bytes(int fmt) { return fmt == QFMT_Q4 ? 64 + 256 : 32 + 512; }

static inline v16 ldu(const float *p) { return *(const v16u *)p; }

/* A pair of x values (k, k+1) repeated in all eight 64-bit lanes. */
static inline v16 pair(const float *x) {
    double d;
    memcpy(&d, x, 8);
    return (v16)((v8d){0} + d);
}

typedef struct {
    v16 dlo, dhi, mlo, mhi; /* each column's scale / minimum, twice over: lanes of columns 0..7, 8..15 */
} Scales;

static inline Scales tile_scales(const uint8_t *tile, int fmt) {
    const v16 d = __builtin_convertvector(*(const v16h *)tile, v16);
    const v16i lo = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7}, hi = lo + 8;
    Scales s = {__builtin_shuffle(d, lo), __builtin_shuffle(d, hi), (v16){0}, (v16){0}};
    if (fmt == QFMT_Q4) {
        const v16 m = __builtin_convertvector(*(const v16h *)(tile + 32), v16);
        s.mlo = __builtin_shuffle(m, lo);
        s.mhi = __builtin_shuffle(m, hi);
    }
    return s;
}

/* Row r of a tile as floats: *lo = columns 0..7, *hi = columns 8..15, k pairs side by side. */
static inline __attribute__((always_inline)) void tile_row(const uint8_t *tile, int fmt, int r, const Scales *s,
                                                           v16 *lo, v16 *hi) {
    if (fmt == QFMT_Q4) {
        const v16i b = __builtin_convertvector(*(const v16b *)(tile + 64 + 16 * r), v16i);
        *lo = __builtin_convertvector(b & 15, v16) * s->dlo + s->mlo;
        *hi = __builtin_convertvector(b >> 4, v16) * s->dhi + s->mhi;
    } else {
        const uint8_t *q = tile + 32 + 32 * r;
        *lo = __builtin_convertvector(__builtin_convertvector(*(const v16sb *)q, v16i), v16) * s->dlo;
        *hi = __builtin_convertvector(__builtin_convertvector(*(const v16sb *)(q + 16), v16i), v16) * s->dhi;
    }
}

/* Sum each lane pair and write the 16 columns (only the first n_valid) of one output row. */
static inline void store_cols(float *o, v16 lo, v16 hi, const float *bias, int n_valid, int accumulate) {
    const v16i swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    const v16i even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    lo += __builtin_shuffle(lo, swap);
    hi += __builtin_shuffle(hi, swap);
    v16 r = __builtin_shuffle(lo, hi, even);
    float tmp[16];
    memcpy(tmp, &r, sizeof tmp);
    for (int c = 0; c < n_valid; c++) {
        float v = tmp[c] + (bias ? bias[c] : 0.0f);
        o[c] = accumulate ? o[c] + v : v;
    }
}

/* nr (<= MR) rows of x against one column block, dequantizing each tile row in registers. */
static inline __attribute__((always_inline)) void block_direct(const QMatmul *a, const uint8_t *col, int m0,
                                                               const int nr, int cb) {
    v16 acc[2 * MR];
    for (int i = 0; i < 2 * nr; i++) acc[i] = (v16){0};
    const int tb = qtile_bytes(a->fmt);
    for (int g = 0; g < a->G; g++) {
        const uint8_t *tile = col + (int64_t)g * tb;
        const Scales s = tile_scales(tile, a->fmt);
        for (int r = 0; r < 16; r++) {
            v16 lo, hi;
            tile_row(tile, a->fmt, r, &s, &lo, &hi);
            for (int i = 0; i < nr; i++) {
                const v16 xp = pair(a->x + (int64_t)(m0 + i) * a->ldx + 32 * g + 2 * r);
                acc[2 * i] += lo * xp;
                acc[2 * i + 1] += hi * xp;
            }
        }
    }
    const int n_valid = a->N - 16 * cb < 16 ? a->N - 16 * cb : 16;
    for (int i = 0; i < nr; i++)
        store_cols(a->out + (int64_t)(m0 + i) * a->ldo + 16 * cb, acc[2 * i], acc[2 * i + 1],
                   a->bias ? a->bias + 16 * cb : NULL, n_valid, a->accumulate);
}

/* The same sums from a column panel dequantized once into `panel` ([G][16 rows][32 floats]). */
static inline __attribute__((always_inline)) void block_panel(const QMatmul *a, const float *panel, int m0,
                                                              const int nr, int cb) {
    v16 acc[2 * MR];
    for (int i = 0; i < 2 * nr; i++) acc[i] = (v16){0};
    for (int g = 0; g < a->G; g++) {
        for (int r = 0; r < 16; r++) {
            const float *w = panel + ((int64_t)g * 16 + r) * 32;
            const v16 lo = ldu(w), hi = ldu(w + 16);
            for (int i = 0; i < nr; i++) {
                const v16 xp = pair(a->x + (int64_t)(m0 + i) * a->ldx + 32 * g + 2 * r);
                acc[2 * i] += lo * xp;
                acc[2 * i + 1] += hi * xp;
            }
        }
    }
    const int n_valid = a->N - 16 * cb < 16 ? a->N - 16 * cb : 16;
    for (int i = 0; i < nr; i++)
        store_cols(a->out + (int64_t)(m0 + i) * a->ldo + 16 * cb, acc[2 * i], acc[2 * i + 1],
                   a->bias ? a->bias + 16 * cb : NULL, n_valid, a->accumulate);
}

#define DISPATCH(fn, nr, ...)                                                                                  \
    switch (nr) {                                                                                              \
    case 1: fn(__VA_ARGS__, 1, cb); break;                                                                     \
    case 2: fn(__VA_ARGS__, 2, cb); break;                                                                     \
    case 3: fn(__VA_ARGS__, 3 < MR ? 3 : MR, cb); break;                                                       \
    case 4: fn(__VA_ARGS__, 4 < MR ? 4 : MR, cb); break;                                                       \
    case 5: fn(__VA_ARGS__, 5 < MR ? 5 : MR, cb); break;                                                       \
    default: fn(__VA_ARGS__, MR, cb); break;                                                                   \
    }

static void dequant_panel(const QMatmul *a, const uint8_t *col, float *panel) {
    const int tb = qtile_bytes(a->fmt);
    for (int g = 0; g < a->G; g++) {
        const uint8_t *tile = col + (int64_t)g * tb;
        const Scales s = tile_scales(tile, a->fmt);
        for (int r = 0; r < 16; r++) {
            v16 lo, hi;
            tile_row(tile, a->fmt, r, &s, &lo, &hi);
            float *w = panel + ((int64_t)g * 16 + r) * 32;
            *(v16u *)w = lo;
            *(v16u *)(w + 16) = hi;
        }
    }
}

/* One column block for all M rows: direct for a few rows, through a dequantized panel for many. */
void qmm_column_block(const QMatmul *a, int cb, float *panel) {
    const uint8_t *col = a->w + (int64_t)cb * a->G * qtile_bytes(a->fmt);
    if (a->M <= MR || panel == NULL) {
        for (int m0 = 0; m0 < a->M; m0 += MR) {
            const int nr = a->M - m0 < MR ? a->M - m0 : MR;
            DISPATCH(block_direct, nr, a, col, m0)
        }
        return;
    }
    dequant_panel(a, col, panel);
    for (int m0 = 0; m0 < a->M; m0 += MR) {
        const int nr = a->M - m0 < MR ? a->M - m0 : MR;
        DISPATCH(block_panel, nr, a, panel, m0)
    }
}

/* Returns 0, or -1 (out of memory) / -2 (bad sizes). */
int qmm_f32(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads) {
    if (M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || ldx < K || ldo < N || (fmt != QFMT_Q4 && fmt != QFMT_Q8))
        return -2;
    QMatmul a = {out, x, w, bias, M, N, K / 32, ldx, ldo, fmt, accumulate};
    const int NB = (N + 15) / 16;
    if (num_threads > NB) num_threads = NB;
    if (num_threads < 1) num_threads = 1;
    int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *panel = a.M > MR ? malloc((size_t)K * 16 * sizeof(float)) : NULL;
        if (a.M > MR && panel == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(static)
        for (int cb = 0; cb < NB; cb++)
            if (a.M <= MR || panel) qmm_column_block(&a, cb, panel);
        free(panel);
    }
    return status;
}

/* Rows `ids` of W (columns of the matmul) as float32: the embedding lookup of a tied, quantized table. */
int qrows_f32(float *out, const int64_t *ids, int T, const uint8_t *w, int N, int K, int fmt) {
    if (K % 32 != 0 || (fmt != QFMT_Q4 && fmt != QFMT_Q8)) return -2;
    const int G = K / 32, tb = qtile_bytes(fmt);
    for (int t = 0; t < T; t++) {
        const int64_t n = ids[t];
        if (n < 0 || n >= N) return -3;
        const int c = (int)(n % 16);
        const uint8_t *col = w + (n / 16) * G * tb;
        for (int g = 0; g < G; g++) {
            const uint8_t *tile = col + (int64_t)g * tb;
            _Float16 d16, m16 = 0;
            memcpy(&d16, tile + 2 * c, 2);
            if (fmt == QFMT_Q4) memcpy(&m16, tile + 32 + 2 * c, 2);
            const float d = (float)d16, m = (float)m16;
            for (int k = 0; k < 32; k++) {
                const int r = k / 2, e = 2 * (c % 8) + k % 2;
                float q;
                if (fmt == QFMT_Q4) {
                    const uint8_t byte = tile[64 + 16 * r + e];
                    q = (float)(c < 8 ? byte & 15 : byte >> 4);
                } else {
                    q = (float)(int8_t)tile[32 + 32 * r + 2 * c + k % 2];
                }
                out[(int64_t)t * K + 32 * g + k] = q * d + m;
            }
        }
    }
    return 0;
}
