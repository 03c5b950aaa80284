/*
 * Weight-only quantized matmuls on CPU: out[M, N] (+)= x[M, K] @ W[N, K]^T with W stored as 4-bit or 8-bit
 * integers in groups of 32 along K, dequantized in registers.
 *
 * Why: one decode step of a small model reads every weight once, so its speed is the weights' bytes over the
 * memory bandwidth. A GGUF's Q4_1 weights are 0.625 bytes each against 2 (bfloat16) or 4 (float32) dense.
 * torch's int4 CPU kernel is fast only with bfloat16 activations and rounds the scales to bfloat16; this one
 * takes float32 activations and dequantizes to exactly the file's values (w = d * q + m, d and m the file's
 * float16 numbers; d * q is exact in float32), so the only difference from a dense float32 matmul is the
 * order of the sums.
 *
 * Layout ("tiles"): columns (output features) in blocks of 16, K in groups of 32. One (column block, group)
 * tile holds the 16 columns' scales as float16, then their 512 weights in 16 rows r = 0..15, row r holding
 * k = 2r and 2r + 1 of every column, i.e. the VNNI order of an AMX bfloat16 B tile:
 *   q4: d[16] f16, m[16] f16, then 16 rows of 16 bytes: byte j: low nibble = column j/2, high nibble = column
 *       8 + j/2, both at k = 2r + j%2 (320 bytes per tile = 0.625 bytes a weight, as the GGUF)
 *   q8: d[16] f16, then 16 rows of 32 signed bytes: byte e = column e/2 at k = 2r + e%2 (m = 0)
 * A dequantized row is 32 floats, each k pair of a column side by side; a lane accumulates w * x over the
 * even or the odd k of its column, and the two lanes are added at the end.
 *
 * Two implementations of the same kernel, chosen at compile time: 16 floats a vector for AVX-512 (6 rows of
 * x per register block, 32 registers), and 8 floats a vector for AVX2 (x86-64-v3: Haswell, Zen 1-3) and the
 * portable C path of every other CPU (16 registers: fewer accumulators per row, so more rows fit). Both take
 * two routes: a few rows dequantize each tile row in registers once for all of them ("direct"); many rows
 * dequantize a column block once into a float32 panel that stays in the cache and run a register-blocked
 * micro-kernel over it ("panel": prefill as a blocked GEMM, without a second copy of the weights). Within one
 * build, every output element is summed in the same order whichever route serves it, so a sequence's result
 * does not depend on what else is in the batch. The conversions (float16, bytes, nibbles) are intrinsics: GCC
 * makes scalar code of their generic forms. Compiled without -ffast-math so that nothing reassociates.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_matmul.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

/* Which vector path this build took (cpu_kernel.isa()): a vector class that fell back to the portable loops is
 * a regression the tests must see. */
const char *kernel_isa(void) {
#if defined(__AVX512F__)
#define MATMUL_ISA "avx512"
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define MATMUL_ISA "avx2"
#else
#define MATMUL_ISA "portable"
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return "matmul=" MATMUL_ISA " amx=yes";
#else
    return "matmul=" MATMUL_ISA " amx=no";
#endif
}

static inline int tile_bytes(int fmt) { return fmt == QFMT_Q4 ? 64 + 256 : 32 + 512; }
int qtile_bytes(int fmt) { return tile_bytes(fmt); }

#ifdef __AVX512F__ /* ---- 16 floats a vector -------------------------------------------------------------- */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define MR 6 /* rows of x per register block: 4 accumulators each, of 32 registers */

static inline v16 ldu(const float *p) { return *(const v16u *)p; }

/* A pair of x values (k, k+1) repeated in all eight 64-bit lanes. */
static inline v16 pair(const float *x) { return (v16)_mm512_castpd_ps(_mm512_set1_pd(*(const double *)x)); }

typedef struct {
    v16 dlo, dhi, mlo, mhi; /* each column's scale / minimum, twice over: lanes of columns 0..7, 8..15 */
} Scales;

static inline v16 f16x16(const uint8_t *p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline v16 s8x16(const uint8_t *p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void nibbles(const uint8_t *p, v16 *lo, v16 *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

static inline Scales tile_scales(const uint8_t *tile, int fmt) {
    const v16 d = f16x16(tile);
    const v16i lo = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7}, hi = lo + 8;
    Scales s = {__builtin_shuffle(d, lo), __builtin_shuffle(d, hi), (v16){0}, (v16){0}};
    if (fmt == QFMT_Q4) {
        const v16 m = f16x16(tile + 32);
        s.mlo = __builtin_shuffle(m, lo);
        s.mhi = __builtin_shuffle(m, hi);
    }
    return s;
}

/* Row r of a tile as floats: *lo = columns 0..7, *hi = columns 8..15, k pairs side by side. */
static inline __attribute__((always_inline)) void tile_row(const uint8_t *tile, int fmt, int r, const Scales *s,
                                                           v16 *lo, v16 *hi) {
    if (fmt == QFMT_Q4) {
        v16 qlo, qhi;
        nibbles(tile + 64 + 16 * r, &qlo, &qhi);
        *lo = qlo * s->dlo + s->mlo;
        *hi = qhi * s->dhi + s->mhi;
    } else {
        const uint8_t *q = tile + 32 + 32 * r;
        *lo = s8x16(q) * s->dlo;
        *hi = s8x16(q + 16) * s->dhi;
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

/* Each output sums in one fixed order whatever the path: lane k-parity x row-parity partial sums over the
 * groups (four accumulators per row, so that one row alone still has four FMA chains to overlap), added at
 * the end as (even rows + odd rows), then the two lanes of a column. */
static inline __attribute__((always_inline)) void finish_rows(const QMatmul *a, v16 *acc, int m0, const int nr,
                                                              int cb) {
    const int n_valid = a->N - 16 * cb < 16 ? a->N - 16 * cb : 16;
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++)
        store_cols(a->out + (int64_t)(m0 + i) * a->ldo + 16 * cb, acc[4 * i] + acc[4 * i + 2],
                   acc[4 * i + 1] + acc[4 * i + 3], a->bias ? a->bias + 16 * cb : NULL, n_valid, a->accumulate);
}

static inline __attribute__((always_inline)) void fma_rows(const QMatmul *a, v16 *acc, int m0, const int nr, int k,
                                                           const int odd, v16 lo, v16 hi) {
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++) {
        const v16 xp = pair(a->x + (int64_t)(m0 + i) * a->ldx + k);
        acc[4 * i + 2 * odd] += lo * xp;
        acc[4 * i + 2 * odd + 1] += hi * xp;
    }
}

/* nr (<= MR) rows of x against one column block, dequantizing each tile row in registers. */
static inline __attribute__((always_inline)) void block_direct(const QMatmul *a, const uint8_t *col, int m0,
                                                               const int fmt, const int nr, int cb) {
    v16 acc[4 * MR];
#pragma GCC unroll 32
    for (int i = 0; i < 4 * nr; i++) acc[i] = (v16){0};
    const int tb = tile_bytes(fmt);
    for (int g = 0; g < a->G; g++) {
        const uint8_t *tile = col + (int64_t)g * tb;
        const Scales s = tile_scales(tile, fmt);
        for (int r = 0; r < 16; r += 2) {
            v16 lo, hi;
            tile_row(tile, fmt, r, &s, &lo, &hi);
            fma_rows(a, acc, m0, nr, 32 * g + 2 * r, 0, lo, hi);
            tile_row(tile, fmt, r + 1, &s, &lo, &hi);
            fma_rows(a, acc, m0, nr, 32 * g + 2 * r + 2, 1, lo, hi);
        }
    }
    finish_rows(a, acc, m0, nr, cb);
}

/* The same sums from a column panel dequantized once into `panel` ([G][16 rows][32 floats]). */
static inline __attribute__((always_inline)) void block_panel(const QMatmul *a, const float *panel, int m0,
                                                              const int nr, int cb) {
    v16 acc[4 * MR];
#pragma GCC unroll 32
    for (int i = 0; i < 4 * nr; i++) acc[i] = (v16){0};
    for (int g = 0; g < a->G; g++) {
        for (int r = 0; r < 16; r += 2) {
            const float *w = panel + ((int64_t)g * 16 + r) * 32;
            fma_rows(a, acc, m0, nr, 32 * g + 2 * r, 0, ldu(w), ldu(w + 16));
            fma_rows(a, acc, m0, nr, 32 * g + 2 * r + 2, 1, ldu(w + 32), ldu(w + 48));
        }
    }
    finish_rows(a, acc, m0, nr, cb);
}

#define DISPATCH(fn, nr, ...)                                                                                  \
    switch (nr) {                                                                                              \
    case 1: fn(__VA_ARGS__, 1, cb); break;                                                                     \
    case 2: fn(__VA_ARGS__, 2 < MR ? 2 : MR, cb); break;                                                       \
    case 3: fn(__VA_ARGS__, 3 < MR ? 3 : MR, cb); break;                                                       \
    case 4: fn(__VA_ARGS__, 4 < MR ? 4 : MR, cb); break;                                                       \
    case 5: fn(__VA_ARGS__, 5 < MR ? 5 : MR, cb); break;                                                       \
    default: fn(__VA_ARGS__, MR, cb); break;                                                                   \
    }

static void dequant_panel(const QMatmul *a, const uint8_t *col, float *panel) {
    const int tb = tile_bytes(a->fmt);
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
    const uint8_t *col = a->w + (int64_t)cb * a->G * tile_bytes(a->fmt);
    if (a->M <= MR || panel == NULL) {
        for (int m0 = 0; m0 < a->M; m0 += MR) {
            const int nr = a->M - m0 < MR ? a->M - m0 : MR;
            if (a->fmt == QFMT_Q4) {
                DISPATCH(block_direct, nr, a, col, m0, QFMT_Q4)
            } else {
                DISPATCH(block_direct, nr, a, col, m0, QFMT_Q8)
            }
        }
        return;
    }
    dequant_panel(a, col, panel);
    for (int m0 = 0; m0 < a->M; m0 += MR) {
        const int nr = a->M - m0 < MR ? a->M - m0 : MR;
        DISPATCH(block_panel, nr, a, panel, m0)
    }
}
#else /* ---- 8 floats a vector: AVX2, and the portable C path ---------------------------------------------- */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double v4d __attribute__((vector_size(32)));

/* A dequantized tile row is four vectors ("quads"): quad q holds columns 4q..4q+3, each k pair side by side.
 * A direct block keeps 4 accumulators a row (MR rows); a panel block takes half the columns (2 quads), so that
 * PR rows of 2 accumulators, 2 weight vectors and x fit in 16 registers. */
#define MR 2
#define PR 6

static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline v8 tof(v8i x) { return __builtin_convertvector(x, v8); }

#if defined(__AVX2__) && defined(__F16C__)
static inline v8 pair8(const float *x) { return (v8)_mm256_castpd_ps(_mm256_broadcast_sd((const double *)x)); }
static inline v8 f16x8(const uint8_t *p) { return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline v8i u8x8(const uint8_t *p) { return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline v8i s8x8(const uint8_t *p) { return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline v8 pair8(const float *x) {
    double d;
    memcpy(&d, x, 8);
    return (v8)((v4d){0} + d);
}
static inline v8 f16x8(const uint8_t *p) {
    v8 r;
    for (int i = 0; i < 8; i++) {
        _Float16 h;
        memcpy(&h, p + 2 * i, 2);
        r[i] = (float)h;
    }
    return r;
}
static inline v8i u8x8(const uint8_t *p) {
    v8i r;
    for (int i = 0; i < 8; i++) r[i] = p[i];
    return r;
}
static inline v8i s8x8(const uint8_t *p) {
    v8i r;
    for (int i = 0; i < 8; i++) r[i] = (int8_t)p[i];
    return r;
}
#endif

typedef struct {
    v8 d[4], m[4]; /* per quad: its four columns' scale / minimum, each twice (k even, k odd) */
} Scales8;

static inline Scales8 tile_scales8(const uint8_t *tile, int fmt) {
    const v8i a = {0, 0, 1, 1, 2, 2, 3, 3}, b = a + 4;
    const v8 d0 = f16x8(tile), d1 = f16x8(tile + 16);
    Scales8 s = {{__builtin_shuffle(d0, a), __builtin_shuffle(d0, b), __builtin_shuffle(d1, a),
                  __builtin_shuffle(d1, b)},
                 {{0}, {0}, {0}, {0}}};
    if (fmt == QFMT_Q4) {
        const v8 m0 = f16x8(tile + 32), m1 = f16x8(tile + 48);
        s.m[0] = __builtin_shuffle(m0, a);
        s.m[1] = __builtin_shuffle(m0, b);
        s.m[2] = __builtin_shuffle(m1, a);
        s.m[3] = __builtin_shuffle(m1, b);
    }
    return s;
}

/* Row r of a tile as its four quads. q4 bytes 0-7 hold columns 0-3 (low nibbles) and 8-11 (high), bytes
 * 8-15 columns 4-7 and 12-15; q8 bytes 8q..8q+7 hold quad q. */
static inline __attribute__((always_inline)) void tile_row8(const uint8_t *tile, int fmt, int r, const Scales8 *s,
                                                            v8 w[4]) {
    if (fmt == QFMT_Q4) {
        const uint8_t *q = tile + 64 + 16 * r;
        const v8i b0 = u8x8(q), b1 = u8x8(q + 8);
        w[0] = tof(b0 & 15) * s->d[0] + s->m[0];
        w[1] = tof(b1 & 15) * s->d[1] + s->m[1];
        w[2] = tof(b0 >> 4) * s->d[2] + s->m[2];
        w[3] = tof(b1 >> 4) * s->d[3] + s->m[3];
    } else {
        const uint8_t *q = tile + 32 + 32 * r;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) w[i] = tof(s8x8(q + 8 * i)) * s->d[i];
    }
}

/* Sum each lane pair of one quad and write its (up to) 4 columns of one output row. */
static inline void store_quad(float *o, v8 acc, const float *bias, int n_valid, int accumulate) {
    const v8i swap = {1, 0, 3, 2, 5, 4, 7, 6};
    acc += __builtin_shuffle(acc, swap);
    for (int c = 0; c < 4 && c < n_valid; c++) {
        const float v = acc[2 * c] + (bias ? bias[c] : 0.0f);
        o[c] = accumulate ? o[c] + v : v;
    }
}

/* Quads q0..q0+nq-1 of rows m0..m0+nr-1 from their accumulators (acc[i * stride + q]). */
static inline __attribute__((always_inline)) void store_quads(const QMatmul *a, const v8 *acc, int m0, const int nr,
                                                              int cb, int q0, const int nq, const int stride) {
#pragma GCC unroll 6
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 4
        for (int q = 0; q < nq; q++) {
            const int col = 16 * cb + 4 * (q0 + q);
            if (col < a->N)
                store_quad(a->out + (int64_t)(m0 + i) * a->ldo + col, acc[i * stride + q],
                           a->bias ? a->bias + col : NULL, a->N - col, a->accumulate);
        }
}

/* nr (<= MR) rows of x against one column block, dequantizing each tile row in registers; k pair j = 16 g + r. */
static inline __attribute__((always_inline)) void block_direct(const QMatmul *a, const uint8_t *col, int m0,
                                                               const int fmt, const int nr, int cb) {
    v8 acc[4 * MR];
#pragma GCC unroll 8
    for (int i = 0; i < 4 * nr; i++) acc[i] = (v8){0};
    const int tb = tile_bytes(fmt);
    const float *x = a->x + (int64_t)m0 * a->ldx;
    for (int g = 0; g < a->G; g++) {
        const uint8_t *tile = col + (int64_t)g * tb;
        const Scales8 s = tile_scales8(tile, fmt);
        for (int r = 0; r < 16; r++) {
            v8 w[4];
            tile_row8(tile, fmt, r, &s, w);
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++) {
                const v8 xp = pair8(x + (int64_t)i * a->ldx + 32 * g + 2 * r);
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) acc[4 * i + q] += w[q] * xp;
            }
        }
    }
    store_quads(a, acc, m0, nr, cb, 0, 4, 4);
}

/* The same sums for columns 8 h .. 8 h + 7 of the block, from the panel ([16 G][32 floats]). */
static inline __attribute__((always_inline)) void block_panel(const QMatmul *a, const float *panel, int m0,
                                                              const int nr, int cb, int h) {
    v8 acc[2 * PR];
#pragma GCC unroll 12
    for (int i = 0; i < 2 * nr; i++) acc[i] = (v8){0};
    const float *x = a->x + (int64_t)m0 * a->ldx;
    for (int j = 0; j < 16 * a->G; j++) {
        const v8 w0 = ld8(panel + 32 * j + 16 * h), w1 = ld8(panel + 32 * j + 16 * h + 8);
#pragma GCC unroll 6
        for (int i = 0; i < nr; i++) {
            const v8 xp = pair8(x + (int64_t)i * a->ldx + 2 * j);
            acc[2 * i] += w0 * xp;
            acc[2 * i + 1] += w1 * xp;
        }
    }
    store_quads(a, acc, m0, nr, cb, 2 * h, 2, 2);
}

static void dequant_panel(const QMatmul *a, const uint8_t *col, float *panel) {
    const int tb = tile_bytes(a->fmt);
    for (int g = 0; g < a->G; g++) {
        const uint8_t *tile = col + (int64_t)g * tb;
        const Scales8 s = tile_scales8(tile, a->fmt);
        for (int r = 0; r < 16; r++) {
            v8 w[4];
            tile_row8(tile, a->fmt, r, &s, w);
            for (int q = 0; q < 4; q++) *(v8u *)(panel + ((int64_t)g * 16 + r) * 32 + 8 * q) = w[q];
        }
    }
}

/* One column block for all M rows: direct for a few rows, through a dequantized panel for many. */
void qmm_column_block(const QMatmul *a, int cb, float *panel) {
    const uint8_t *col = a->w + (int64_t)cb * a->G * tile_bytes(a->fmt);
    if (a->M <= MR || panel == NULL) {
        for (int m0 = 0; m0 < a->M; m0 += MR) {
            const int one = a->M - m0 < 2;
            if (a->fmt == QFMT_Q4) {
                if (one) block_direct(a, col, m0, QFMT_Q4, 1, cb);
                else block_direct(a, col, m0, QFMT_Q4, MR, cb);
            } else {
                if (one) block_direct(a, col, m0, QFMT_Q8, 1, cb);
                else block_direct(a, col, m0, QFMT_Q8, MR, cb);
            }
        }
        return;
    }
    dequant_panel(a, col, panel);
    const int halves = a->N - 16 * cb > 8 ? 2 : 1;
    for (int m0 = 0; m0 < a->M; m0 += PR) {
        const int nr = a->M - m0 < PR ? a->M - m0 : PR;
        for (int h = 0; h < halves; h++) {
            switch (nr) {
            case 1: block_panel(a, panel, m0, 1, cb, h); break;
            case 2: block_panel(a, panel, m0, 2, cb, h); break;
            case 3: block_panel(a, panel, m0, 3, cb, h); break;
            case 4: block_panel(a, panel, m0, 4, cb, h); break;
            case 5: block_panel(a, panel, m0, 5, cb, h); break;
            default: block_panel(a, panel, m0, PR, cb, h); break;
            }
        }
    }
}
#endif

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
    const int G = K / 32, tb = tile_bytes(fmt);
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

/* ---- bfloat16 x quantized weights on AMX (Sapphire Rapids and later) ------------------------------------------
 * For steps of many rows the matmul is bound by arithmetic, not by the weights' bytes: AMX multiplies 16 x 32
 * bfloat16 tiles at many times the AVX-512 float32 rate. A tile of our layout is exactly an AMX B tile once
 * each row is converted to bfloat16, so a column block is dequantized once into [G][16][32] bfloat16 (one B
 * tile per group) and multiplied with every 16-row tile of x. The weights round to bfloat16 here, as they do
 * in a dense bfloat16 model; this path serves only --dtype bfloat16. */
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

int qmm_amx_available(void) {
    static int state = -1; /* asking twice is harmless, so no lock */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* Tiles 0-3: float32 accumulators, 4-5: rows of x, 6-7: weights; all 16 rows of 64 bytes. A constant: GCC
 * does not see that ldtilecfg reads its operand and drops stores to a local one. */
static const TileConfig TILES = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

/* Configures the calling thread's tiles (per thread: call in each thread of a parallel region). */
void qmm_amx_begin(void) { _tile_loadconfig(&TILES); }

void qmm_amx_end(void) { _tile_release(); }

static void dequant_bf16(const uint8_t *col, int fmt, int G, uint16_t *dst) {
    const int tb = tile_bytes(fmt);
    for (int g = 0; g < G; g++) {
        const uint8_t *tile = col + (int64_t)g * tb;
        const Scales s = tile_scales(tile, fmt);
        for (int r = 0; r < 16; r++) {
            v16 lo, hi;
            tile_row(tile, fmt, r, &s, &lo, &hi);
            _mm512_storeu_si512(dst + ((int64_t)g * 16 + r) * 32, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
        }
    }
}

static void store_tile(const QMatmulBf16 *a, int m0, int cb, float tile[16][16]) {
    const int n_valid = a->N - 16 * cb < 16 ? a->N - 16 * cb : 16;
    const __mmask16 mask = (__mmask16)((1u << n_valid) - 1);
    const __m512 bias = a->bias ? _mm512_maskz_loadu_ps(mask, a->bias + 16 * cb) : _mm512_setzero_ps();
    for (int i = 0; i < 16 && m0 + i < a->M; i++) {
        float *o = a->out + (int64_t)(m0 + i) * a->ldo + 16 * cb;
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(tile[i]), bias);
        if (a->accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o));
        _mm512_mask_storeu_ps(o, mask, v);
    }
}

/* Column blocks 2p and 2p+1 for all rows; `bbuf` holds 2 * G * 512 bfloat16. Tiles must be configured. */
void qmm_amx_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) {
    const int NB = (a->N + 15) / 16, cb0 = 2 * p, has1 = cb0 + 1 < NB, G = a->G, tb = tile_bytes(a->fmt);
    dequant_bf16(a->w + (int64_t)cb0 * G * tb, a->fmt, G, bbuf);
    if (has1) dequant_bf16(a->w + (int64_t)(cb0 + 1) * G * tb, a->fmt, G, bbuf + (int64_t)G * 512);
    float tile[16][16];
    for (int m0 = 0; m0 < a->M; m0 += 32) {
        const int two = m0 + 16 < a->M;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int g = 0; g < G; g++) {
            const uint16_t *xa = a->xb + ((int64_t)(m0 / 16) * G + g) * 512; /* tiles of x lie back to back */
            _tile_loadd(4, xa, 64);
            _tile_loadd(6, bbuf + (int64_t)g * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(5, xa + (int64_t)G * 512, 64);
                _tile_dpbf16ps(2, 5, 6);
            }
            if (has1) {
                _tile_loadd(7, bbuf + (int64_t)(G + g) * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, tile, 64);
        store_tile(a, m0, cb0, tile);
        if (has1) {
            _tile_stored(1, tile, 64);
            store_tile(a, m0, cb0 + 1, tile);
        }
        if (two) {
            _tile_stored(2, tile, 64);
            store_tile(a, m0 + 16, cb0, tile);
            if (has1) {
                _tile_stored(3, tile, 64);
                store_tile(a, m0 + 16, cb0 + 1, tile);
            }
        }
    }
}

/* Row m of x (float32, K = 32 G) as bfloat16, rounded to nearest even, into xb laid out as AMX A tiles:
 * [m / 16][G][m % 16][32], so that every tile is 1 KB in one piece. */
void qmm_amx_convert_row(uint16_t *xb, const float *x, int m, int G) {
    uint16_t *dst = xb + (int64_t)(m / 16) * G * 512 + (m % 16) * 32;
    for (int g = 0; g < G; g++)
        _mm512_storeu_si512(dst + (int64_t)g * 512, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * g + 16),
                                                                                 _mm512_loadu_ps(x + 32 * g)));
}
#else
int qmm_amx_available(void) { return 0; }
void qmm_amx_begin(void) {}
void qmm_amx_end(void) {}
void qmm_amx_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) { (void)a, (void)p, (void)bbuf; }
void qmm_amx_convert_row(uint16_t *xb, const float *x, int m, int G) { (void)xb, (void)x, (void)m, (void)G; }
#endif

/* out[M, N] (+)= x[M, K] @ W^T on AMX with x rounded to bfloat16. Returns 0, -1 (out of memory), -2 (bad
 * sizes) or -6 (no AMX here). */
int qmm_amx(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads) {
    if (M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || ldx < K || ldo < N || (fmt != QFMT_Q4 && fmt != QFMT_Q8))
        return -2;
    if (!qmm_amx_available()) return -6;
    const int64_t m_pad = (M + 15) / 16 * 16; /* whole tiles of rows; the extra rows are zeros */
    uint16_t *xb = calloc((size_t)m_pad * K, sizeof(uint16_t));
    if (!xb) return -1;
    for (int m = 0; m < M; m++) qmm_amx_convert_row(xb, x + (int64_t)m * ldx, m, K / 32);
    QMatmulBf16 a = {out, xb, w, bias, M, N, K / 32, ldo, fmt, accumulate};
    const int pairs = ((N + 15) / 16 + 1) / 2;
    if (num_threads > pairs) num_threads = pairs;
    if (num_threads < 1) num_threads = 1;
    int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint16_t *bbuf = malloc((size_t)2 * a.G * 512 * sizeof(uint16_t));
        if (!bbuf) {
#pragma omp atomic write
            status = -1;
        }
        qmm_amx_begin();
#pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++)
            if (bbuf) qmm_amx_pair(&a, p, bbuf);
        qmm_amx_end();
        free(bbuf);
    }
    free(xb);
    return status;
}
