/*
 * Decode attention over a paged KV cache on CPU, reading each block where it lies.
 *
 * Why: the portable torch path gathers every sequence's blocks into a fresh tensor and then runs SDPA over it,
 * so each decode step moves the whole batch's KV three times (read, write, read again). Here each sequence
 * walks its block table and reads each block's keys and values once, front to back, in place. The query heads
 * that share a KV head (GQA) are served from the same read.
 *
 * Layouts (row-major, contiguous):
 *   q, out        [S, H, D] float32
 *   k/v caches    [num_blocks, block_size, KVH, D], float32 or bfloat16 (cache_kind KV_F32 / KV_BF16), or
 *                 quantized (KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2): [num_blocks, block_size, KVH, kv_row_bytes(D)]
 *                 bytes, each (token, KV head) row D one-byte codes and one bfloat16 scale, rotated (kv_rotate)
 *   block_tables  [S, max_blocks] int64, context_lens [S] int64 (tokens to attend, including the new one)
 *
 * Where the speed comes from: each row of keys or values is read (and a bfloat16 one widened, in registers)
 * once for all the query heads that share its KV head (GQA), up to four at a time; the scores of VW (16 with
 * AVX-512) rows come out of one tree of shuffles and adds instead of a horizontal sum per row; head_dim 64 and
 * 128 get their own copies with the width known at compile time, so the accumulators stay in registers; keys
 * and values are prefetched two blocks ahead (blocks lie anywhere, so the hardware prefetcher cannot guess
 * them). At 64 sequences x 300 tokens of a bfloat16 cache (the W1 decode step of the default model) that is
 * 1.4x the previous kernel's speed on Zen 4, where the reads from memory bound it. The SIMD is GCC/Clang
 * vector types, not intrinsics, so the same source builds on x86 and ARM (the shuffles need GCC 12 or Clang;
 * older compilers sum each row by itself); it is compiled with -O3 -ffast-math for the host CPU. Sequences are
 * shared out over OpenMP threads one at a time, so long and short contexts balance; linked against the libgomp
 * that torch has already loaded, the kernel runs on torch's own thread pool instead of fighting its spinning
 * workers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "simd.h"

typedef uint32_t u32_alias __attribute__((may_alias)); /* float bits, written as integers */

/* A float8 code -> its float32 value, as torch's .to(float32) gives it: e4m3fn (m = 3, bias = 7; 0x7f is NaN, no
 * infinities) or e5m2 (m = 2, bias = 15; IEEE-like). Integer operations, one int -> float conversion for the
 * subnormal codes and selects, no table, so a row's loop vectorizes on any CPU; the path of builds without F16C
 * (simd.h's widen_fp8_f16c is faster) and of a row's last D % 16 codes. */
static inline float fp8_value(uint8_t c, const int m, const int bias) {
    const uint32_t mag = c & 0x7f, sign = (uint32_t)(c & 0x80) << 24;
    const float tiny = (float)(int32_t)mag * (m == 3 ? 0x1p-9f : 0x1p-16f); /* exponent 0: mag x 2^(1-bias-m) */
    uint32_t bits;
    memcpy(&bits, &tiny, 4);
    bits = mag < (1u << m) ? bits : (mag << (23 - m)) + ((uint32_t)(127 - bias) << 23);
    if (m == 3)
        bits = mag == 0x7f ? 0x7fc00000u : bits;
    else
        bits = mag >= 0x7c ? (mag == 0x7c ? 0x7f800000u : 0x7fc00000u) : bits;
    bits |= sign;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* Columns [c0, c1) (the KV heads the caller reads, c0 and c1 multiples of D) of a quantized block's n rows,
 * widened to float32 into `buf` at the same place as a float32 cache holds them: one (token, head) row of D
 * codes and its bfloat16 scale at a time. */
static inline void widen_quantized(float *buf, const uint8_t *block, int n, int KVH, int D, int c0, int c1,
                                   int kind, int64_t S) {
    const int64_t W = (int64_t)KVH * D, R = kv_row_bytes(D);
    for (int t = 0; t < n; t++)
        for (int h = c0 / D; h < c1 / D; h++) {
            const uint8_t *codes = block + t * S + h * R; /* S: bytes from a token's row to the next */
            const uint32_t bits = (uint32_t)(codes[D] | codes[D + 1] << 8) << 16;
            float scale;
            memcpy(&scale, &bits, 4);
            float *out = buf + t * W + (int64_t)h * D;
            if (kind == KV_INT8)
                for (int j = 0; j < D; j++) out[j] = scale * (float)(int8_t)codes[j];
            else if (kind == KV_FP8_E4M3)
                for (int j = widen_fp8_f16c(out, codes, D, scale, 0); j < D; j++)
                    out[j] = scale * fp8_value(codes[j], 3, 7);
            else
                for (int j = widen_fp8_f16c(out, codes, D, scale, 1); j < D; j++)
                    out[j] = scale * fp8_value(codes[j], 2, 15);
        }
}

/* The first n rows of a quantized block (rows S bytes apart), columns [c0, c1) (the KV heads the caller reads),
 * widened to float32 into `buf` at the same place as a float32 cache of packed rows holds them. Float32 and
 * bfloat16 blocks of packed rows are read in place. */
static inline void widen_block(float *buf, const void *cache, int64_t block, int n, int bs, int KVH, int D, int c0,
                               int c1, int kind, int64_t S) {
    widen_quantized(buf, (const uint8_t *)cache + block * bs * S, n, KVH, D, c0, c1, kind, S);
}

/* Ask for the bytes of columns [c0, c1) of a block's n rows (the KV heads the caller reads) ahead of use:
 * blocks lie anywhere, so the hardware prefetcher cannot guess the next one. Only those columns: a call for
 * one head that prefetched whole blocks spent most of its time in prefetches of lines it never read. */
static inline void prefetch(const void *cache, int64_t block, int n, int bs, int D, int c0, int c1, int kind,
                            int64_t S) {
    const int64_t row = kind == KV_F32 ? 4 * S : kind == KV_BF16 ? 2 * S : S;
    const int64_t b0 = kind == KV_F32 ? 4 * c0 : kind == KV_BF16 ? 2 * c0 : c0 / D * kv_row_bytes(D);
    const int64_t b1 = kind == KV_F32 ? 4 * c1 : kind == KV_BF16 ? 2 * c1 : c1 / D * kv_row_bytes(D);
    const char *p = (const char *)cache + block * bs * row;
    for (int t = 0; t < n; t++)
        for (int64_t j = t * row + b0; j < t * row + b1; j += 64) __builtin_prefetch(p + j, 0, 1);
}

/* VW floats of a cache row from element `off`: float32 as they are, bfloat16 widened (exact). */
static inline __attribute__((always_inline)) vf load_row(const void *rows, int64_t off, const int bf16) {
    if (bf16) return ld_bf16((const uint16_t *)rows + off);
    return ld((const float *)rows + off);
}

enum { CHUNK = 4 };   /* query heads of one KV head served by one read of a row */
enum { PREFETCH = 2 }; /* blocks ahead */

/* s[h * L + r] = scale * q_h . k_r for nh query heads (q_h = q + h * D) and rows r0 <= r < r1 of one block at
 * one KV head (row r at `rows` + r * W). Rows go in groups of VW, always whole groups of the block (a group
 * that fits in it), so a position's score never depends on which rows the caller asked for: every token of a
 * step and every split of a prompt gets the same numbers. The rows past a block's last whole group, one at a
 * time. Each row is read (and widened) once for the nh heads. */
static inline __attribute__((always_inline)) void scores_kv(float *s, int64_t L, const float *q, const void *rows,
                                                            int64_t W, int r0, int r1, int bs, float scale,
                                                            const int nh, const int D, const int bf16) {
    const int whole = bs / VW * VW;
    int r = r0 / VW * VW;
    for (; r < r1 && r < whole; r += VW) {
        vf acc[CHUNK][VW];
        for (int t = 0; t < VW; t++) {
            vf a[CHUNK] = {{0}};
            for (int j = 0; j < D; j += VW) {
                const vf k = load_row(rows, (int64_t)(r + t) * W + j, bf16);
                for (int h = 0; h < nh; h++) a[h] += ld(q + h * D + j) * k;
            }
            for (int h = 0; h < nh; h++) acc[h][t] = a[h];
        }
        for (int h = 0; h < nh; h++) *(vfu *)(s + h * L + r) = scale * reduce_rows(acc[h]);
    }
    for (r = r > r0 ? r : r0; r < r1; r++) {
        vf a[CHUNK] = {{0}};
        for (int j = 0; j < D; j += VW) {
            const vf k = load_row(rows, (int64_t)r * W + j, bf16);
            for (int h = 0; h < nh; h++) a[h] += ld(q + h * D + j) * k;
        }
        for (int h = 0; h < nh; h++) s[h * L + r] = scale * hsum(a[h]);
    }
}

/* o_h[c0, c0 + nv VW) += sum_r p[h * L + r] * v_r[c0, c0 + nv VW) over rows r0 <= r < r1, for nh query heads (o_h
 * = o + h * D): each row's columns read (and widened) once for them, the accumulators in registers across the rows,
 * rows in order. */
static inline __attribute__((always_inline)) void values_kv(float *o, const float *p, int64_t L, const void *rows,
                                                            int64_t W, int r0, int r1, const int nh, const int nv,
                                                            int c0, const int D, const int bf16) {
    vf acc[CHUNK][nv];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < nv; j++) acc[h][j] = ld(o + h * D + c0 + j * VW);
    for (int r = r0; r < r1; r++)
        for (int j = 0; j < nv; j++) {
            const vf v = load_row(rows, (int64_t)r * W + c0 + j * VW, bf16);
            for (int h = 0; h < nh; h++) acc[h][j] += p[h * L + r] * v;
        }
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < nv; j++) *(vfu *)(o + h * D + c0 + j * VW) = acc[h][j];
}

/* Heads [h, h + n) of one KV head, n <= CHUNK in calls of a width known at compile time (the values pass
 * holds heads x vectors accumulators: at most 16 registers). A row wider than 8 vectors (head_dim 128 on AVX2,
 * 256 on AVX-512) goes in slices of 8 for 2 heads at a time, not whole for one: each value row was widened once
 * per query head, and on AVX2 (no bfloat16 dot) that widening was most of the pass. A column's sum runs over
 * the same rows in the same order either way. */
static inline __attribute__((always_inline)) void kv_heads(int pass, float *s, int64_t L, const float *q, float *o,
                                                           const void *rows, int64_t W, int r0, int r1, int bs,
                                                           float scale, int n, const int D, const int bf16) {
    const int nv = D / VW > 8 && D / VW % 8 == 0 ? 8 : D / VW; /* vectors a values slice */
    const int vn = nv <= 4 ? 4 : nv <= 8 ? 2 : 1;              /* heads per values call */
    if (pass == 0)
        for (int h = 0; h < n; h += CHUNK) {
            const int m = n - h < CHUNK ? n - h : CHUNK;
            float *sh = s + h * L;
            const float *qh = q + h * D;
            if (m == 4) scores_kv(sh, L, qh, rows, W, r0, r1, bs, scale, 4, D, bf16);
            else if (m == 3) scores_kv(sh, L, qh, rows, W, r0, r1, bs, scale, 3, D, bf16);
            else if (m == 2) scores_kv(sh, L, qh, rows, W, r0, r1, bs, scale, 2, D, bf16);
            else scores_kv(sh, L, qh, rows, W, r0, r1, bs, scale, 1, D, bf16);
        }
    else
        for (int c0 = 0; c0 < D; c0 += nv * VW)
            for (int h = 0; h < n; h += vn) {
                const int m = n - h < vn ? n - h : vn;
                float *oh = o + h * D;
                const float *ph = s + h * L;
                if (m == 4) values_kv(oh, ph, L, rows, W, r0, r1, 4, nv, c0, D, bf16);
                else if (m == 3) values_kv(oh, ph, L, rows, W, r0, r1, 3, nv, c0, D, bf16);
                else if (m == 2) values_kv(oh, ph, L, rows, W, r0, r1, 2, nv, c0, D, bf16);
                else values_kv(oh, ph, L, rows, W, r0, r1, 1, nv, c0, D, bf16);
            }
}

/* The same two steps for a head_dim that is no multiple of VW, one float at a time, one head per call. */
static void scores_scalar(float *s, const float *q, const float *k, int r0, int r1, int64_t W, int D, float scale) {
    for (int r = r0; r < r1; r++) {
        float a = 0.0f;
        for (int j = 0; j < D; j++) a += q[j] * k[r * W + j];
        s[r] = scale * a;
    }
}

static void values_scalar(float *o, const float *p, const float *v, int r0, int r1, int64_t W, int D) {
    for (int r = r0; r < r1; r++)
        for (int j = 0; j < D; j++) o[j] += p[r] * v[r * W + j];
}

/* Probabilities below e^-60 of the largest are set to 0: next to it they are far below float32's resolution,
 * and left in they become subnormal numbers (after exp, or after the division by the sum), whose every
 * multiply takes a slow microcode path: 30x slower attention on real prompts. Row h is scores + h * stride,
 * its entries [lo, ctx) the scores of the positions in the window; with a soft-cap they are capped first.
 * With sinks, head h's sinks[h] is one more logit in the max and the sum, whose value is zero (transformers'
 * gpt-oss: a column concatenated to the scores, dropped after the softmax). */
static void softmax_rows(float *scores, int h0, int h1, int64_t lo, int64_t ctx, int64_t stride, float softcap,
                         const float *sinks) {
    for (int h = h0; h < h1; h++) {
        float *sc = scores + h * stride;
        for (int64_t t = lo; softcap > 0.0f && t < ctx; t++) sc[t] = softcap * tanhf(sc[t] / softcap);
        float m = sinks && sinks[h] > sc[lo] ? sinks[h] : sc[lo];
        for (int64_t t = lo + 1; t < ctx; t++) m = sc[t] > m ? sc[t] : m;
        float sum = sinks && sinks[h] - m >= -60.0f ? expf(sinks[h] - m) : 0.0f;
        for (int64_t t = lo; t < ctx; t++) {
            const float e = sc[t] - m;
            sc[t] = e < -60.0f ? 0.0f : expf(e);
            sum += sc[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = lo; t < ctx; t++) sc[t] *= inv;
    }
}

/* One block's rows [r0, r1) for the query heads h0..h1-1 of one query (q, o: its rows; s: its scores, head h at
 * s + h * L, indexed by position from the block's first), KV head by KV head. */
static inline __attribute__((always_inline)) void block_heads(const Args *a, int pass, float *s, int64_t L,
                                                              const float *q, float *o, const void *rows, int r0,
                                                              int r1, int h0, int h1, const int D, const int bf16) {
    const int G = a->H / a->KVH;
    const int64_t W = (int64_t)a->KVH * D;
    for (int g = h0 / G; g <= (h1 - 1) / G; g++) {
        const int hs = g * G > h0 ? g * G : h0, he = g * G + G < h1 ? g * G + G : h1;
        if (D % VW == 0) {
            const void *kv = bf16 ? (const void *)((const uint16_t *)rows + g * D)
                                  : (const void *)((const float *)rows + g * D);
            kv_heads(pass, s + hs * L, L, q + hs * D, o + hs * D, kv, W, r0, r1, a->block_size, a->scale, he - hs, D,
                     bf16);
            continue;
        }
        const float *kv = (const float *)rows + g * D; /* bfloat16 blocks of such sizes come widened */
        for (int h = hs; h < he; h++)
            if (pass == 0)
                scores_scalar(s + h * L, q + h * D, kv, r0, r1, W, D, a->scale);
            else
                values_scalar(o + h * D, s + h * L, kv, r0, r1, W, D);
    }
}

/* Query heads h0..h1 of nq consecutive tokens of sequence s (context lengths ctx, ctx + 1, ...: one decode
 * token, or a tile of a prefill chunk): scores block by block, softmax, then values block by block, each block
 * read once for all the tile's queries and all the heads that share a KV head. A token's keys (or values) for
 * all KV heads are one row of W = KVH * D, and a block is block_size rows back to back; float32 and bfloat16
 * blocks are read where they lie, quantized ones widened first. With a window, query i reads only positions
 * [window_start(ctx + i), ctx + i): the blocks before the first query's window are never touched (the pool
 * may have handed them to another request). Scores: query i's head h at scores + (i * H + h) * L. */
static inline __attribute__((always_inline)) void one_seq_impl(const Args *a, int s, int h0, int h1, float *scores,
                                                               float *buf, const int D) {
    const int H = a->H, KVH = a->KVH, G = H / KVH, bs = a->block_size, kind = a->cache_kind, nq = a->nq;
    const int c0 = (h0 / G) * D, c1 = ((h1 - 1) / G + 1) * D;
    const int64_t ctx = a->context_lens[s], last = ctx + nq - 1, W = (int64_t)KVH * D, L = last + VW;
    const int64_t *table = a->block_tables + (int64_t)s * a->max_blocks;
    const float *q = a->q + (int64_t)s * H * D; /* head h uses KV head h / G */
    float *out = a->out + (int64_t)s * H * D;
    const int64_t nblocks = (last + bs - 1) / bs, b0 = window_start(a, ctx) / bs;
    /* bfloat16 rows are widened where they are read, except for a tile of queries, where a block widened once
     * into `buf` serves them all (the same exact values, so the same results either way) */
    const int64_t S = kv_stride_of(a); /* rows wider than W (a slot's front) are copied into buf, packed */
    const int in_place = S == W && (kind == KV_F32 || (kind == KV_BF16 && D % VW == 0 && nq == 1));

    for (int pass = 0; pass < 2; pass++) {
        const void *cache = pass == 0 ? a->k_cache : a->v_cache;
        for (int i = 0; pass == 1 && i < nq; i++) {
            softmax_rows(scores + (int64_t)i * H * L, h0, h1, window_start(a, ctx + i), ctx + i, L, a->softcap,
                         a->sinks);
            memset(out + (int64_t)i * a->out_stride + h0 * D, 0, (size_t)(h1 - h0) * D * sizeof(float));
        }
        for (int64_t b = b0; b < nblocks; b++) {
            const int64_t first = b * bs;
            /* Prefetch two blocks ahead, and in the keys' pass the values of the same blocks too: a block's
             * rows of one KV head are a few short runs, and with one block ahead the loads still waited on
             * memory (1.4x faster here at 64 sequences x 300 tokens, bfloat16). The values then wait in L2;
             * the values' pass asks again, for contexts longer than L2 holds. */
            for (int64_t d = b == b0 ? 0 : PREFETCH; d <= PREFETCH && b + d < nblocks; d++) {
                if (d > 0) prefetch(cache, table[b + d], bs, bs, D, c0, c1, kind, S);
                if (pass == 0) prefetch(a->v_cache, table[b + d], bs, bs, D, c0, c1, kind, S);
            }
            const int64_t need = (last - first + VW - 1) / VW * VW; /* whole groups of rows: scores_kv */
            const int n = (int)(need < bs ? need : bs);
            const void *rows;
            if (in_place)
                rows = kind == KV_F32 ? (const void *)((const float *)cache + table[b] * bs * W)
                                      : (const void *)((const uint16_t *)cache + table[b] * bs * W);
            else if (kind == KV_F32) {
                const float *src = (const float *)cache + table[b] * bs * S;
                for (int t = 0; t < n; t++)
                    memcpy(buf + t * W + c0, src + t * S + c0, (size_t)(c1 - c0) * sizeof(float));
                rows = buf;
            } else if (kind == KV_BF16) {
                const uint16_t *src = (const uint16_t *)cache + table[b] * bs * S;
                u32_alias *dst = (u32_alias *)buf;
                for (int t = 0; t < n; t++)
                    for (int64_t j = c0; j < c1; j++) dst[t * W + j] = ((uint32_t)src[t * S + j]) << 16;
                rows = buf;
            } else {
                widen_block(buf, cache, table[b], n, bs, KVH, D, c0, c1, kind, S);
                rows = buf;
            }
            for (int i = 0; i < nq; i++) {
                const int64_t lo = window_start(a, ctx + i) > first ? window_start(a, ctx + i) : first;
                const int64_t end = ctx + i < first + bs ? ctx + i : first + bs;
                if (end <= lo) continue;
                float *si = scores + (int64_t)i * H * L + first, *oi = out + (int64_t)i * a->out_stride;
                const float *qi = q + (int64_t)i * a->q_stride;
                const int r0 = (int)(lo - first), r1 = (int)(end - first);
                if (kind == KV_BF16 && in_place) /* the row type known at compile time in each copy */
                    block_heads(a, pass, si, L, qi, oi, rows, r0, r1, h0, h1, D, 1);
                else
                    block_heads(a, pass, si, L, qi, oi, rows, r0, r1, h0, h1, D, 0);
            }
        }
    }
}

static void one_seq_64(const Args *a, int s, int h0, int h1, float *sc, float *buf) {
    one_seq_impl(a, s, h0, h1, sc, buf, 64);
}
static void one_seq_128(const Args *a, int s, int h0, int h1, float *sc, float *buf) {
    one_seq_impl(a, s, h0, h1, sc, buf, 128);
}
static void one_seq_any(const Args *a, int s, int h0, int h1, float *sc, float *buf) {
    one_seq_impl(a, s, h0, h1, sc, buf, a->D);
}

void paged_attention_heads(const Args *a, int s, int h0, int h1, float *scores, float *buf) {
    if (a->D == 64)
        one_seq_64(a, s, h0, h1, scores, buf);
    else if (a->D == 128)
        one_seq_128(a, s, h0, h1, scores, buf);
    else
        one_seq_any(a, s, h0, h1, scores, buf);
}

/* n quantized cache rows -> n rows of D floats (still rotated), as attention widens them: the tests compare the
 * values with torch's conversion of the same codes. 0, or -2 for bad sizes. */
int kv_dequantize_rows(float *dst, const uint8_t *src, int64_t n, int D, int kind) {
    if (n < 0 || D <= 0 || n > INT32_MAX || kind < KV_INT8 || kind > KV_FP8_E5M2) return -2;
    widen_quantized(dst, src, (int)n, 1, D, 0, D, kind, kv_row_bytes(D));
    return 0;
}

void kv_rotate(float *x, int D) {
    const int P = D & -D;
    const float norm = 1.0f / sqrtf((float)P);
    for (float *b = x; b < x + D; b += P) {
        for (int len = 1; len < P; len *= 2)
            for (int i = 0; i < P; i += 2 * len)
                for (int j = i; j < i + len; j++) {
                    const float u = b[j], v = b[j + len];
                    b[j] = u + v;
                    b[j + len] = u - v;
                }
        for (int j = 0; j < P; j++) b[j] *= norm;
    }
}

/* 0, or -3 for a context length outside the block table, -4 for a block id outside the cache. */
int paged_attention_check(const Args *a, int S, int64_t num_blocks, int64_t *max_ctx) {
    *max_ctx = 0;
    for (int s = 0; s < S; s++) {
        int64_t c = a->context_lens[s];
        if (c < 1 || c > (int64_t)a->max_blocks * a->block_size) return -3;
        if (c > *max_ctx) *max_ctx = c;
        for (int64_t b = window_start(a, c) / a->block_size; b < (c + a->block_size - 1) / a->block_size; b++) {
            int64_t id = a->block_tables[(int64_t)s * a->max_blocks + b];
            if (id < 0 || id >= num_blocks) return -4;
        }
    }
    return 0;
}

/* Returns 0 on success; -2 bad sizes, -3 a context length outside the block table, -4 a block id outside the
 * cache, -1 out of memory. */
int paged_decode_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, int S, int H, int KVH,
                           int D, int block_size, int max_blocks, int64_t num_blocks, float scale, int cache_kind,
                           int64_t window, float softcap, const float *sinks, int num_threads) {
    if (S <= 0 || H <= 0 || KVH <= 0 || H % KVH != 0 || D <= 0 || block_size <= 0 || cache_kind < KV_F32 ||
        cache_kind > KV_FP8_E5M2)
        return -2;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > S) num_threads = S; /* one sequence per thread at least: waking idle threads costs more */
    Args a = {out, q, k_cache, v_cache, block_tables, context_lens, H, KVH, D, block_size, max_blocks,
              cache_kind, scale, 0, 1, H * D, H * D, window, softcap, sinks, 0};
    /* A bad context length or block id would read outside the cache: refuse the call instead. */
    const int bad = paged_attention_check(&a, S, num_blocks, &a.max_ctx);
    if (bad) return bad;
    float *rotated = NULL; /* a quantized cache holds rotated rows: the queries are rotated to match */
    if (cache_kind >= KV_INT8) {
        rotated = malloc((size_t)S * H * D * sizeof(float));
        if (!rotated) return -1;
        memcpy(rotated, q, (size_t)S * H * D * sizeof(float));
        for (int64_t r = 0; r < (int64_t)S * H; r++) kv_rotate(rotated + r * D, D);
        a.q = rotated;
    }
    int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *scores = malloc((size_t)(a.max_ctx + VW) * H * sizeof(float));
        float *buf = malloc((size_t)block_size * KVH * D * sizeof(float));
        if (!scores || !buf) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < S; s++)
            if (scores && buf) {
                paged_attention_heads(&a, s, 0, H, scores, buf);
                for (int h = 0; rotated && h < H; h++) kv_rotate(out + ((int64_t)s * H + h) * D, D); /* back */
            }
        free(scores);
        free(buf);
    }
    free(rotated);
    return status;
}
