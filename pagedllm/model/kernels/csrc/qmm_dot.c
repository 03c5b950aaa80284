/*
 * The quantized matmul's 16-bit integer route ("dot"). Why: a one-row decode matmul should run at the memory's
 * speed, but dequantizing each weight to float32 costs ~5 vector instructions per 16 weights (widen, mask,
 * convert, scale, multiply-add), which on 2 cores is below the bandwidth (the developers' finding:
 * compute-bound). llama.cpp's route instead rounds the activations to integers per block of 32 and multiplies
 * the weights' integer codes by them directly (pmaddwd / VNNI's vpdpwssd: 32 products a 512-bit instruction, no
 * conversion of the weights), applying each group's scales once per 32 inputs. Here the activations are rounded
 * to 16 bits (d = max |x| / 32767 per group of 32), not llama.cpp's 8: each x is within d / 2 of its value (a
 * relative error of ~1.5e-5 of the group's largest), so the route is exact in the weights and nearly so in the
 * activations; the float32 route (qmm_f32.c) stays the exact one (`--quantized-activations none`, loader.py).
 * Formats: Q4 / Q40 (Q4_1, int4 / Q4_0), Q5 / Q5M (Q5_0, Q5_1), Q8 / Q8M (Q8_0, int8), K4M (Q4_K), K5M (Q5_K),
 * K6 (Q6_K) and the table formats MX4, IQ4NL, IQ4XS (MXFP4, IQ4_NL, IQ4_XS: their codes looked up in a table of
 * bytes, simd.h's lut_words); a column block of any other format (or of a mixed weight) runs on the float32 direct
 * route with the same call.
 *
 * Per group g of a column block, the integer sums S_c = sum_k q_ck xq_k of each column c (over half tiles
 * for the formats with a scale per 16 inputs) are exact in int32; out_c += (a_c dx_g) S_c + (b_c dx_g) sx_g,
 * with a, b the weight's scale and offset for the group (w = a q + b) and sx the sum of the group's xq: the
 * same value as sum_k w_ck (xq_k dx_g) up to float32 rounding. Nibble rows widen to one 16-bit word per byte:
 * the low nibbles are columns 0-7 (a k pair each), the high nibbles 8-15; x is a k pair per 32-bit lane.
 * Rows of x are independent: a row's result does not depend on the batch. The vector form is written once
 * over simd.h's integer vectors (SIMD_INT16: AVX-512 BW or AVX2); the portable build sums one code at a time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qtile.h"

static inline int dot_fmt(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q40 || fmt == QFMT_Q8 || fmt == QFMT_Q8M || fmt == QFMT_K4M || fmt == QFMT_K6
        || lut(fmt) || plane(fmt) == 1;
}

/* Row x [K] to 16-bit integers per group of 32. */
void qdot_quantize_row(int16_t *q, float *d, int32_t *s, const float *x, int K) {
    for (int g = 0; g < K / 32; g++) {
        const float amax = group_amax(x + 32 * g);
        const float inv = amax > 0.0f && amax <= 3.0e38f ? 32767.0f / amax : 0.0f;
        d[g] = inv > 0.0f ? amax / 32767.0f : 0.0f;
        round_group(q + 32 * g, s + 2 * g, x + 32 * g, inv);
    }
}

/* The scales of group g (half h) as out += (a dx) S + b (dx sx), a and b per column (16 / VW vectors each): a
 * and b, the weights' part, once per group for all rows of x; a K format's float16 super-block scales D (and
 * M) converted once per super-block (`Head`, at g % 8 == 0). */
typedef struct {
    vf d[16 / VW], m[16 / VW];
} Head;
static inline __attribute__((always_inline)) void head_scales(const uint8_t *col, const int fmt, int g, Head *hd) {
    const uint8_t *head = head_at(col, fmt, g);
    for (int c = 0; c < 16 / VW; c++) {
        hd->d[c] = f16v(head + 2 * VW * c);
        hd->m[c] = has_min(fmt) ? f16v(head + 32 + 2 * VW * c) : (vf){0};
    }
}
static inline __attribute__((always_inline)) void dot_scales(const Head *hd, const uint8_t *tile, int h,
                                                             const int fmt, vf a[16 / VW], vf b[16 / VW]) {
    for (int c = 0; c < 16 / VW; c++) {
        if (kfmt(fmt)) {
            a[c] = hd->d[c] * tof(s8v(tile + 16 * h + VW * c));
            b[c] = has_min(fmt) ? -(hd->m[c] * tof(u8v(tile + 16 + VW * c))) : (vf){0};
        } else if (fmt == QFMT_MX4) {
            a[c] = mx4_scale(tile + VW * c);
            b[c] = (vf){0};
        } else {
            a[c] = f16v(tile + 2 * VW * c);
            b[c] = has_min(fmt) ? f16v(tile + 32 + 2 * VW * c) : (vf){0};
        }
    }
}
#ifdef SIMD_INT16
/* Row m's sums S of group g (half h) into its 16 columns' F: one expression for the one-row and the panel
 * paths, so that both round alike (a row's result must not depend on the path its batch took). */
static inline __attribute__((always_inline)) void dot_fold(vf F[16 / VW], const vi S[16 / VW], const XQ16 *xq,
                                                           int64_t m, int G, int g, int h, const int parts,
                                                           const int off, const vf wa[16 / VW],
                                                           const vf wb[16 / VW]) {
    const int32_t *s = xq->s + m * 2 * G + 2 * g;
    const int32_t sx = parts == 2 ? s[h] : s[0] + s[1];
    const float dx = xq->d[m * G + g];
    for (int c = 0; c < 16 / VW; c++)
        F[c] += tof(S[c] - off * sx) * (wa[c] * dx) + wb[c] * (dx * (float)sx);
}
/* Row m's F (+ bias) written or added to the output: a whole block in vectors, lane by lane as store16 does the
 * clipped last block one by one. */
static inline __attribute__((always_inline)) void dot_store(const QMatmul *a, const vf F[16 / VW], int m, int cb) {
    if (16 * cb + 16 <= a->N) {
        float *o = a->out + (int64_t)m * a->ldo + 16 * cb;
        for (int c = 0; c < 16 / VW; c++) {
            const vf x = F[c] + (a->bias ? ld(a->bias + 16 * cb + VW * c) : (vf){0});
            st(o + VW * c, a->accumulate ? ld(o + VW * c) + x : x);
        }
        return;
    }
    float tmp[16];
    memcpy(tmp, F, sizeof tmp);
    store16(a, tmp, m, cb);
}
/* nr (<= QR) rows of x against one column block of a dot format. */
static inline __attribute__((always_inline)) void block_dot(const QMatmul *a, const XQ16 *xq, const uint8_t *col,
                                                            int m0, const int fmt, const int nr, int cb) {
    vf F[QR][16 / VW];
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < 16 / VW; c++) F[i][c] = (vf){0};
    /* ph accumulators a row of x, for rows r % ph: with few rows the chain of dependent dot products, not
     * their count, would bound the speed (their integer sums are exact in any order) */
    const int G = a->G, parts = halves(fmt), ph = nr >= PH ? 1 : PH / nr;
    Head hd;
    for (int g = 0; g < G; g++) {
        const uint8_t *tile = tile_at(col, fmt, g), *body = tile + scale_bytes(fmt);
        if (m0 == 0) prefetch_ahead(tile, fmt);
        if (kfmt(fmt) && g % 8 == 0) head_scales(col, fmt, g, &hd);
        const int32_t *pairs[QR];
        for (int i = 0; i < nr; i++) pairs[i] = (const int32_t *)(xq->q + (int64_t)(m0 + i) * a->G * 32 + 32 * g);
#pragma GCC unroll 2
        for (int h = 0; h < parts; h++) {
            vi S[QR][16 / VW];
            if (nibbles(fmt) && !lut(fmt)) {
                hv lo[QR][PH], hi[QR][PH];
                for (int i = 0; i < nr; i++)
                    for (int p = 0; p < ph; p++) lo[i][p] = hi[i][p] = HZERO();
#pragma GCC unroll 16
                for (int rr = 0; rr < 16 / parts; rr++) { /* bounds known to the compiler: unrolled whole */
                    const int r = 16 / parts * h + rr;
                    /* 4-bit codes: the byte itself (low + 16 high) against x, and 16 times the high nibble
                     * (the byte masked, no shift): the low nibbles' sum is their difference (below). 5-bit:
                     * the same with the plane's bits added at 4 and 8. K6: the words' bits 0-11, lo + 64 hi,
                     * and 64 hi (bits 6-11) */
                    hv wl, wh;
                    if (fmt == QFMT_K6) {
                        const hv w = k6_words(body, r);
                        wl = HAND(w, 0xFFF), wh = HAND(w, 0xFC0);
                    } else {
                        const hv w = nib_words(body, r);
                        wl = w, wh = HAND(w, 0xF0);
                        if (plane(fmt) == 1) { /* row r's bits moved to 4 (low nibble) and 8 (high) */
                            const hv q = HAND(HSLL(plane_words(body, r / 4), 4 - r % 4), 0x110);
                            wl = HADD16(w, q);
                            wh = HSEL(0xF0, w, q); /* q is 0 but at bits 4 and 8 */
                        }
                    }
                    for (int i = 0; i < nr; i++) {
                        const hv xp = HSET1(pairs[i][r]);
                        lo[i][rr % ph] = hdot(lo[i][rr % ph], wl, xp);
                        hi[i][rr % ph] = hdot(hi[i][rr % ph], wh, xp);
                    }
                }
                for (int i = 0; i < nr; i++) {
                    for (int p = 1; p < ph; p++) {
                        lo[i][0] = HADD(lo[i][0], lo[i][p]);
                        hi[i][0] = HADD(hi[i][0], hi[i][p]);
                    }
                    nib_cols(HSUB(lo[i][0], hi[i][0]), HSRA(hi[i][0], fmt == QFMT_K6 ? 6 : 4), S[i]);
                }
            } else {
                iv acc[QR][PH][BV];
                for (int i = 0; i < nr; i++)
                    for (int p = 0; p < ph; p++)
                        for (int v = 0; v < BV; v++) acc[i][p][v] = IZERO();
                iv quad[4][BV]; /* the table formats: four rows' words from one lookup */
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) {
                    iv w[BV];
                    if (lut(fmt) && r % 4 == 0) lut_words(body, r / 4, lut_table(fmt), quad);
                    if (lut(fmt))
                        for (int v = 0; v < BV; v++) w[v] = quad[r % 4][v];
                    else
                        byte_words(body, r, w);
                    for (int i = 0; i < nr; i++) {
                        const iv xp = ISET1(pairs[i][r]);
                        for (int v = 0; v < BV; v++) acc[i][r % ph][v] = dot16(acc[i][r % ph][v], w[v], xp);
                    }
                }
                for (int i = 0; i < nr; i++)
                    for (int v = 0; v < BV; v++) {
                        for (int p = 1; p < ph; p++) acc[i][0][v] = IADD(acc[i][0][v], acc[i][p][v]);
                        S[i][v] = (vi)acc[i][0][v];
                    }
            }
            vf wa[16 / VW], wb[16 / VW];
            dot_scales(&hd, tile, h, fmt, wa, wb);
            for (int i = 0; i < nr; i++) dot_fold(F[i], S[i], xq, m0 + i, G, g, h, halves(fmt), offset(fmt), wa, wb);
        }
    }
    for (int i = 0; i < nr; i++) dot_store(a, F[i], m0 + i, cb);
}

/* Passes of QR rows, then one of what is left: a row's sums do not depend on its pass. */
#define DOT_ROWS(fmt, a, xq, col, cb)                                                                           \
    for (int m0 = 0, n; (n = (a)->M - m0) > 0;) {                                                              \
        n = n >= QR ? QR : n;                                                                                  \
        switch (n) {                                                                                           \
        case 1: block_dot(a, xq, col, m0, fmt, 1, cb); break;                                                  \
        case 2: block_dot(a, xq, col, m0, fmt, 2 < QR ? 2 : QR, cb); break;                                    \
        case 3: block_dot(a, xq, col, m0, fmt, 3 < QR ? 3 : QR, cb); break;                                    \
        case 4: block_dot(a, xq, col, m0, fmt, 4 < QR ? 4 : QR, cb); break;                                    \
        default: block_dot(a, xq, col, m0, fmt, QR, cb); break;                                                \
        }                                                                                                      \
        m0 += n;                                                                                               \
    }
#define EACH_DOT_FORMAT(fmt, fn, ...)                                                                          \
    switch (fmt) {                                                                                             \
    case QFMT_Q4: fn(QFMT_Q4, __VA_ARGS__); break;                                                             \
    case QFMT_Q40: fn(QFMT_Q40, __VA_ARGS__); break;                                                           \
    case QFMT_Q8: fn(QFMT_Q8, __VA_ARGS__); break;                                                             \
    case QFMT_Q8M: fn(QFMT_Q8M, __VA_ARGS__); break;                                                           \
    case QFMT_K4M: fn(QFMT_K4M, __VA_ARGS__); break;                                                           \
    case QFMT_MX4: fn(QFMT_MX4, __VA_ARGS__); break;                                                           \
    case QFMT_IQ4NL: fn(QFMT_IQ4NL, __VA_ARGS__); break;                                                       \
    case QFMT_IQ4XS: fn(QFMT_IQ4XS, __VA_ARGS__); break;                                                       \
    case QFMT_Q5: fn(QFMT_Q5, __VA_ARGS__); break;                                                             \
    case QFMT_Q5M: fn(QFMT_Q5M, __VA_ARGS__); break;                                                           \
    case QFMT_K5M: fn(QFMT_K5M, __VA_ARGS__); break;                                                           \
    default: fn(QFMT_K6, __VA_ARGS__); break;                                                                  \
    }

/* ---- many rows: the column block widened once (the panel path) ---------------------------------------------
 * Why: block_dot widens a tile's codes (nibble unpack, K6's plane, a table's lookup) and converts its scales once per
 * pass of QR rows, and AVX2's 16 registers hold only QR = 2 rows: at 256 rows each tile was widened 128 times,
 * and the route took 1.35x the float32 route's time. Here a column block's codes are widened once into `panel`
 * as 16-bit words (widen_tile16, qtile.h) and its scales once as floats, and every row runs against them with
 * plain loads and vpmaddwd / vpdpwssd: rows in blocks of PNB, groups in slices of PNS (8 KB of words, kept in L1
 * while the block's passes of PNR rows reuse them), each row's F kept between slices. The integer sums are exact
 * in any order, and each row's F is folded group by group by dot_fold in block_dot's order from the same scales,
 * so a row's result is block_dot's bit for bit. */
#if defined(__AVX512BW__)
#define PNR 4  /* rows a pass */
#define PNH 2 /* accumulators a row: 8 chains hide vpdpwssd's latency */
#else
#define PNR 3 /* 6 accumulators, 6 F vectors, 2 of words and x's pair in 16 registers */
#define PNH 1
#endif
#define PNB 32 /* rows a block */
/* From this many rows a block runs through the panel (measured, Zen 4, 8192 x 2048: below it widening the block
 * costs more than block_dot's repeated unpacking; AVX-512's QR = 4 rows a pass repeat it half as often). */
#if defined(__AVX512BW__)
#define PANEL_ROWS 64
#else
#define PANEL_ROWS 32
#endif
#define PNS 8  /* groups a slice */

/* acc, held in a register as it is: GCC otherwise re-associates a row's chain of adds into a tree over all 16
 * rows' products, which needs 3x the registers AVX2 has and spilled most of them (4x slower when measured). */
static inline iv chained(iv acc) {
    __asm__("" : "+v"(acc));
    return acc;
}

/* The block's codes [G][16][32] as words, then its scales [G][halves][a 16, b 16] as dot_scales gives them. */
static inline __attribute__((always_inline)) void widen_block(const uint8_t *col, const int fmt, int G,
                                                              int16_t *codes, float *sc) {
    Head hd;
    for (int g = 0; g < G; g++) {
        const uint8_t *tile = tile_at(col, fmt, g);
        if (kfmt(fmt) && g % 8 == 0) head_scales(col, fmt, g, &hd);
        widen_tile16(tile + scale_bytes(fmt), fmt, codes + 512 * g);
        for (int h = 0; h < halves(fmt); h++) {
            vf wa[16 / VW], wb[16 / VW];
            dot_scales(&hd, tile, h, fmt, wa, wb);
            float *o = sc + 32 * (halves(fmt) * g + h);
            for (int c = 0; c < 16 / VW; c++) {
                st(o + VW * c, wa[c]);
                st(o + 16 + VW * c, wb[c]);
            }
        }
    }
}

/* nr (<= PNR) rows from m0 over groups g0..g1 - 1 of the widened block, their F carried in Fm [nr][16]. */
static inline __attribute__((always_inline)) void panel_dot(const QMatmul *a, const XQ16 *xq, const int16_t *codes,
                                                            const float *sc, int m0, const int parts, int off,
                                                            const int nr, int g0, int g1, float *Fm) {
    vf F[PNR][16 / VW];
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < 16 / VW; c++) F[i][c] = ld(Fm + 16 * i + VW * c);
    const int G = a->G;
    for (int g = g0; g < g1; g++) {
        const int32_t *pairs[PNR];
        for (int i = 0; i < nr; i++) pairs[i] = (const int32_t *)(xq->q + (int64_t)(m0 + i) * G * 32 + 32 * g);
#pragma GCC unroll 2
        for (int h = 0; h < parts; h++) {
            iv acc[PNR][PNH][BV];
            for (int i = 0; i < nr; i++)
                for (int p = 0; p < PNH; p++)
                    for (int v = 0; v < BV; v++) acc[i][p][v] = IZERO();
#pragma GCC unroll 16
            for (int rr = 0; rr < 16 / parts; rr++) {
                const int r = 16 / parts * h + rr;
                iv w[BV];
                for (int v = 0; v < BV; v++) w[v] = ((const ivu *)(codes + 512 * g + 32 * r))[v];
                for (int i = 0; i < nr; i++) {
                    const iv xp = ISET1(pairs[i][r]);
                    for (int v = 0; v < BV; v++) acc[i][rr % PNH][v] = chained(dot16(acc[i][rr % PNH][v], w[v], xp));
                }
            }
            vf wa[16 / VW], wb[16 / VW];
            for (int c = 0; c < 16 / VW; c++) {
                wa[c] = ld(sc + 32 * (parts * g + h) + VW * c);
                wb[c] = ld(sc + 32 * (parts * g + h) + 16 + VW * c);
            }
            for (int i = 0; i < nr; i++) {
                vi S[16 / VW];
                for (int v = 0; v < BV; v++) {
                    for (int p = 1; p < PNH; p++) acc[i][0][v] = IADD(acc[i][0][v], acc[i][p][v]);
                    S[v] = (vi)acc[i][0][v];
                }
                dot_fold(F[i], S, xq, m0 + i, G, g, h, parts, off, wa, wb);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < 16 / VW; c++) st(Fm + 16 * i + VW * c, F[i][c]);
}

/* All M rows against a widened block (its words and scales in `codes`, `sc`): instanced per halves-count, not
 * per format, since once widened every format's words run the same loop (the offset is a runtime multiplier in
 * dot_fold's integer step, exact): a third of the instances, and of qmm_dot.c's build time. */
static inline __attribute__((always_inline)) void panel_rows(const QMatmul *a, const XQ16 *xq, const int16_t *codes,
                                                             const float *sc, const int parts, int off, int cb) {
    const int G = a->G;
    float Fm[PNB * 16];
    for (int r0 = 0; r0 < a->M; r0 += PNB) {
        const int nb = a->M - r0 < PNB ? a->M - r0 : PNB;
        memset(Fm, 0, sizeof Fm);
        for (int g0 = 0; g0 < G; g0 += PNS) {
            const int g1 = g0 + PNS < G ? g0 + PNS : G;
            for (int i0 = 0, n; (n = nb - i0) > 0; i0 += n) {
                n = n >= PNR ? PNR : n;
                float *f = Fm + 16 * i0;
                switch (n) {
                case 1: panel_dot(a, xq, codes, sc, r0 + i0, parts, off, 1, g0, g1, f); break;
                case 2: panel_dot(a, xq, codes, sc, r0 + i0, parts, off, 2 < PNR ? 2 : PNR, g0, g1, f); break;
                case 3: panel_dot(a, xq, codes, sc, r0 + i0, parts, off, 3 < PNR ? 3 : PNR, g0, g1, f); break;
                default: panel_dot(a, xq, codes, sc, r0 + i0, parts, off, PNR, g0, g1, f); break;
                }
            }
        }
        for (int i = 0; i < nb; i++) {
            vf F[16 / VW];
            for (int c = 0; c < 16 / VW; c++) F[c] = ld(Fm + 16 * i + VW * c);
            dot_store(a, F, r0 + i, cb);
        }
    }
}

/* All M rows of one column block through the panel (K * 16 floats: the words take half, the scales an eighth). */
#define WIDEN_BLOCK(fmt, col, G, codes, sc) widen_block(col, fmt, G, codes, sc)
static void dot_panel(const QMatmul *a, const XQ16 *xq, const uint8_t *col, int fmt, int cb, float *panel) {
    int16_t *codes = (int16_t *)panel;
    float *sc = panel + 256 * a->G;
    EACH_DOT_FORMAT(fmt, WIDEN_BLOCK, col, a->G, codes, sc)
    if (halves(fmt) == 2)
        panel_rows(a, xq, codes, sc, 2, offset(fmt), cb);
    else
        panel_rows(a, xq, codes, sc, 1, offset(fmt), cb);
}
#else
/* The portable build: the same sums, one code at a time (code_at, qtile.h). */
static void block_dot_portable(const QMatmul *a, const XQ16 *xq, const uint8_t *col, int m, int fmt, int cb) {
    float F[16] = {0};
    const int G = a->G, parts = halves(fmt);
    Head hd;
    for (int g = 0; g < G; g++) {
        const uint8_t *tile = tile_at(col, fmt, g), *body = tile + scale_bytes(fmt);
        if (kfmt(fmt) && g % 8 == 0) head_scales(col, fmt, g, &hd);
        const int16_t *x = xq->q + (int64_t)m * G * 32 + 32 * g;
        for (int h = 0; h < parts; h++) {
            const int32_t *s = xq->s + (int64_t)m * 2 * G + 2 * g, sx = parts == 2 ? s[h] : s[0] + s[1];
            const float dx = xq->d[(int64_t)m * G + g];
            vf A[16 / VW], B[16 / VW];
            dot_scales(&hd, tile, h, fmt, A, B);
            float a16[16], b16[16];
            memcpy(a16, A, sizeof a16);
            memcpy(b16, B, sizeof b16);
            for (int c = 0; c < 16; c++) {
                int32_t S = 0;
                for (int k = 32 / parts * h; k < 32 / parts * (h + 1); k++) S += code_at(body, fmt, c, k) * x[k];
                F[c] += (float)(S - offset(fmt) * sx) * (a16[c] * dx) + b16[c] * (dx * (float)sx);
            }
        }
    }
    store16(a, F, m, cb);
}
#endif

/* One column block for all M rows on the dot route (a block of another format: the float32 direct route). */
void qdot_column_block(const QMatmul *a, const XQ16 *xq, int cb, float *panel) {
    int fmt;
    const uint8_t *col = column(a->w, a->fmt, a->G, cb, &fmt);
    if (!dot_fmt(fmt)) { /* the float32 route, as qmm_f32 runs it: through `panel` for many rows */
        qmm_column_block(a, cb, panel);
        return;
    }
#ifdef SIMD_INT16
    if (panel && a->M >= PANEL_ROWS && widens16(fmt)) {
        dot_panel(a, xq, col, fmt, cb, panel);
    } else {
        EACH_DOT_FORMAT(fmt, DOT_ROWS, a, xq, col, cb)
    }
#else
    for (int m = 0; m < a->M; m++) block_dot_portable(a, xq, col, m, fmt, cb);
#endif
}

/* out[M, N] (+)= x[M, K] @ W^T with x rounded to 16 bits per group; 0, -1 (out of memory) or -2 (bad sizes). */
int qmm_dot(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads) {
    if (bad_sizes(M, N, K, ldx, ldo, fmt)) return -2;
    const int G = K / 32;
    XQ16 xq = {malloc((size_t)M * K * sizeof(int16_t)), malloc((size_t)M * G * sizeof(float)),
               malloc((size_t)M * 2 * G * sizeof(int32_t))};
    int status = xq.q && xq.d && xq.s ? 0 : -1;
    if (status == 0) {
        for (int m = 0; m < M; m++)
            qdot_quantize_row(xq.q + (int64_t)m * K, xq.d + (int64_t)m * G, xq.s + (int64_t)m * 2 * G,
                              x + (int64_t)m * ldx, K);
        QMatmul a = {out, x, w, bias, M, N, G, ldx, ldo, fmt, accumulate};
        const int NB = (N + 15) / 16;
        if (num_threads > NB) num_threads = NB;
        if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            float *panel = M > MR ? malloc((size_t)K * 16 * sizeof(float)) : NULL; /* for non-dot blocks */
            if (M > MR && panel == NULL) {
#pragma omp atomic write
                status = -1;
            }
#pragma omp for schedule(static)
            for (int cb = 0; cb < NB; cb++)
                if (M <= MR || panel) qdot_column_block(&a, &xq, cb, panel);
            free(panel);
        }
    }
    free(xq.q);
    free(xq.d);
    free(xq.s);
    return status;
}
