/*
 * Weight-only quantized matmuls on CPU: out[M, N] (+)= x[M, K] @ W[N, K]^T with W kept in (a repacking of) the
 * file's own format, dequantized in registers to exactly the file's values.
 *
 * Why: one decode step reads every weight once, so its speed is the weights' bytes over the memory bandwidth.
 * A GGUF's Q4_K weights are 0.56 bytes each against 2 (bfloat16) or 4 (float32) dense. torch's int4 CPU
 * kernel is fast only with bfloat16 activations and rounds the scales to bfloat16; these take float32
 * activations and compute each weight as gguf's reference dequantizer does (every product of a float16
 * scale and the small integers of a format is exact in float32, and the one rounding, of the final add, is
 * the reference's too), so the only difference from a dense float32 matmul is the order of the sums.
 *
 * Two float32 routes (this file): a few rows dequantize each tile row in registers once for all of them
 * ("direct"); many rows dequantize a column block once into a float32 panel that stays in the cache and run a
 * register-blocked micro-kernel over it ("panel": prefill as a blocked GEMM, without a second copy of the
 * weights). Within one build, every output element is summed in the same order whichever route serves it, so a
 * sequence's result does not depend on what else is in the batch. Compiled without -ffast-math so that nothing
 * reassociates. The tiles' layout and their dequantization are in qtile.h; the 16-bit integer route is
 * qmm_dot.c, the bfloat16 one (AVX-512 BF16, AMX) qmm_bf16.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qtile.h"

/* Which vector path this build took (cpu_kernel.isa()): a vector class that fell back to the portable loops is
 * a regression the tests must see. */
const char *kernel_isa(void) { return "matmul=" SIMD_MATMUL_ISA " dot=" SIMD_DOT_ISA " i8=" SIMD_I8_ISA " amx=" SIMD_AMX; }

#define P (VW == 16 ? 2 : 1) /* accumulators per vector and row: one per tile-row parity on AVX-512 */
#define PR 6                 /* rows per panel block, over VW columns: PR * 2 * P accumulators */
/* MR (qtile.h): rows per direct block, MR * NV * P accumulators (24 of 32, 8 of 16 registers) */

int64_t qcol_bytes(int fmt, int G) { return col_bytes(fmt, G); }

/* Columns col0.. of output row m from `sums` (two floats a column, the first its sum): + bias, written or added
 * to, up to N. Not inlined, and only for a clipped last block: its columns' branches, unrolled into every
 * instance of the blocks (21 rows of 16 columns per format at AVX-512), were most of this file's code and
 * compile time. */
static __attribute__((noinline)) void store_cols(const QMatmul *a, const float *sums, int m, int col0, int ncols) {
    float *o = a->out + (int64_t)m * a->ldo;
    for (int c = 0; c < ncols; c++) {
        const int n = col0 + c;
        if (n >= a->N) return;
        const float x = sums[2 * c] + (a->bias ? a->bias[n] : 0.0f);
        o[n] = a->accumulate ? o[n] + x : x;
    }
}

/* Sum the parities of each lane and each lane pair of one output row, and write its (valid) columns: a whole
 * block's in vectors (the even lanes of each vector pair, + bias, written or added to, lane by lane as
 * store_cols does one by one), a clipped last block's through store_cols. The sums go out through a copy: the
 * accumulators' own address never leaves the block, so they stay in registers. */
static inline __attribute__((always_inline)) void store_row(const QMatmul *a, const vf *acc, int m, int col0,
                                                            const int nv) {
    vi swap, even;
    for (int l = 0; l < VW; l++) swap[l] = l ^ 1, even[l] = 2 * l;
    vf t[NV];
    for (int v = 0; v < nv; v++) {
        t[v] = acc[v];
        if (P == 2) t[v] += acc[nv + v];
        t[v] += __builtin_shuffle(t[v], swap);
    }
    if (col0 + nv * VW / 2 <= a->N) {
        float *o = a->out + (int64_t)m * a->ldo + col0;
        for (int v = 0; v < nv; v += 2) {
            const vf x = __builtin_shuffle(t[v], t[v + 1], even) + (a->bias ? ld(a->bias + col0 + VW / 2 * v) : (vf){0});
            st(o + VW / 2 * v, a->accumulate ? ld(o + VW / 2 * v) + x : x);
        }
        return;
    }
    float sums[NV * VW];
    memcpy(sums, t, sizeof(vf) * nv);
    store_cols(a, sums, m, col0, nv * VW / 2);
}

/* acc[(i * P + p) * nv + v] += w[v] * x(row m0 + i, k pair at k) for tile-row parity p. */
static inline __attribute__((always_inline)) void fma_rows(const QMatmul *a, vf *acc, int m0, const int nr, int k,
                                                           const int p, const vf *w, const int nv) {
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++) {
        const vf xp = pairx(a->x + (int64_t)(m0 + i) * a->ldx + k);
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[(i * P + p) * nv + v] += w[v] * xp;
    }
}

/* nr (<= MR) rows of x against one column block, dequantizing each tile row in registers. */
static inline __attribute__((always_inline)) void block_direct(const QMatmul *a, const uint8_t *col, int m0,
                                                               const int fmt, const int nr, int cb) {
    vf acc[MR * P * NV];
#pragma GCC unroll 32
    for (int i = 0; i < nr * P * NV; i++) acc[i] = (vf){0};
    for (int g = 0; g < a->G; g++) {
        const uint8_t *tile = tile_at(col, fmt, g);
        if (m0 == 0) prefetch_ahead(tile, fmt);
        for (int h = 0; h < halves(fmt); h++) {
            const Scales s = tile_scales(col, tile, g, fmt, h);
            for (int r = 16 / halves(fmt) * h; r < 16 / halves(fmt) * (h + 1); r += P) {
                vf w[NV];
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) {
                    tile_row(tile, fmt, r + p, &s, w);
                    fma_rows(a, acc, m0, nr, 32 * g + 2 * (r + p), p, w, NV);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++) store_row(a, acc + i * P * NV, m0 + i, 16 * cb, NV);
}

/* The same sums for the VW columns 16 cb + VW hv.. from the panel ([G][16 rows][32 floats]). */
static inline __attribute__((always_inline)) void block_panel(const QMatmul *a, const float *panel, int m0,
                                                              const int nr, int cb, int hv) {
    vf acc[PR * P * 2];
#pragma GCC unroll 24
    for (int i = 0; i < nr * P * 2; i++) acc[i] = (vf){0};
    for (int j = 0; j < 16 * a->G; j += P) {
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            const vf w[2] = {ldr(panel + 32 * (j + p) + 2 * VW * hv), ldr(panel + 32 * (j + p) + 2 * VW * hv + VW)};
            fma_rows(a, acc, m0, nr, 2 * (j + p), p, w, 2);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < nr; i++) store_row(a, acc + i * P * 2, m0 + i, 16 * cb + VW * hv, 2);
}

/* Rows m0.. of x in direct blocks of at most MR rows (the row count a constant in each instance). */
#define DIRECT_ROWS(fmt, a, col, cb)                                                                            \
    for (int m0 = 0; m0 < (a)->M; m0 += MR) {                                                                  \
        switch ((a)->M - m0 < MR ? (a)->M - m0 : MR) {                                                         \
        case 1: block_direct(a, col, m0, fmt, 1, cb); break;                                                   \
        case 2: block_direct(a, col, m0, fmt, 2 < MR ? 2 : MR, cb); break;                                     \
        case 3: block_direct(a, col, m0, fmt, 3 < MR ? 3 : MR, cb); break;                                     \
        case 4: block_direct(a, col, m0, fmt, 4 < MR ? 4 : MR, cb); break;                                     \
        case 5: block_direct(a, col, m0, fmt, 5 < MR ? 5 : MR, cb); break;                                     \
        default: block_direct(a, col, m0, fmt, MR, cb); break;                                                 \
        }                                                                                                      \
    }

/* The panel route's row blocks: at most PR rows each, sized evenly (8 rows: 4 + 4, not 6 + 2: a block of few
 * rows does little arithmetic per panel load). */
static void panel_rows(const QMatmul *a, const float *panel, int cb) {
    const int blocks = (a->M + PR - 1) / PR;
    for (int b = 0, m0 = 0; b < blocks; b++) {
        const int nr = a->M / blocks + (b < a->M % blocks);
        for (int hv = 0; hv < NV / 2 && 16 * cb + VW * hv < a->N; hv++) switch (nr) {
            case 1: block_panel(a, panel, m0, 1, cb, hv); break;
            case 2: block_panel(a, panel, m0, 2, cb, hv); break;
            case 3: block_panel(a, panel, m0, 3, cb, hv); break;
            case 4: block_panel(a, panel, m0, 4, cb, hv); break;
            case 5: block_panel(a, panel, m0, 5, cb, hv); break;
            default: block_panel(a, panel, m0, PR, cb, hv); break;
            }
        m0 += nr;
    }
}

/* Each format's direct rows and panel dequantization as functions of their own, the format a constant inside
 * (so its branches fold). Why not inlined into qmm_column_block, as they were: at AVX-512 that one function held
 * 84 instances of block_direct, and GCC's backwards jump threading, which grows faster than a function, took
 * half of the ~2 minutes of CPU this file then cost at -march=x86-64-v4 or native (AVX2: 5 s); apart, each is
 * quick. A call per column block costs nothing next to its G tiles. */
#define FORMAT_FNS(fmt)                                                                                        \
    static __attribute__((noinline)) void direct_##fmt(const QMatmul *a, const uint8_t *col, int cb) {        \
        DIRECT_ROWS(fmt, a, col, cb)                                                                           \
    }                                                                                                          \
    static __attribute__((noinline)) void panel_##fmt(const uint8_t *col, int G, float *panel) {              \
        DEQUANT_PANEL(fmt, col, G, panel);                                                                     \
    }
FOR_EACH_FORMAT(FORMAT_FNS)
#define CALL_DIRECT(fmt, a, col, cb) direct_##fmt(a, col, cb)
#define CALL_PANEL(fmt, col, G, panel) panel_##fmt(col, G, panel)

/* One column block for all M rows: direct for a few rows, through a dequantized panel for many. */
void qmm_column_block(const QMatmul *a, int cb, float *panel) {
    int fmt;
    const uint8_t *col = column(a->w, a->fmt, a->G, cb, &fmt);
    if (a->M <= MR || panel == NULL) {
        EACH_FORMAT(fmt, CALL_DIRECT, a, col, cb)
        return;
    }
    EACH_FORMAT(fmt, CALL_PANEL, col, a->G, panel)
    panel_rows(a, panel, cb);
}
/* Returns 0, or -1 (out of memory) / -2 (bad sizes). */
int qmm_f32(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads) {
    if (bad_sizes(M, N, K, ldx, ldo, fmt)) return -2;
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

/* Rows `ids` of W (columns of the matmul) as float32: the embedding lookup of a quantized table, with the
 * weights' values exactly as the matmul sees them. */
int qrows_f32(float *out, const int64_t *ids, int T, const uint8_t *w, int N, int K, int fmt) {
    if (bad_sizes(1, N, K, K, N, fmt)) return -2;
    const int G = K / 32;
    float group[512];
    for (int t = 0; t < T; t++) {
        const int64_t n = ids[t];
        if (n < 0 || n >= N) return -3;
        int f;
        const uint8_t *col = column(w, fmt, G, (int)(n / 16), &f);
        const int c = (int)(n % 16);
        for (int g = 0; g < G; g++) {
            EACH_FORMAT(f, DEQUANT_GROUP, col, g, group)
            for (int k = 0; k < 32; k++) out[(int64_t)t * K + 32 * g + k] = group[32 * (k / 2) + 2 * c + k % 2];
        }
    }
    return 0;
}
