/*
 * The weights' tiles, shared by every matmul route (qmm_f32.c, qmm_dot.c, qmm_bf16.c; quant_pack.c writes them):
 * the formats' byte layout, where a tile lies, and a tile row dequantized in registers to exactly the file's
 * values.
 *
 * Layout ("tiles"): columns (output features) in blocks of 16, K in groups of 32. One (column block, group)
 * tile holds the 16 columns' scales, then their 512 weights in 16 rows r = 0..15, row r holding k = 2r and
 * 2r + 1 of every column, i.e. the VNNI order of an AMX bfloat16 B tile. Bodies:
 *   nibbles (Q4, Q40, K4M): 16 bytes a row; byte j: low nibble = column j/2, high nibble = column 8 + j/2, both
 *       at k = 2r + j%2; the 5-bit formats (Q5, Q5M, K5M) add a plane of the bits above the nibble after the
 *       nibbles: per row quad (rows 4t .. 4t + 3) 16 bytes, byte j the high bits of nibble byte j: row 4t + p's
 *       low nibble in bit p, its high nibble in bit 4 + p (one widened load serves the integer route's four
 *       rows, each row's bits a shift away from bits 4 and 8 of its words);
 *   K6 (6-bit codes): the same 16 "bytes" j a row, 6 + 2 bits each: the 6-bit code of column j/2 in bits 0-5,
 *       the low 2 bits of column 8 + j/2's in bits 6-7; per row pair t (rows 2t + s) 32 bytes, row 2t + s's
 *       bytes 0-7 at 8 s, its bytes 8-15 at 16 + 8 s; then per row pair 16 bytes, byte 8 s + i the top 4 bits
 *       of column 8 + j/2's code in row 2t + s for byte j = i (low nibble) and j = 8 + i (high nibble). Why not
 *       nibbles and a 2-bit plane: the integer route interleaves a pair's code bytes with its plane bytes into
 *       words (one unpack a row, the plane loaded once for both rows and shifted once) whose bits 0-11 are
 *       code(j/2) + 64 code(8 + j/2), two masks from its two dot products (qmm_dot.c); the nibble form took
 *       two widenings, a shift, two masks, an add and a select a row, and bounded one-row decode;
 *   codes are stored with an offset that makes them unsigned (Q5: 16, K6: 32, and Q40's 4-bit codes: 8), taken
 *       off again in registers;
 *   bytes (Q8, Q8M, K8M, K8): 32 bytes a row; byte e = column e/2 at k = 2r + e%2;
 *   halves (F16, BF16): 32 16-bit values a row in the order of bytes;
 *   the table formats (4-bit codes of a 16-entry table: MX4, MXFP4's E2M1 values; IQ4NL and IQ4XS, IQ4_NL's
 *       and IQ4_XS's non-linear one): the nibble rows of four rows r = 4t + p interleaved, 64 bytes a row quad t:
 *       byte 2u + p (p = 0, 1) holds row 4t + p in its low nibble and row 4t + p + 2 in its high one, each at
 *       word u of its row (column u/2 at k = 2r + u%2), so that one 512-bit (or two 256-bit) table lookups and
 *       a mask or shift per row give the integer route four rows of 16-bit words with no widening (simd.h's
 *       lut_words); the codes are the file's nibbles, looked up in registers, never widened in memory.
 * Scales before the body: Q4 / Q8M / Q5M d[16], m[16] float16; Q8 / Q5 / Q40 / IQ4NL d[16]; MX4 e[16], the E8M0
 * bytes as stored (see mx4_scale); F16 / BF16 none. The K formats (IQ4XS among them: IQ4_XS's 6-bit scale
 * ls - 32 as int8 s per tile, its float16 d as D; 4.31 bits a weight, the file's 4.25 + D per column) group 8
 * tiles (K = 256, a GGUF super-block) behind a head of D[16] (and M[16]) float16 per column, and each tile
 * holds its integer scales s (int8) and, with a minimum, mi (uint8): per half tile (16 k) for K8M / K8 / K6
 * ([2][16] each), per tile for K4M / K5M / IQ4XS ([16]). A weight is a = D s, b = -M mi, w = a q + b. QFMT_MIXED: a weight
 * whose column blocks differ in format (merged q/k/v of a Q4_K_M file): a table of int64 (byte offset << 5 |
 * format) per column block, then the blocks.
 *
 * A dequantized tile row is NV = 32 / VW vectors (simd.h's width); vector v holds columns VW/2 v .. VW/2 (v + 1)
 * - 1, each k pair side by side, and a lane accumulates w * x over the even or the odd k of its column (the two
 * lanes are added at the end).
 */
#ifndef PAGEDLLM_QTILE_H
#define PAGEDLLM_QTILE_H
#include <stdint.h>
#include <string.h>

#include "quant_matmul.h"
#include "simd.h"

#define NV (32 / VW)          /* vectors per dequantized tile row */
#define MR (VW == 16 ? 6 : 2) /* rows per direct block (qmm_f32.c): more than this go through a panel */

/* VW groups' E8M0 bytes as their scales 2^(e - 128), exactly ggml_e8m0_to_fp32_half: e >= 2 the normal float
 * of exponent field e - 1, e = 0 and 1 the subnormals 2^-128 and 2^-127 (bits 0x200000 << e = (e + 1) << 21);
 * e = 255 is 2^127, not NaN as OCP MX has it: llama.cpp and gguf-py read it so ("NaNs are not handled"), and
 * a weight is the file's value only if read as they read it. Why the byte and not a float per group: a
 * decode step reads every byte of the weights, and the byte keeps MXFP4 at its file's 4.25 bits a weight (a
 * float32 scale would be 5, float16 cannot hold 2^-128..2^127); the two integer operations that make the
 * float come once per 32 weights of a column. */
static inline vf mx4_scale(const uint8_t *e8) {
    const vi e = u8v(e8), small = e < 2;
    return (vf)((small & ((e + 1) << 21)) | (~small & (((e - 1) & 255) << 23)));
}

/* Lane l of vector v of a row belongs to column VW/2 v + l/2: `cols` holds VW consecutive columns' values
 * starting at column VW (v / 2) when VW = 8, at 0 when VW = 16; this spreads them to vector v's lanes. */
static inline vf spread(vf cols, int v) {
    vi idx;
    for (int l = 0; l < VW; l++) idx[l] = (VW / 2 * v) % VW + l / 2;
    return __builtin_shuffle(cols, idx);
}

/* ---- formats ----------------------------------------------------------------------------------------------- */
static inline int kfmt(int fmt) {
    return (fmt >= QFMT_K4M && fmt <= QFMT_K8) || fmt == QFMT_K5M || fmt == QFMT_K6 || fmt == QFMT_IQ4XS;
}
/* The table formats: 4-bit codes looked up in a 16-entry table (MXFP4's, IQ4's), row quads interleaved. */
static inline int lut(int fmt) { return fmt == QFMT_MX4 || fmt == QFMT_IQ4NL || fmt == QFMT_IQ4XS; }
static inline int has_min(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q8M || fmt == QFMT_K4M || fmt == QFMT_K8M || fmt == QFMT_Q5M || fmt == QFMT_K5M;
}
static inline int plane(int fmt) { /* high bits a code above its nibble: 1 (5-bit formats), 2 (6-bit), 0 */
    return fmt == QFMT_K6 ? 2 : fmt == QFMT_Q5 || fmt == QFMT_Q5M || fmt == QFMT_K5M ? 1 : 0;
}
static inline int nibbles(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q40 || fmt == QFMT_K4M || lut(fmt) || plane(fmt);
}
/* Stored q + offset (the table formats: the integer route's table values, kvalues + 12, IQ4_VALUES + 128). */
static inline int offset(int fmt) {
    return fmt == QFMT_Q5 ? 16 : fmt == QFMT_K6 ? 32 : fmt == QFMT_Q40 ? 8 : fmt == QFMT_MX4 ? 12 : lut(fmt) ? 128 : 0;
}
/* A table format's values, and its integer route's table (the values + offset, unsigned bytes: lut_words). */
static inline const int8_t *lut_values(int fmt) { return fmt == QFMT_MX4 ? MX4_VALUES : IQ4_VALUES; }
static const uint8_t MX4_WORDS[16] __attribute__((unused)) = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
static const uint8_t IQ4_WORDS[16] __attribute__((unused)) = {1,   24,  45,  63,  79,  93,  106, 118,
                                                              129, 141, 153, 166, 181, 197, 217, 241};
static inline const uint8_t *lut_table(int fmt) { return fmt == QFMT_MX4 ? MX4_WORDS : IQ4_WORDS; }
static inline int halves(int fmt) { return fmt == QFMT_K8M || fmt == QFMT_K8 || fmt == QFMT_K6 ? 2 : 1; }
static inline int dense16(int fmt) { return fmt == QFMT_F16 || fmt == QFMT_BF16; }
/* The formats the int8 route (qmm_i8.c) runs; a block of another takes the float32 route. */
static inline int i8_fmt(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q40 || fmt == QFMT_Q8 || fmt == QFMT_Q8M || fmt == QFMT_K4M || fmt == QFMT_K6;
}

/* Bytes before a tile's body (its scales), of a body, of a K format's super-block head. */
static inline int scale_bytes(int fmt) {
    if (kfmt(fmt)) return halves(fmt) * 16 * (has_min(fmt) ? 2 : 1);
    return dense16(fmt) ? 0 : fmt == QFMT_MX4 ? 16 : 32 * (has_min(fmt) ? 2 : 1);
}
static inline int body_bytes(int fmt) { return nibbles(fmt) ? 256 + 64 * plane(fmt) : dense16(fmt) ? 1024 : 512; }
static inline int tile_bytes(int fmt) { return scale_bytes(fmt) + body_bytes(fmt); }
static inline int head_bytes(int fmt) { return kfmt(fmt) ? 32 * (has_min(fmt) ? 2 : 1) : 0; }

/* qcol_bytes (quant_matmul.h), inline for the routes. */
static inline int64_t col_bytes(int fmt, int G) {
    if (fmt < 0 || fmt > QFMT_LAST || fmt == QFMT_MIXED || G <= 0) return 0;
    if (!kfmt(fmt)) return (int64_t)G * tile_bytes(fmt);
    return G % 8 ? 0 : (int64_t)(G / 8) * (head_bytes(fmt) + 8 * tile_bytes(fmt));
}

/* Tile g of a column block, and the head of its super-block (K formats). */
static inline const uint8_t *tile_at(const uint8_t *col, int fmt, int g) {
    if (!kfmt(fmt)) return col + (int64_t)g * tile_bytes(fmt);
    return col + (int64_t)(g / 8) * (head_bytes(fmt) + 8 * tile_bytes(fmt)) + head_bytes(fmt) + g % 8 * tile_bytes(fmt);
}
static inline const uint8_t *head_at(const uint8_t *col, int fmt, int g) {
    return col + (int64_t)(g / 8) * (head_bytes(fmt) + 8 * tile_bytes(fmt));
}

/* The lines of the tile AHEAD bytes past tile asked of the memory now, for the one-row passes
 * (block_dot, block_direct; the first pass of several). Why: a decode matmul reads each weight byte once, and the
 * hardware prefetcher alone kept too few lines in flight: one thread read Q4_0 at ~30 GB/s, and Q4_K, whose
 * 64-byte head every 8 tiles breaks the stride the prefetcher follows, at 0.7x that (Zen 5, 8192 x 2048, one row,
 * CPU time; warm in L3 the two took the same time). Asked 8 KB ahead, a thread's Q4_K call took 0.24 ms instead of
 * 0.40, and on two cores both read at 71-79 GB/s (docs/benchmarks.md, "Stop 53"); 1-4 KB ahead gained less, 16 KB
 * no more. The non-temporal hint: the lines are read once. Past a weight's end the hint reads a few KB it does not
 * use (a prefetch never faults). always_inline: as a call it spilled the caller's accumulators every tile. */
#define AHEAD 8192
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *tile, const int fmt) {
    for (int o = 0; o < tile_bytes(fmt); o += 64) __builtin_prefetch(tile + AHEAD + o, 0, 0);
}

/* Column block cb of a weight, and its format. */
static inline const uint8_t *column(const uint8_t *w, int wfmt, int G, int cb, int *fmt) {
    if (wfmt != QFMT_MIXED) {
        *fmt = wfmt;
        return w + cb * col_bytes(wfmt, G);
    }
    int64_t e;
    memcpy(&e, w + 8 * (int64_t)cb, 8);
    *fmt = (int)(e & 31);
    return w + (e >> 5);
}

typedef struct {
    vf a[NV], b[NV]; /* w = a q + b, per lane (its column) */
} Scales;

/* The scales of half h (rows 8h..8h+7; h = 0 covers all 16 rows for a format of one scale set a tile). */
static inline __attribute__((always_inline)) Scales tile_scales(const uint8_t *col, const uint8_t *tile, int g,
                                                                const int fmt, int h) {
    Scales s;
    vf a[16 / VW], b[16 / VW];
    for (int c = 0; c < 16 / VW; c++) {
        if (kfmt(fmt)) {
            const uint8_t *head = head_at(col, fmt, g);
            a[c] = f16v(head + 2 * VW * c) * tof(s8v(tile + 16 * h + VW * c));
            b[c] = has_min(fmt) ? -(f16v(head + 32 + 2 * VW * c) * tof(u8v(tile + 16 * halves(fmt) + 16 * h + VW * c)))
                                : (vf){0};
        } else if (fmt == QFMT_MX4) {
            a[c] = mx4_scale(tile + VW * c);
            b[c] = (vf){0};
        } else if (!dense16(fmt)) {
            a[c] = f16v(tile + 2 * VW * c);
            b[c] = has_min(fmt) ? f16v(tile + 32 + 2 * VW * c) : (vf){0};
        }
    }
    for (int v = 0; v < NV; v++) {
        s.a[v] = dense16(fmt) ? (vf){0} : spread(a[v * VW / 2 / VW], v);
        s.b[v] = dense16(fmt) ? (vf){0} : spread(b[v * VW / 2 / VW], v);
    }
    return s;
}

/* The bits above the nibbles of vector v's codes in row r, minus the format's offset. 1-bit plane: 16 bytes per
 * row quad (rows 4t + p, p = 0..3); byte j holds the high bit of nibble byte j's low nibble in row 4t + p at bit
 * p, of its high nibble at bit 4 + p: a layout the integer route (qmm_dot.c) widens once for the quad's rows. */
static inline vi high_bits(const uint8_t *body, const int fmt, int r, int v) {
    if (plane(fmt) == 1) {
        const vi bits = u8v(body + 256 + 16 * (r / 4) + VW * (v % (NV / 2)));
        return (((bits >> (r % 4 + 4 * (v >= NV / 2))) & 1) << 4) - offset(fmt);
    }
    return (vi){0} - offset(fmt);
}

/* K6: vector v's codes of row r (offset 32 included): byte j's bits 0-5 (columns 0-7), or its bits 6-7 and the
 * pair plane's nibble of row r as bits 2-5 (columns 8-15). */
static inline vi k6_codes(const uint8_t *body, int r, int v) {
    const uint8_t *row = body + 32 * (r / 2) + 8 * (r % 2);
#if VW == 16
    const vi bytes = u8v_halves(row, row + 16); /* bytes 0-7, then 8-15 */
#else
    const vi bytes = u8v(row + 16 * (v % 2)); /* bytes 8 (v % 2) .. + 7 */
#endif
    if (v < NV / 2) return bytes & 63;
    const uint8_t *pl = body + 256 + 16 * (r / 2) + 8 * (r % 2); /* bytes 0-7: low nibbles, 8-15: high */
#if VW == 16
    vi nib;
    for (int l = 0; l < VW; l++) nib[l] = 4 * (l >= 8);
    const vi top = u8v_halves(pl, pl) >> nib & 15;
#else
    const vi top = u8v(pl) >> (4 * (v % 2)) & 15;
#endif
    return (bytes >> 6) | top << 2;
}

/* Row r of a tile as NV vectors of floats. */
static inline __attribute__((always_inline)) void tile_row(const uint8_t *tile, const int fmt, int r,
                                                           const Scales *s, vf w[NV]) {
    const uint8_t *body = tile + scale_bytes(fmt);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        vf q;
        if (lut(fmt)) { /* words u = VW v.. of row r = 4 t + p: byte p % 2 of each, nibble p / 2 */
            const vi u = u16v(body + 64 * (r / 4) + 2 * VW * v), q4 = (u >> (8 * (r % 2) + 4 * (r % 4 / 2))) & 15;
            w[v] = (fmt == QFMT_MX4 ? mx4v(q4) : iq4v(q4)) * s->a[v];
            continue;
        }
        if (fmt == QFMT_K6) {
            q = tof(k6_codes(body, r, v) - offset(fmt));
        } else if (nibbles(fmt)) {
            const vi bytes = u8v(body + 16 * r + VW * (v % (NV / 2)));
            q = tof(high_bits(body, fmt, r, v) + (v < NV / 2 ? bytes & 15 : bytes >> 4));
        } else if (fmt == QFMT_F16) {
            w[v] = f16v(body + 64 * r + 2 * VW * v);
            continue;
        } else if (fmt == QFMT_BF16) {
            w[v] = (vf)(u16v(body + 64 * r + 2 * VW * v) << 16);
            continue;
        } else {
            q = tof(s8v(body + 32 * r + VW * v));
        }
        w[v] = has_min(fmt) ? q * s->a[v] + s->b[v] : q * s->a[v];
    }
}

/* Group g of a column block as floats: [16 rows][32] (the panel's layout). */
static inline __attribute__((always_inline)) void dequant_group(const uint8_t *col, const int fmt, int g,
                                                                float *dst) {
    const uint8_t *tile = tile_at(col, fmt, g);
    for (int h = 0; h < halves(fmt); h++) {
        const Scales s = tile_scales(col, tile, g, fmt, h);
        for (int r = 16 / halves(fmt) * h; r < 16 / halves(fmt) * (h + 1); r++) {
            vf w[NV];
            tile_row(tile, fmt, r, &s, w);
            for (int v = 0; v < NV; v++) st(dst + 32 * r + VW * v, w[v]);
        }
    }
}

/* X(fmt) for every format with a fixed layout (not QFMT_MIXED): to define one function per format. */
#define FOR_EACH_FORMAT(X)                                                                                     \
    X(QFMT_Q4) X(QFMT_Q40) X(QFMT_Q8) X(QFMT_Q8M) X(QFMT_F16) X(QFMT_BF16) X(QFMT_K4M) X(QFMT_K8M) X(QFMT_K8)  \
    X(QFMT_Q5) X(QFMT_Q5M) X(QFMT_K5M) X(QFMT_MX4) X(QFMT_IQ4NL) X(QFMT_IQ4XS) X(QFMT_K6)

/* Every format's instance of `fn(..., fmt, ...)`: the format is a constant inside, so its branches fold. */
#define EACH_FORMAT(fmt, fn, ...)                                                                              \
    switch (fmt) {                                                                                             \
    case QFMT_Q4: fn(QFMT_Q4, __VA_ARGS__); break;                                                             \
    case QFMT_Q40: fn(QFMT_Q40, __VA_ARGS__); break;                                                           \
    case QFMT_Q8: fn(QFMT_Q8, __VA_ARGS__); break;                                                             \
    case QFMT_Q8M: fn(QFMT_Q8M, __VA_ARGS__); break;                                                           \
    case QFMT_F16: fn(QFMT_F16, __VA_ARGS__); break;                                                           \
    case QFMT_BF16: fn(QFMT_BF16, __VA_ARGS__); break;                                                         \
    case QFMT_K4M: fn(QFMT_K4M, __VA_ARGS__); break;                                                           \
    case QFMT_K8M: fn(QFMT_K8M, __VA_ARGS__); break;                                                           \
    case QFMT_K8: fn(QFMT_K8, __VA_ARGS__); break;                                                             \
    case QFMT_Q5: fn(QFMT_Q5, __VA_ARGS__); break;                                                             \
    case QFMT_Q5M: fn(QFMT_Q5M, __VA_ARGS__); break;                                                           \
    case QFMT_K5M: fn(QFMT_K5M, __VA_ARGS__); break;                                                           \
    case QFMT_MX4: fn(QFMT_MX4, __VA_ARGS__); break;                                                           \
    case QFMT_IQ4NL: fn(QFMT_IQ4NL, __VA_ARGS__); break;                                                       \
    case QFMT_IQ4XS: fn(QFMT_IQ4XS, __VA_ARGS__); break;                                                       \
    default: fn(QFMT_K6, __VA_ARGS__); break;                                                                  \
    }

#define DEQUANT_GROUP(fmt, col, g, dst) dequant_group(col, fmt, g, dst)
#define DEQUANT_PANEL(fmt, col, G, panel)                                                                       \
    for (int g = 0; g < (G); g++) dequant_group(col, fmt, g, (panel) + (int64_t)g * 512)

/* The stored code (its format's offset included; a byte format's signed) of column c at k (0..31) of a tile
 * body, one at a time: the integer routes' portable builds and the int8 route's panels. */
static inline int code_at(const uint8_t *body, int fmt, int c, int k) {
    const int r = k / 2, j = 2 * (c % 8) + k % 2;
    if (lut(fmt)) /* row r = 4 t + p: byte p % 2 of word 2 c + k % 2 in quad t, nibble p / 2 */
        return lut_values(fmt)[body[64 * (r / 4) + 2 * (2 * c + k % 2) + r % 2] >> (4 * (r % 4 / 2)) & 15] + offset(fmt);
    if (!nibbles(fmt)) return (int8_t)body[32 * r + 2 * c + k % 2];
    if (fmt == QFMT_K6) { /* byte j of row r: bits 0-5 column c, or bits 6-7 and the plane's nibble column 8 + c */
        const int b = body[32 * (r / 2) + 8 * (r % 2) + j + 8 * (j >= 8)];
        return c < 8 ? b & 63 : b >> 6 | (body[256 + 16 * (r / 2) + 8 * (r % 2) + j % 8] >> (4 * (j / 8)) & 15) << 2;
    }
    const int nib = c < 8 ? body[16 * r + j] & 15 : body[16 * r + j] >> 4;
    if (!plane(fmt)) return nib;
    return nib | (body[256 + 16 * (r / 4) + j] >> (r % 4 + 4 * (c >= 8)) & 1) << 4;
}
#ifdef SIMD_INT16
/* Whether widen_tile16 takes a format: the dot route's (nibbles with no plane, K6, bytes, the table formats). */
static inline int widens16(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q40 || fmt == QFMT_Q8 || fmt == QFMT_Q8M || fmt == QFMT_K4M || fmt == QFMT_K6
        || lut(fmt);
}
/* A tile body's 512 codes as 16-bit words in the dot route's order, dst [16 rows][32]: word 2c + e of row r is
 * column c at k = 2r + e, the stored code (its format's offset included, code_at's value). Why: a column block
 * run against many rows of x is widened once (qmm_dot.c's panel) instead of once per pass of a few rows; the
 * words are what the route's vpmaddwd / vpdpwssd multiply, so sums over them equal the one-row route's. */
typedef iv ivu __attribute__((aligned(2))); /* an integer vector at any word's address */
typedef hv hvu __attribute__((aligned(2)));
static inline __attribute__((always_inline)) void widen_tile16(const uint8_t *body, const int fmt, int16_t *dst) {
    if (lut(fmt)) {
        for (int t = 0; t < 4; t++) {
            iv quad[4][BV];
            lut_words(body, t, lut_table(fmt), quad);
            for (int p = 0; p < 4; p++)
                for (int v = 0; v < BV; v++) ((ivu *)(dst + 32 * (4 * t + p)))[v] = quad[p][v];
        }
        return;
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        if (!nibbles(fmt)) {
            iv w[BV];
            byte_words(body, r, w);
            for (int v = 0; v < BV; v++) ((ivu *)(dst + 32 * r))[v] = w[v];
            continue;
        }
        hv lo, hi;
        if (fmt == QFMT_K6) { /* word j: code(j / 2) + 64 code(8 + j / 2) in bits 0-11 (simd.h's k6_words) */
            const hv w = k6_words(body, r);
            lo = HAND(w, 63), hi = HAND(HSRL(w, 6), 63);
        } else { /* word j: byte j, column j / 2 (low nibble) and 8 + j / 2 (high) */
            const hv w = nib_words(body, r);
            lo = HAND(w, 15), hi = HSRL(w, 4);
        }
        *(hvu *)(dst + 32 * r) = lo;
        *(hvu *)(dst + 32 * r + 16) = hi;
    }
}
#endif

/* The integer routes' (qmm_dot.c, qmm_i8.c): row m's 16 sums F of column block cb (+ bias) written or added to the output, up to N. Not inlined (the integer routes'
 * blocks write a whole block in vectors; this is the clipped last block and the portable build): its columns'
 * branches unrolled into every instance of block_dot would be most of this file's code. */
static __attribute__((noinline, unused)) void store16(const QMatmul *a, const float *F, int m, int cb) {
    float *o = a->out + (int64_t)m * a->ldo;
    for (int c = 0; c < 16 && 16 * cb + c < a->N; c++) {
        const int n = 16 * cb + c;
        const float x = F[c] + (a->bias ? a->bias[n] : 0.0f);
        o[n] = a->accumulate ? o[n] + x : x;
    }
}

/* Whether a weight of these sizes can be run: a known format, K formats with K % 256 == 0; a mixed weight's
 * table is checked when it is packed (quant.py). */
static inline int bad_sizes(int M, int N, int K, int ldx, int ldo, int fmt) {
    return M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || ldx < K || ldo < N || fmt < 0 ||
           (fmt != QFMT_MIXED && col_bytes(fmt, K / 32) == 0);
}
#endif
