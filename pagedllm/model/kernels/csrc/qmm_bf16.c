/*
 * The quantized matmul with bfloat16 activations: AMX (Sapphire Rapids and later), else AVX-512 BF16 dot
 * products. For steps of many rows the matmul is bound by arithmetic, not by the weights' bytes. AMX multiplies
 * 16 x 32 bfloat16 tiles at many times the AVX-512 float32 rate; without AMX, AVX-512 BF16's vdpbf16ps (Zen 4 and
 * later, Cooper Lake) still does two multiply-adds a lane per instruction, twice the float32 FMA. A tile of our
 * layout is exactly an AMX B tile once each row is converted to bfloat16, and each of its rows is one vdpbf16ps
 * operand (lane c: column c's k pair), so a column block is dequantized once into [G][16][32] bfloat16 and
 * multiplied with every row of x. The weights round to bfloat16 here, as they do in a dense bfloat16 model;
 * this route serves only --dtype bfloat16, from the row count that kernel_choice.py measures it faster. These
 * instructions have no other width: the route is AVX-512 only, and a build without them has the stubs below.
 */
#include <stdint.h>
#include <stdlib.h>

#include "qtile.h"

#if defined(__AVX512BF16__)
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static void dequant_bf16(const uint8_t *w, int wfmt, int G, int cb, uint16_t *dst) {
    int fmt;
    const uint8_t *col = column(w, wfmt, G, cb, &fmt);
    float group[512];
    for (int g = 0; g < G; g++) {
        EACH_FORMAT(fmt, DEQUANT_GROUP, col, g, group)
        for (int r = 0; r < 16; r++)
            _mm512_storeu_si512(dst + ((int64_t)g * 16 + r) * 32, (__m512i)_mm512_cvtne2ps_pbh(
                                    _mm512_loadu_ps(group + 32 * r + 16), _mm512_loadu_ps(group + 32 * r)));
    }
}

/* Row m of an output's 16 columns of block cb: + bias, written or added to (a clipped last block masked). */
static inline void store_cols(const QMatmulBf16 *a, int m, int cb, __m512 v) {
    const int n_valid = a->N - 16 * cb < 16 ? a->N - 16 * cb : 16;
    const __mmask16 mask = (__mmask16)((1u << n_valid) - 1);
    float *o = a->out + (int64_t)m * a->ldo + 16 * cb;
    if (a->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a->bias + 16 * cb));
    if (a->accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o));
    _mm512_mask_storeu_ps(o, mask, v);
}

/* Groups of 32 inputs per pass over a column pair's panel (2 x 16 x 32 G bfloat16): a pass's 256 KB stay in L2
 * while every row block reads them. At K 21504 the whole panel (1.4 MB) came from L3 for each block of 8 rows. */
#define PASS_GROUPS 128
/* Rows of a pair's partial sums between passes (32 floats a row, on the stack: 32 KB). */
#define PASS_ROWS 256

/* nr (<= 8) rows m0.. of one 16-row tile of x against column blocks cb0 (and cb0 + 1 with `two`), groups
 * [g0, g1) of their bfloat16 panels `bb`: a lane sums its column's k pairs in k order, whatever the block (batch
 * invariance). Between passes the sums wait in `part` (32 floats a row) in float32, so a row's sum is the same
 * bits as in one pass. The rows of x lie 64 bytes apart in their tile, so one base register serves all of them. */
static inline __attribute__((always_inline)) void dot_block(const QMatmulBf16 *a, const uint16_t *bb, int m0,
                                                            const int nr, int cb0, const int two, int g0, int g1,
                                                            float *part) {
    const int G = a->G;
    const uint32_t *xr = (const uint32_t *)(a->xb + (int64_t)(m0 / 16) * G * 512 + (m0 % 16) * 32) + 256 * g0;
    __m512 acc[2][8];
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++) {
        acc[0][i] = g0 ? _mm512_loadu_ps(part + 32 * i) : _mm512_setzero_ps();
        acc[1][i] = g0 ? _mm512_loadu_ps(part + 32 * i + 16) : _mm512_setzero_ps();
    }
    for (int g = g0; g < g1; g++, xr += 256)
        for (int r = 0; r < 16; r++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(bb + ((int64_t)g * 16 + r) * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(bb + ((int64_t)(G + g) * 16 + r) * 32);
#pragma GCC unroll 8
            for (int i = 0; i < nr; i++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xr[16 * i + r]);
                acc[0][i] = _mm512_dpbf16_ps(acc[0][i], w0, x);
                if (two) acc[1][i] = _mm512_dpbf16_ps(acc[1][i], w1, x);
            }
        }
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++) {
        if (g1 < G) {
            _mm512_storeu_ps(part + 32 * i, acc[0][i]);
            _mm512_storeu_ps(part + 32 * i + 16, acc[1][i]);
            continue;
        }
        store_cols(a, m0 + i, cb0, acc[0][i]);
        if (two) store_cols(a, m0 + i, cb0 + 1, acc[1][i]);
    }
}

#define DOT_BLOCK(n)                                                                                            \
    case n:                                                                                                     \
        two ? dot_block(a, bbuf, m0, n, cb0, 1, g0, g1, pm) : dot_block(a, bbuf, m0, n, cb0, 0, g0, g1, pm);   \
        break;

/* Column blocks 2p and 2p + 1 for all rows with vdpbf16ps: each 16-row tile of x in two blocks of <= 8 rows, in
 * passes of PASS_GROUPS groups over up to PASS_ROWS rows (one pass where K <= 4096).
 * bfloat16 weights are read where they lie: their tiles are already the [G][16][32] operand rows (qtile.h), and
 * block cb0 + 1 follows block cb0, so the copy into `bbuf` (the other formats' dequantization) is skipped. */
static void dot_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) {
    const int NB = (a->N + 15) / 16, cb0 = 2 * p, two = cb0 + 1 < NB;
    if (a->fmt == QFMT_BF16) {
        bbuf = (uint16_t *)(a->w + (int64_t)cb0 * col_bytes(QFMT_BF16, a->G));
    } else {
        dequant_bf16(a->w, a->fmt, a->G, cb0, bbuf);
        if (two) dequant_bf16(a->w, a->fmt, a->G, cb0 + 1, bbuf + (int64_t)a->G * 512);
    }
    float part[PASS_ROWS * 32];
    for (int r0 = 0; r0 < a->M; r0 += PASS_ROWS) {
        const int r1 = a->M - r0 < PASS_ROWS ? a->M : r0 + PASS_ROWS;
        for (int g0 = 0; g0 < a->G; g0 += PASS_GROUPS) {
            const int g1 = a->G - g0 < PASS_GROUPS ? a->G : g0 + PASS_GROUPS;
            for (int t0 = r0; t0 < r1; t0 += 16) {
                const int rows = r1 - t0 < 16 ? r1 - t0 : 16, blocks = (rows + 7) / 8;
                for (int b = 0, m0 = t0; b < blocks; b++) {
                    const int nr = rows / blocks + (b < rows % blocks);
                    float *pm = part + 32 * (m0 - r0);
                    switch (nr) {
                        DOT_BLOCK(1) DOT_BLOCK(2) DOT_BLOCK(3) DOT_BLOCK(4) DOT_BLOCK(5) DOT_BLOCK(6) DOT_BLOCK(7)
                    default:
                        two ? dot_block(a, bbuf, m0, 8, cb0, 1, g0, g1, pm) : dot_block(a, bbuf, m0, 8, cb0, 0, g0, g1, pm);
                        break;
                    }
                    m0 += nr;
                }
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
#endif

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
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

/* Configures the calling thread's tiles (per thread: call in each thread of a parallel region); nothing where
 * the bfloat16 route runs on dot products. */
void qmm_amx_begin(void) {
    if (qmm_amx_available()) _tile_loadconfig(&TILES);
}

void qmm_amx_end(void) {
    if (qmm_amx_available()) _tile_release();
}

static void store_tile(const QMatmulBf16 *a, int m0, int cb, float tile[16][16]) {
    for (int i = 0; i < 16 && m0 + i < a->M; i++) store_cols(a, m0 + i, cb, _mm512_loadu_ps(tile[i]));
}

/* Column blocks 2p and 2p+1 for all rows; `bbuf` holds 2 * G * 512 bfloat16. Tiles must be configured. */
static void amx_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) {
    const int NB = (a->N + 15) / 16, cb0 = 2 * p, has1 = cb0 + 1 < NB, G = a->G;
    dequant_bf16(a->w, a->fmt, G, cb0, bbuf);
    if (has1) dequant_bf16(a->w, a->fmt, G, cb0 + 1, bbuf + (int64_t)G * 512);
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
#else
int qmm_amx_available(void) { return 0; }
void qmm_amx_begin(void) {}
void qmm_amx_end(void) {}
#endif

/* Which bfloat16 route this build and CPU have: 2 AMX, 1 AVX-512 BF16 dot products, 0 none. */
int qmm_bf16_kind(void) {
#if defined(__AVX512BF16__)
    return qmm_amx_available() ? 2 : 1;
#else
    return 0;
#endif
}

/* Column blocks 2p and 2p + 1 for all rows of a bfloat16 product, on AMX where the tiles are granted (and
 * configured: qmm_amx_begin), else on dot products; nothing in a build without AVX-512 BF16. */
void qmm_amx_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (qmm_amx_available()) {
        amx_pair(a, p, bbuf);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    dot_pair(a, p, bbuf);
#else
    (void)a, (void)p, (void)bbuf;
#endif
}

/* The same pair on AVX-512 BF16 dot products even where AMX is granted: for callers whose threads have not
 * configured AMX tiles (the experts, moe.c); nothing in a build without AVX-512 BF16. */
void qmm_bf16_dot_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) {
#if defined(__AVX512BF16__)
    dot_pair(a, p, bbuf);
#else
    (void)a, (void)p, (void)bbuf;
#endif
}

#if !defined(__AVX512BF16__)
void qmm_amx_convert_row(uint16_t *xb, const float *x, int m, int G) { (void)xb, (void)x, (void)m, (void)G; }
#endif

/* Rows per block of a bfloat16 product: as many as keep a block of x (K bfloat16 a row) within QMM_BF16_X_BYTES,
 * in whole pairs of 16-row tiles. A column pair reads every row of x once; with all M rows at once, a large x
 * (2048 rows of K 21504: 88 MB) came from memory again for every pair, and the kernel ran at a third of its rate
 * (benchmarks/kernels/panel_gemm.py --shape nemotron-h-8b). Blocks of rows, each over the pairs, keep x in the
 * cache; a row's sums are the same whatever the block. */
#define QMM_BF16_X_BYTES (4 << 20)
int qmm_bf16_row_block(int M, int K) {
    int rows = (int)(QMM_BF16_X_BYTES / ((int64_t)K * 2)) / 32 * 32;
    if (rows < 32) rows = 32;
    return rows < M ? rows : M;
}

/* Rows [m0, m0 + mb) of product `a` (fewer at its end); m0 a multiple of 16: x's tiles hold 16 rows. */
static QMatmulBf16 row_block(const QMatmulBf16 *a, int m0, int mb) {
    QMatmulBf16 b = *a;
    b.out = a->out + (int64_t)m0 * a->ldo;
    b.xb = a->xb + (int64_t)(m0 / 16) * a->G * 512;
    b.M = a->M - m0 < mb ? a->M - m0 : mb;
    return b;
}

void qmm_bf16_pairs(const QMatmulBf16 *a, int u0, int u1, uint16_t *bbuf, int dot_only) {
    for (int m0 = 0, mb = qmm_bf16_row_block(a->M, a->G * 32); m0 < a->M; m0 += mb) {
        const QMatmulBf16 rows = row_block(a, m0, mb);
        for (int u = u0; u < u1; u++) dot_only ? qmm_bf16_dot_pair(&rows, u, bbuf) : qmm_amx_pair(&rows, u, bbuf);
    }
}

/* out[M, N] (+)= x[M, K] @ W^T with x rounded to bfloat16, on AMX or AVX-512 BF16 (qmm_bf16_kind). Returns 0,
 * -1 (out of memory), -2 (bad sizes) or -6 (neither here). */
int qmm_amx(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads) {
    if (bad_sizes(M, N, K, ldx, ldo, fmt)) return -2;
    if (!qmm_bf16_kind()) return -6;
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
        for (int m0 = 0, mb = qmm_bf16_row_block(M, K); m0 < M; m0 += mb) {
            const QMatmulBf16 rows = row_block(&a, m0, mb);
#pragma omp for schedule(static)
            for (int p = 0; p < pairs; p++)
                if (bbuf) qmm_amx_pair(&rows, p, bbuf);
        }
        qmm_amx_end();
        free(bbuf);
    }
    free(xb);
    return status;
}
