/*
 * The quantized matmul's 8-bit integer route ("int8"), for many rows (prefill chunks, large batches). Why: at
 * many rows a matmul is bound by its multiply-adds, not by the weights' bytes, and the 16-bit dot route
 * (qmm_dot.c) does 32 of them a 512-bit instruction (vpdpwssd), the same as bfloat16's vdpbf16ps. With the
 * activations rounded to 8 bits per group of 32 as llama.cpp's Q8_0 does (d = max |x| / 127), one vpdpbusd (or
 * AVX2's vpmaddubsw + vpmaddwd) does 64: unsigned weight codes times signed activation bytes, four products
 * summed per 32-bit lane. The price is accuracy: each x is within d / 2 of its value, a relative error of
 * 0.4% of its group's largest; the route runs only from the row count the kernel choice measured it faster
 * at, and only under the accuracy bound benchmarks/kernels/dot_accuracy.py states (docs/benchmarks.md).
 * Formats: Q4 / Q40 (Q4_1, Q4_0), Q8 / Q8M (Q8_0, int8), K4M (Q4_K), K6 (Q6_K); a column block of any other
 * format (or of a mixed weight) runs on the float32 route with the same call.
 *
 * Per column block, the weights' codes are first laid out once as a panel of chunks (16 columns x 4 k as
 * bytes, a column a 32-bit lane: vpdpbusd's order) with each group's float scales, then every row of x runs
 * over it: the panel (24 bytes per k) stays in the cache, so the rearrangement is paid once per block for all
 * rows, and the tiles are the one copy of the weights in memory (a repacked copy at load would double them).
 * Codes are unsigned: the nibbles as stored (Q40 with its + 8, K6 with its + 32), Q8's bytes + 128 with VNNI;
 * a code of `off` is w = b, one of u is w = a (u - off) + b. Per group (half, for K6) and column the integer sum
 * S = sum u xq is exact in int32, and out += (a dx) S + (b - a off) (dx sx), sx the group's sum of xq.
 * Without VNNI, vpmaddubsw sums two products in 16 bits with saturation: 4- and 6-bit codes never reach it
 * (2 x 63 x 127 < 32767), and Q8's signed codes go in as |w| with x's sign flipped where w < 0 (llama.cpp's
 * trick), 2 x 128 x 127 < 32767.
 * Two passes (qmm_i8x2, XQ8.passes 2): x ~ d1 q1 + d1 / 254 q2 with q2 the rounded residual of q1, two byte
 * products per weight byte joined per group as 254 S1 + S2: 16-bit codes' accuracy at the instruction count of
 * the 16-bit route (vpmaddwd does half the products of vpmaddubsw; vpdpwssd of vpdpbusd), so it pays only where
 * the 16-bit route is slower for other reasons (its 16-bit panels): measured in docs/benchmarks.md.
 * Rows of x are independent: a row's result does not depend on the batch. The vector form is written once over
 * simd.h's byte vectors (SIMD_INT8: AVX-512 BW, AVX2; VNNI where the build has it); the portable build sums one
 * code at a time from the same panel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qtile.h"

/* Q8's codes as signed bytes (no VNNI: |w| and a sign flip), else unsigned with the offset off8. */
static inline int signed8(int fmt) {
#ifdef I8_VNNI
    (void)fmt;
    return 0;
#else
    return fmt == QFMT_Q8 || fmt == QFMT_Q8M;
#endif
}
static inline int off8(int fmt) { return fmt == QFMT_Q8 || fmt == QFMT_Q8M ? (signed8(fmt) ? 0 : 128) : offset(fmt); }
/* Chunks whose 16-bit pair sums (bmul16, at most 2 x 15 x 127 a lane for 4-bit codes, 2 x 63 x 127 for 6-bit,
 * 2 x 128 x 127 for |w| of a byte) add up in 16 bits without reaching 32767 (the routes without VNNI). */
static inline int sum16(int fmt) { return nibbles(fmt) ? (plane(fmt) ? 2 : 8) : 1; }
/* A group's panel: 8 chunks of 64 code bytes, then a[halves][16] and b[halves][16] floats. */
static inline int group_bytes(int fmt) { return 512 + halves(fmt) * 128; }

int qi8_runs(int fmt) { return i8_fmt(fmt) || fmt == QFMT_MIXED; }

/* Row x [K] to 8-bit integers per group of 32. passes 1: q [K], x ~ d q (llama.cpp's Q8_0). passes 2: q [2 K],
 * each group's 32 codes q1 then 32 codes q2 of what q1 left, x ~ d1 q1 + d1 / 254 q2 (|x / d1 - q1| <= 1 / 2, so
 * q2 = round(254 (x / d1 - q1)) is within +-127 and x within d1 / 508 of its value, the 16-bit route's step);
 * d = d1 / 254 and s = 254 s1 + s2, the scale and sums of the combined code 254 q1 + q2. */
void qi8_quantize_row(int8_t *q, float *d, int32_t *s, const float *x, int K, int passes) {
    for (int g = 0; g < K / 32; g++) {
        const float amax = group_amax(x + 32 * g);
        const float inv = amax > 0.0f && amax <= 3.0e38f ? 127.0f / amax : 0.0f;
        d[g] = inv > 0.0f ? amax / 127.0f : 0.0f;
        int8_t *q1 = q + 32 * passes * g;
        round_group8(q1, s + 2 * g, x + 32 * g, inv);
        if (passes == 1) continue;
        float r[32];
        for (int k = 0; k < 32; k++) { /* what q1 left, in units of d1 (NaN where x is: rounded to 0) */
            const float v = x[32 * g + k] * inv;
            r[k] = v == v && fabsf(v) <= 127.0f ? v - (float)q1[k] : 0.0f;
        }
        int32_t s2[2];
        round_group8(q1 + 32, s2, r, 254.0f);
        d[g] /= 254.0f;
        for (int h = 0; h < 2; h++) s[2 * g + h] = 254 * s[2 * g + h] + s2[h];
    }
}

/* Group g's scales into the panel: w = a u + b', b' = b - a off, per column (and half). */
static inline __attribute__((always_inline)) void panel_scales(const uint8_t *col, const int fmt, int g,
                                                               float *pa) {
    const uint8_t *tile = tile_at(col, fmt, g);
    float *pb = pa + 16 * halves(fmt);
    for (int h = 0; h < halves(fmt); h++)
        for (int c = 0; c < 16 / VW; c++) {
            vf a, b;
            if (kfmt(fmt)) {
                const uint8_t *head = head_at(col, fmt, g);
                a = f16v(head + 2 * VW * c) * tof(s8v(tile + 16 * h + VW * c));
                b = has_min(fmt) ? -(f16v(head + 32 + 2 * VW * c) * tof(u8v(tile + 16 + VW * c))) : (vf){0};
            } else {
                a = f16v(tile + 2 * VW * c);
                b = has_min(fmt) ? f16v(tile + 32 + 2 * VW * c) : (vf){0};
            }
            st(pa + 16 * h + VW * c, a);
            st(pb + 16 * h + VW * c, b - a * (float)off8(fmt));
        }
}

/* Group g's codes into chunk order: chunk t, column c, byte j = the code at k = 4 t + j. */
static inline __attribute__((always_inline)) void panel_codes(const uint8_t *body, const int fmt, uint8_t *p) {
#ifdef SIMD_INT8
    const __m128i m4 = _mm_set1_epi8(15);
    for (int t = 0; t < 8; t++, p += 64) {
        if (!nibbles(fmt)) { /* bytes: a row's 32 bytes are columns 0-7, then 8-15 */
            const uint8_t *r0 = body + 64 * t;
            __m128i v[4];
            for (int i = 0; i < 4; i++) {
                v[i] = _mm_loadu_si128((const __m128i *)(r0 + 16 * i));
                if (!signed8(fmt)) v[i] = _mm_xor_si128(v[i], _mm_set1_epi8((char)0x80));
            }
            chunk_from_pairs(p, v[0], v[2], v[1], v[3]);
            continue;
        }
        const __m128i a = _mm_loadu_si128((const __m128i *)(body + 32 * t));
        const __m128i b = _mm_loadu_si128((const __m128i *)(body + 32 * t + 16));
        if (fmt == QFMT_K6) { /* rows 2t, 2t + 1's bytes; bits 0-5 the low columns, 6-7 + the plane's nibble the high */
            const __m128i c0 = _mm_unpacklo_epi64(a, b), c1 = _mm_unpackhi_epi64(a, b), m6 = _mm_set1_epi8(63);
            const __m128i pl = _mm_loadu_si128((const __m128i *)(body + 256 + 16 * t)), m3 = _mm_set1_epi8(3);
            const __m128i lo4 = _mm_and_si128(_mm_slli_epi16(pl, 2), _mm_set1_epi8(0x3C)); /* bytes 0-7 of a row */
            const __m128i hi4 = _mm_and_si128(_mm_srli_epi16(pl, 2), _mm_set1_epi8(0x3C)); /* its bytes 8-15 */
            const __m128i top0 = _mm_unpacklo_epi64(lo4, hi4), top1 = _mm_unpackhi_epi64(lo4, hi4);
            chunk_from_pairs(p, _mm_and_si128(c0, m6), _mm_and_si128(c1, m6),
                             _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c0, 6), m3), top0),
                             _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c1, 6), m3), top1));
            continue;
        }
        chunk_from_pairs(p, _mm_and_si128(a, m4), _mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4),
                         _mm_and_si128(_mm_srli_epi16(b, 4), m4));
    }
#else
    for (int t = 0; t < 8; t++)
        for (int c = 0; c < 16; c++)
            for (int j = 0; j < 4; j++) { /* nibbles as stored; bytes signed + off8 */
                const int code = code_at(body, fmt, c, 4 * t + j);
                p[64 * t + 4 * c + j] = (uint8_t)(nibbles(fmt) ? code : code + off8(fmt));
            }
#endif
}

static inline __attribute__((always_inline)) void build_panel(const uint8_t *col, const int fmt, int G,
                                                              uint8_t *panel) {
    for (int g = 0; g < G; g++) {
        uint8_t *p = panel + (int64_t)g * group_bytes(fmt);
        panel_codes(tile_at(col, fmt, g) + scale_bytes(fmt), fmt, p);
        panel_scales(col, fmt, g, (float *)(p + 512));
    }
}

#ifdef SIMD_INT8
/* nr rows of x against one column block's panel, x in P passes of codes (qi8_quantize_row): each pass's sums
 * in its own accumulators, joined per group as 254 S1 + S2 (exact in int32: |S1| <= 32 x 255 x 128). */
static inline __attribute__((always_inline)) void block_i8(const QMatmul *a, const XQ8 *xq, const uint8_t *panel,
                                                           int m0, const int fmt, const int nr, int cb, const int P) {
    const int G = a->G, H = halves(fmt), K = 32 * G;
    vf F[QR8][BCH];
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < BCH; v++) F[i][v] = (vf){0};
    for (int g = 0; g < G; g++) {
        const uint8_t *p = panel + (int64_t)g * group_bytes(fmt);
        const float *pa = (const float *)(p + 512), *pb = pa + 16 * H;
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            bv acc[2][QR8][BCH];
            for (int j = 0; j < P; j++)
                for (int i = 0; i < nr; i++)
                    for (int v = 0; v < BCH; v++) acc[j][i][v] = BZERO();
#ifndef I8_VNNI
            bv a16[2][QR8][BCH];
#endif
#pragma GCC unroll 8
            for (int t = 8 / H * h; t < 8 / H * (h + 1); t++) {
                bv w[BCH], wa[BCH];
                for (int v = 0; v < BCH; v++) {
                    w[v] = bload(p + 64 * t + 64 / BCH * v);
                    wa[v] = signed8(fmt) ? babs(w[v]) : w[v];
                }
                for (int j = 0; j < P; j++)
                    for (int i = 0; i < nr; i++) {
                        const bv x = bset1(xq->q + (int64_t)(m0 + i) * P * K + 32 * (P * g + j) + 4 * t);
                        for (int v = 0; v < BCH; v++) {
                            const bv xs = signed8(fmt) ? bsign(x, w[v]) : x;
#ifdef I8_VNNI
                            acc[j][i][v] = bdot(acc[j][i][v], wa[v], xs);
#else
                            const bv prod = bmul16(wa[v], xs);
                            a16[j][i][v] = t % sum16(fmt) ? badd16(a16[j][i][v], prod) : prod;
                            if (t % sum16(fmt) == sum16(fmt) - 1) acc[j][i][v] = bwiden(acc[j][i][v], a16[j][i][v]);
#endif
                        }
                    }
            }
            for (int i = 0; i < nr; i++) {
                const int64_t m = m0 + i;
                const int32_t *s = xq->s + m * 2 * G + 2 * g;
                const float dx = xq->d[m * G + g], ds = dx * (float)(H == 2 ? s[h] : s[0] + s[1]);
                for (int v = 0; v < BCH; v++) {
                    const bv S = P == 2 ? bjoin(acc[0][i][v], acc[1][i][v]) : acc[0][i][v];
                    F[i][v] += tof((vi)S) * (ld(pa + 16 * h + VW * v) * dx) + ld(pb + 16 * h + VW * v) * ds;
                }
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        if (16 * cb + 16 <= a->N) { /* a whole block in vectors, lane by lane as store16 does one by one */
            float *o = a->out + (int64_t)(m0 + i) * a->ldo + 16 * cb;
            for (int v = 0; v < BCH; v++) {
                const vf x = F[i][v] + (a->bias ? ld(a->bias + 16 * cb + VW * v) : (vf){0});
                st(o + VW * v, a->accumulate ? ld(o + VW * v) + x : x);
            }
            continue;
        }
        float tmp[16];
        memcpy(tmp, F[i], sizeof tmp);
        store16(a, tmp, m0 + i, cb);
    }
}

/* Passes of R rows (QR8, or half of it with two passes of codes), then R / 2, ..., 1 for the rest: a row's sums
 * do not depend on its pass. */
static inline __attribute__((always_inline)) void rows_i8(const QMatmul *a, const XQ8 *xq, const uint8_t *panel,
                                                          const int fmt, int cb, const int P) {
    const int R = P == 2 ? (QR8 + 1) / 2 : QR8;
    int m0 = 0;
    for (; a->M - m0 >= R; m0 += R) block_i8(a, xq, panel, m0, fmt, R, cb, P);
    if (R > 4 && a->M - m0 >= 4) block_i8(a, xq, panel, m0, fmt, 4, cb, P), m0 += 4;
    if (R > 2 && a->M - m0 >= 2) block_i8(a, xq, panel, m0, fmt, 2, cb, P), m0 += 2;
    if (a->M - m0 >= 1) block_i8(a, xq, panel, m0, fmt, 1, cb, P);
}
#else
/* The portable build: the same sums, one code at a time. */
static void rows_i8(const QMatmul *a, const XQ8 *xq, const uint8_t *panel, int fmt, int cb, int P) {
    const int G = a->G, H = halves(fmt), K = 32 * G;
    for (int m = 0; m < a->M; m++) {
        float F[16] = {0};
        for (int g = 0; g < G; g++) {
            const uint8_t *p = panel + (int64_t)g * group_bytes(fmt);
            const float *pa = (const float *)(p + 512), *pb = pa + 16 * H;
            const int8_t *x = xq->q + (int64_t)m * P * K + 32 * P * g;
            const int32_t *s = xq->s + (int64_t)m * 2 * G + 2 * g;
            const float dx = xq->d[(int64_t)m * G + g];
            for (int h = 0; h < H; h++) {
                const float ds = dx * (float)(H == 2 ? s[h] : s[0] + s[1]);
                for (int c = 0; c < 16; c++) {
                    int32_t S = 0;
                    for (int k = 32 / H * h; k < 32 / H * (h + 1); k++) {
                        const uint8_t u = p[64 * (k / 4) + 4 * c + k % 4];
                        S += (signed8(fmt) ? (int8_t)u : u) * (P == 2 ? 254 * x[k] + x[32 + k] : x[k]);
                    }
                    F[c] += (float)S * (pa[16 * h + c] * dx) + pb[16 * h + c] * ds;
                }
            }
        }
        store16(a, F, m, cb);
    }
}
#endif

#define I8_BLOCK(fmt, a, xq, col, cb, panel)                                                                   \
    do {                                                                                                       \
        build_panel(col, fmt, (a)->G, panel);                                                                  \
        if ((xq)->passes == 2)                                                                                 \
            rows_i8(a, xq, panel, fmt, cb, 2);                                                                 \
        else                                                                                                   \
            rows_i8(a, xq, panel, fmt, cb, 1);                                                                 \
    } while (0)

/* One column block for all M rows on the int8 route (a block of another format: the float32 route). `panel`:
 * K * 16 floats, which holds either route's panel. */
void qi8_column_block(const QMatmul *a, const XQ8 *xq, int cb, float *panel) {
    int fmt;
    const uint8_t *col = column(a->w, a->fmt, a->G, cb, &fmt);
    uint8_t *p = (uint8_t *)panel;
    switch (fmt) {
    case QFMT_Q4: I8_BLOCK(QFMT_Q4, a, xq, col, cb, p); break;
    case QFMT_Q40: I8_BLOCK(QFMT_Q40, a, xq, col, cb, p); break;
    case QFMT_Q8: I8_BLOCK(QFMT_Q8, a, xq, col, cb, p); break;
    case QFMT_Q8M: I8_BLOCK(QFMT_Q8M, a, xq, col, cb, p); break;
    case QFMT_K4M: I8_BLOCK(QFMT_K4M, a, xq, col, cb, p); break;
    case QFMT_K6: I8_BLOCK(QFMT_K6, a, xq, col, cb, p); break;
    default: qmm_column_block(a, cb, panel); /* the float32 route, through `panel` for many rows */
    }
}

/* out[M, N] (+)= x[M, K] @ W^T with x rounded to 8 bits per group in `passes` passes; 0, -1 (out of memory) or
 * -2 (bad sizes). */
static int qmm_passes(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx,
                      int ldo, int fmt, int accumulate, int num_threads, int passes) {
    if (bad_sizes(M, N, K, ldx, ldo, fmt)) return -2;
    const int G = K / 32;
    XQ8 xq = {malloc((size_t)M * passes * K), malloc((size_t)M * G * sizeof(float)),
               malloc((size_t)M * 2 * G * sizeof(int32_t)), passes};
    int status = xq.q && xq.d && xq.s ? 0 : -1;
    if (status == 0) {
        QMatmul a = {out, x, w, bias, M, N, G, ldx, ldo, fmt, accumulate};
        const int NB = (N + 15) / 16;
        if (num_threads > NB) num_threads = NB;
        if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++)
                qi8_quantize_row(xq.q + (int64_t)m * passes * K, xq.d + (int64_t)m * G, xq.s + (int64_t)m * 2 * G,
                                 x + (int64_t)m * ldx, K, passes);
            float *panel = malloc((size_t)K * 16 * sizeof(float));
            if (panel == NULL) {
#pragma omp atomic write
                status = -1;
            }
#pragma omp for schedule(static)
            for (int cb = 0; cb < NB; cb++)
                if (panel) qi8_column_block(&a, &xq, cb, panel);
            free(panel);
        }
    }
    free(xq.q);
    free(xq.d);
    free(xq.s);
    return status;
}

int qmm_i8(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
           int fmt, int accumulate, int num_threads) {
    return qmm_passes(out, x, w, bias, M, N, K, ldx, ldo, fmt, accumulate, num_threads, 1);
}

int qmm_i8x2(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
             int fmt, int accumulate, int num_threads) {
    return qmm_passes(out, x, w, bias, M, N, K, ldx, ldo, fmt, accumulate, num_threads, 2);
}
