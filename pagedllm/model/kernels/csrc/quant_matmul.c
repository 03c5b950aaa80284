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
 * Layout ("tiles"): columns (output features) in blocks of 16, K in groups of 32. One (column block, group)
 * tile holds the 16 columns' scales, then their 512 weights in 16 rows r = 0..15, row r holding k = 2r and
 * 2r + 1 of every column, i.e. the VNNI order of an AMX bfloat16 B tile. Bodies:
 *   nibbles (Q4, Q40, K4M): 16 bytes a row; byte j: low nibble = column j/2, high nibble = column 8 + j/2, both
 *       at k = 2r + j%2; the 5- and 6-bit formats (Q5, Q5M, K5M, K6) add a plane of the bits above the nibble
 *       after the nibbles: 1 bit (Q5, Q5M, K5M) per row a 32-bit word, bit e for the row's value e in the
 *       order of the nibbles (the 16 low, then the 16 high); 2 bits (K6) per row pair (r even, r + 1) 16
 *       bytes, byte j the high bits of nibble byte j: row r's low nibble in bits 0-1, row r + 1's in 2-3, row
 *       r's high nibble in 4-5, row r + 1's in 6-7; their codes are stored with an offset that makes them
 *       unsigned (Q5: 16, K6: 32, and Q40's 4-bit codes: 8), taken off again in registers;
 *   bytes (Q8, Q8M, K8M, K8): 32 bytes a row; byte e = column e/2 at k = 2r + e%2;
 *   halves (F16, BF16): 32 16-bit values a row in the order of bytes;
 *   MX4 (MXFP4's E2M1 codes, 4 bits): the nibble rows of four rows r = 4t + p interleaved, 64 bytes a row quad t:
 *       byte 2u + p (p = 0, 1) holds row 4t + p in its low nibble and row 4t + p + 2 in its high one, each at
 *       word u of its row (column u/2 at k = 2r + u%2), so that one 512-bit (or two 256-bit) table lookups and
 *       a mask or shift per row give the integer route four rows of 16-bit words with no widening (below).
 * Scales before the body: Q4 / Q8M / Q5M d[16], m[16] float16; Q8 / Q5 / Q40 d[16]; MX4 e[16], the E8M0 bytes
 * as stored (see mx4_scale); F16 / BF16 none. The K formats group 8
 * tiles (K = 256, a GGUF super-block) behind a head of D[16] (and M[16]) float16 per column, and each tile
 * holds its integer scales s (int8) and, with a minimum, mi (uint8): per half tile (16 k) for K8M / K8 / K6
 * ([2][16] each), per tile for K4M / K5M ([16]). A weight is a = D s, b = -M mi, w = a q + b. QFMT_MIXED: a weight
 * whose column blocks differ in format (merged q/k/v of a Q4_K_M file): a table of int64 (byte offset << 4 |
 * format) per column block, then the blocks.
 *
 * One source for every width: `vf` is the widest float vector the build has (VW = 16 lanes with AVX-512, 8
 * with AVX2 and for the portable C path), and the few conversions that GCC would turn into scalar code in
 * their generic form (float16, bytes, nibbles) are the intrinsics of each class, below. A dequantized tile
 * row is NV = 32 / VW vectors; vector v holds columns VW/2 v .. VW/2 (v + 1) - 1, each k pair side by side,
 * and a lane accumulates w * x over the even or the odd k of its column (the two lanes are added at the end).
 * Two routes: a few rows dequantize each tile row in registers once for all of them ("direct"); many rows
 * dequantize a column block once into a float32 panel that stays in the cache and run a register-blocked
 * micro-kernel over it ("panel": prefill as a blocked GEMM, without a second copy of the weights). Within one
 * build, every output element is summed in the same order whichever route serves it, so a sequence's result
 * does not depend on what else is in the batch. Compiled without -ffast-math so that nothing reassociates.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_matmul.h"
#include "vec.h"
#if defined(__AVX512F__) || defined(__AVX2__)
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
#if defined(__AVX512BW__)
#define DOT_ISA "avx512"
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define DOT_ISA "avx2"
#else
#define DOT_ISA "portable"
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return "matmul=" MATMUL_ISA " dot=" DOT_ISA " amx=yes";
#else
    return "matmul=" MATMUL_ISA " dot=" DOT_ISA " amx=no";
#endif
}

/* ---- the vector type's (vec.h) conversions, per class --------------------------------------------------- */
#define NV (32 / VW)         /* vectors per dequantized tile row */
#define P (VW == 16 ? 2 : 1) /* accumulators per vector and row: one per tile-row parity on AVX-512 */
#define MR (VW == 16 ? 6 : 2) /* rows per direct block: MR * NV * P accumulators (24 of 32, 8 of 16 registers) */
#define PR 6                  /* rows per panel block, over VW columns: PR * 2 * P accumulators */

static inline vf ldu(const float *p) { return *(const vfu *)p; }
static inline void stu(float *p, vf v) { *(vfu *)p = v; }
static inline vf tof(vi x) { return __builtin_convertvector(x, vf); }
/* A load kept in a register: for a block of few rows GCC would fold the load into every FMA that uses it, and
 * reloading the same panel vector once per row makes the micro-kernel wait on loads instead of FMAs. */
static inline vf ldr(const float *p) {
    vf v = ldu(p);
#if defined(__AVX512F__) || defined(__AVX2__)
    __asm__("" : "+v"(v));
#endif
    return v;
}

#if defined(__AVX512F__)
static inline vf pairx(const float *x) { return (vf)_mm512_castpd_ps(_mm512_set1_pd(*(const double *)x)); }
static inline vf f16v(const uint8_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi u8v(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi s8v(const uint8_t *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi u16v(const uint8_t *p) { return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__) && defined(__F16C__)
static inline vf pairx(const float *x) { return (vf)_mm256_castpd_ps(_mm256_broadcast_sd((const double *)x)); }
static inline vf f16v(const uint8_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vi u8v(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi s8v(const uint8_t *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi u16v(const uint8_t *p) { return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vf pairx(const float *x) {
    vf r;
    for (int i = 0; i < VW; i++) r[i] = x[i % 2];
    return r;
}
static inline vf f16v(const uint8_t *p) {
    vf r;
    for (int i = 0; i < VW; i++) {
        _Float16 h;
        memcpy(&h, p + 2 * i, 2);
        r[i] = (float)h;
    }
    return r;
}
static inline vi u8v(const uint8_t *p) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = p[i];
    return r;
}
static inline vi s8v(const uint8_t *p) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = (int8_t)p[i];
    return r;
}
static inline vi u16v(const uint8_t *p) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = p[2 * i] | p[2 * i + 1] << 8;
    return r;
}
#endif

/* MXFP4 (GGML type 39): the E2M1 value of each 4-bit code, doubled (llama.cpp's kvalues_mxfp4, gguf-py's
 * MXFP4.kvalues); a weight is kvalues[q] times its group's scale 2^(e - 128), the E8M0 byte e halved. */
static const int8_t MX4_VALUES[16] __attribute__((unused)) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Codes 0..15 (one a lane) as their float values: a table lookup in registers (vpermps). */
#if defined(__AVX512F__)
static inline vf mx4v(vi q) {
    const __m512 t = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return (vf)_mm512_permutexvar_ps((__m512i)q, t);
}
#elif defined(__AVX2__) && defined(__F16C__)
static inline vf mx4v(vi q) { /* 8 lanes: each half of the table, picked by the code's bit 3 (+0, never -0) */
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12), (__m256i)q);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_setr_ps(0, -1, -2, -3, -4, -6, -8, -12), (__m256i)q);
    return (vf)_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32((__m256i)q, 28)));
}
#else
static inline vf mx4v(vi q) {
    vf r;
    for (int i = 0; i < VW; i++) r[i] = MX4_VALUES[q[i] & 15];
    return r;
}
#endif

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
static inline int kfmt(int fmt) { return (fmt >= QFMT_K4M && fmt <= QFMT_K8) || fmt == QFMT_K5M || fmt == QFMT_K6; }
static inline int has_min(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q8M || fmt == QFMT_K4M || fmt == QFMT_K8M || fmt == QFMT_Q5M || fmt == QFMT_K5M;
}
static inline int plane(int fmt) { /* high bits a code above its nibble: 1 (5-bit formats), 2 (6-bit), 0 */
    return fmt == QFMT_K6 ? 2 : fmt == QFMT_Q5 || fmt == QFMT_Q5M || fmt == QFMT_K5M ? 1 : 0;
}
static inline int nibbles(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q40 || fmt == QFMT_K4M || fmt == QFMT_MX4 || plane(fmt);
}
static inline int offset(int fmt) { /* stored q + offset (MX4: the integer route's table values, kvalues + 12) */
    return fmt == QFMT_Q5 ? 16 : fmt == QFMT_K6 ? 32 : fmt == QFMT_Q40 ? 8 : fmt == QFMT_MX4 ? 12 : 0;
}
static inline int halves(int fmt) { return fmt == QFMT_K8M || fmt == QFMT_K8 || fmt == QFMT_K6 ? 2 : 1; }
static inline int dense16(int fmt) { return fmt == QFMT_F16 || fmt == QFMT_BF16; }

/* Bytes before a tile's body (its scales), of a body, of a K format's super-block head. */
static inline int scale_bytes(int fmt) {
    if (kfmt(fmt)) return halves(fmt) * 16 * (has_min(fmt) ? 2 : 1);
    return dense16(fmt) ? 0 : fmt == QFMT_MX4 ? 16 : 32 * (has_min(fmt) ? 2 : 1);
}
static inline int body_bytes(int fmt) { return nibbles(fmt) ? 256 + 64 * plane(fmt) : dense16(fmt) ? 1024 : 512; }
static inline int tile_bytes(int fmt) { return scale_bytes(fmt) + body_bytes(fmt); }
static inline int head_bytes(int fmt) { return kfmt(fmt) ? 32 * (has_min(fmt) ? 2 : 1) : 0; }

int64_t qcol_bytes(int fmt, int G) {
    if (fmt < 0 || fmt > QFMT_MX4 || G <= 0) return 0;
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

/* Column block cb of a weight, and its format. */
static inline const uint8_t *column(const uint8_t *w, int wfmt, int G, int cb, int *fmt) {
    if (wfmt != QFMT_MIXED) {
        *fmt = wfmt;
        return w + cb * qcol_bytes(wfmt, G);
    }
    int64_t e;
    memcpy(&e, w + 8 * (int64_t)cb, 8);
    *fmt = (int)(e & 15);
    return w + (e >> 4);
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

/* The bits above the nibbles of vector v's codes in row r, minus the format's offset. 1-bit plane: row r's
 * 32-bit word holds bit e for the row's value e = VW v + lane. 2-bit plane (K6): 16 bytes per row pair (r even,
 * r + 1); byte j holds the high bits of nibble byte j's low nibble in row r in bits 0-1, in row r + 1 in bits
 * 2-3, and of the same bytes' high nibbles in bits 4-5 and 6-7: a layout the integer route (below) widens once
 * for both rows of a pair, row r + 1's bits two places above row r's. */
static inline vi high_bits(const uint8_t *body, const int fmt, int r, int v) {
    vi iota;
    for (int l = 0; l < VW; l++) iota[l] = l;
    if (plane(fmt) == 1) {
        uint32_t word;
        memcpy(&word, body + 256 + 4 * r, 4);
        return ((((vi){0} + (int32_t)(word >> (VW * v))) >> iota & 1) << 4) - offset(fmt);
    }
    if (plane(fmt) == 2) {
        const vi bits = u8v(body + 256 + 16 * (r / 2) + VW * (v % (NV / 2)));
        return (((bits >> (2 * (r % 2) + 4 * (v >= NV / 2))) & 3) << 4) - offset(fmt);
    }
    return (vi){0} - offset(fmt);
}

/* Row r of a tile as NV vectors of floats. */
static inline __attribute__((always_inline)) void tile_row(const uint8_t *tile, const int fmt, int r,
                                                           const Scales *s, vf w[NV]) {
    const uint8_t *body = tile + scale_bytes(fmt);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        vf q;
        if (fmt == QFMT_MX4) { /* words u = VW v.. of row r = 4 t + p: byte p % 2 of each, nibble p / 2 */
            const vi u = u16v(body + 64 * (r / 4) + 2 * VW * v);
            w[v] = mx4v((u >> (8 * (r % 2) + 4 * (r % 4 / 2))) & 15) * s->a[v];
            continue;
        }
        if (nibbles(fmt)) {
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

/* Sum the parities of each lane and each lane pair, and write the (valid) columns of one output row. */
static inline void store_row(const QMatmul *a, const vf *acc, int m, int col0, const int nv) {
    float *o = a->out + (int64_t)m * a->ldo;
    vi swap;
    for (int l = 0; l < VW; l++) swap[l] = l ^ 1;
    for (int v = 0; v < nv; v++) {
        vf t = acc[v];
        if (P == 2) t += acc[nv + v];
        t += __builtin_shuffle(t, swap);
        float tmp[VW];
        memcpy(tmp, &t, sizeof tmp);
        for (int c = 0; c < VW / 2; c++) {
            const int n = col0 + VW / 2 * v + c;
            if (n >= a->N) return;
            const float x = tmp[2 * c] + (a->bias ? a->bias[n] : 0.0f);
            o[n] = a->accumulate ? o[n] + x : x;
        }
    }
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

/* Group g of a column block as floats: [16 rows][32] (the panel's layout). */
static inline __attribute__((always_inline)) void dequant_group(const uint8_t *col, const int fmt, int g,
                                                                float *dst) {
    const uint8_t *tile = tile_at(col, fmt, g);
    for (int h = 0; h < halves(fmt); h++) {
        const Scales s = tile_scales(col, tile, g, fmt, h);
        for (int r = 16 / halves(fmt) * h; r < 16 / halves(fmt) * (h + 1); r++) {
            vf w[NV];
            tile_row(tile, fmt, r, &s, w);
            for (int v = 0; v < NV; v++) stu(dst + 32 * r + VW * v, w[v]);
        }
    }
}

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
    default: fn(QFMT_K6, __VA_ARGS__); break;                                                                  \
    }

#define DEQUANT_GROUP(fmt, col, g, dst) dequant_group(col, fmt, g, dst)
#define DEQUANT_PANEL(fmt, col, G, panel)                                                                       \
    for (int g = 0; g < (G); g++) dequant_group(col, fmt, g, (panel) + (int64_t)g * 512)

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

/* One column block for all M rows: direct for a few rows, through a dequantized panel for many. */
void qmm_column_block(const QMatmul *a, int cb, float *panel) {
    int fmt;
    const uint8_t *col = column(a->w, a->fmt, a->G, cb, &fmt);
    if (a->M <= MR || panel == NULL) {
        EACH_FORMAT(fmt, DIRECT_ROWS, a, col, cb)
        return;
    }
    EACH_FORMAT(fmt, DEQUANT_PANEL, col, a->G, panel)
    panel_rows(a, panel, cb);
}

/* Whether a weight of these sizes can be run: a known format, K formats with K % 256 == 0; a mixed weight's
 * table is checked when it is packed (quant.py). */
static int bad_sizes(int M, int N, int K, int ldx, int ldo, int fmt) {
    return M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || ldx < K || ldo < N || fmt < 0 ||
           (fmt != QFMT_MIXED && qcol_bytes(fmt, K / 32) == 0);
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

/* ---- 16-bit integer activations (the "dot" route) ---------------------------------------------------------
 * Why: a one-row decode matmul should run at the memory's speed, but dequantizing each weight to float32
 * costs ~5 vector instructions per 16 weights (widen, mask, convert, scale, multiply-add), which on 2 cores
 * is below the bandwidth (the developers' finding: compute-bound). llama.cpp's route instead rounds the
 * activations to integers per block of 32 and multiplies the weights' integer codes by them directly
 * (pmaddwd / VNNI's vpdpwssd: 32 products a 512-bit instruction, no conversion of the weights), applying each
 * group's scales once per 32 inputs. Here the activations are rounded to 16 bits (d = max |x| / 32767 per
 * group of 32), not llama.cpp's 8: each x is within d / 2 of its value (a relative error of ~1.5e-5 of the
 * group's largest), so the route is exact in the weights and nearly so in the activations; the float32
 * route stays the exact one (`--quantized-activations none`, loader.py). Formats: Q4 / Q40 (Q4_1, int4 / Q4_0), Q8 / Q8M
 * (Q8_0, int8), K4M (Q4_K), K6 (Q6_K) and MX4 (MXFP4, its codes looked up in a table of int8); a column block of any other format (or of a mixed weight) runs on
 * the float32 direct route with the same call.
 *
 * Per group g of a column block, the integer sums S_c = sum_k q_ck xq_k of each column c (over half tiles
 * for the formats with a scale per 16 inputs) are exact in int32; out_c += (a_c dx_g) S_c + (b_c dx_g) sx_g,
 * with a, b the weight's scale and offset for the group (w = a q + b) and sx the sum of the group's xq: the
 * same value as sum_k w_ck (xq_k dx_g) up to float32 rounding. Nibble rows widen to one 16-bit word per byte:
 * the low nibbles are columns 0-7 (a k pair each), the high nibbles 8-15; x is a k pair per 32-bit lane.
 * Rows of x are independent: a row's result does not depend on the batch. */
static inline int dot_fmt(int fmt) {
    return fmt == QFMT_Q4 || fmt == QFMT_Q40 || fmt == QFMT_Q8 || fmt == QFMT_Q8M || fmt == QFMT_K4M || fmt == QFMT_K6
        || fmt == QFMT_MX4;
}

/* One group of 32 inputs rounded with the factor inv: codes, and the sums of each half. In vectors where the build
 * has them (a scalar loop costs ~3.5 ns an input: at 64 rows that was a sixth of the 135M model's decode step),
 * with the scalar loop's exact results: round half to even, NaN to 0, clamped to +-32767. */
static inline void round_group(int16_t *q, int32_t *s, const float *x, float inv) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(inv), lim = _mm512_set1_ps(32767.0f);
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), f),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
        const __m512i c = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, lim), -lim));
        _mm256_storeu_si256((__m256i *)(q + 16 * h), _mm512_cvtepi32_epi16(c));
        s[h] = _mm512_reduce_add_epi32(c);
    }
#elif defined(__AVX2__)
    const __m256 f = _mm256_set1_ps(inv), lim = _mm256_set1_ps(32767.0f), nlim = _mm256_set1_ps(-32767.0f);
    for (int h = 0; h < 2; h++) {
        __m256i c[2];
        for (int j = 0; j < 2; j++) {
            __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * h + 8 * j), f),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
            c[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, lim), nlim));
        }
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + 16 * h), w);
        __m256i t = _mm256_add_epi32(c[0], c[1]);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        s[h] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
    }
#else
    s[0] = s[1] = 0;
    for (int k = 0; k < 32; k++) {
        float v = nearbyintf(x[k] * inv);
        v = v == v ? (v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v) : 0.0f;
        q[k] = (int16_t)v;
        s[k / 16] += (int16_t)v;
    }
#endif
}

/* The largest |x| of a group of 32, NaN left out. */
static inline float group_amax(const float *x) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    /* max_ps returns its second operand where either is NaN: the running max, never the NaN */
    return _mm512_reduce_max_ps(_mm512_max_ps(a, _mm512_max_ps(b, _mm512_setzero_ps())));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.0f;
    for (int k = 0; k < 32; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    return amax;
#endif
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

/* Nibble rows go through 256-bit vectors on every class: one row of 16 bytes widens to 16 words (columns 0-7 in
 * the low nibbles, 8-15 in the high ones, a k pair per 32-bit lane) against the row's k pair broadcast from
 * memory. A 512-bit form needs a permute of x per row pair, and on Zen 4 those shuffles were the bottleneck. */
#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__))
typedef __m256i hv;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline hv hdot(hv acc, hv w, hv x) { return _mm256_dpwssd_epi32(acc, w, x); }
#elif defined(__AVXVNNI__)
static inline hv hdot(hv acc, hv w, hv x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
#else
static inline hv hdot(hv acc, hv w, hv x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
#endif
static inline hv nib_words(const uint8_t *body, int r) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(body + 16 * r)));
}
/* The K6 plane of row pair r / 2 as 16 words, word j holding nibble byte j's high bits: row r's in bits 0-1
 * (low nibble) and 4-5 (high), row r + 1's in bits 2-3 and 6-7. One load and widen serves both rows. */
static inline hv plane_words(const uint8_t *body, int r) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(body + 256 + 16 * (r / 2))));
}
#define HAND(a, b) _mm256_and_si256(a, _mm256_set1_epi16(b))
#if defined(__AVX512VL__) /* bits of a where mask m is set, else of b */
#define HSEL(m, a, b) _mm256_ternarylogic_epi32(_mm256_set1_epi16((short)(m)), a, b, 0xCA)
#else
#define HSEL(m, a, b) _mm256_or_si256(HAND(a, m), _mm256_andnot_si256(_mm256_set1_epi16((short)(m)), b))
#endif
#define HSRL _mm256_srli_epi16
#define HSLL _mm256_slli_epi16
#define HZERO _mm256_setzero_si256
#define HSET1 _mm256_set1_epi32
#endif

#if defined(__AVX512BW__)
typedef __m512i iv;
#define QR 4 /* rows of x per pass over a column block */
static inline iv dot16(iv acc, iv w, iv x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
/* A byte row's 16 columns (k pairs) as words: one vector. */
static inline void byte_words(const uint8_t *body, int r, iv w[1]) {
    w[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(body + 32 * r)));
}
#define BV 1 /* vectors per byte row */
/* Row quad t of an MX4 body as words, w[p] row 4 t + p: one lookup of the codes in a table of kvalues + 12
 * (0..24, so that a word needs no sign; vpshufb, 16 entries a 128-bit lane, or with VBMI vpermb over 4 copies
 * of them, which reads 6 bits of an index and so needs no nibble masks: 7 operations a quad instead of 9, 6%
 * faster at one row on Zen 4), then a byte of each word taken by a mask or a shift (the interleaved layout puts
 * rows 4t + p, p = 0..3, in the four byte and nibble positions). The + 12 comes off through the group's sum of
 * x, as a format's offset does. */
static inline void mx4_words(const uint8_t *body, int t, iv w[4][1]) {
    const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i b = _mm512_loadu_si512(body + 64 * t), low = _mm512_set1_epi16(255);
#if defined(__AVX512VBMI__)
    const __m512i lo = _mm512_permutexvar_epi8(b, tab);
    const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), tab);
#else
    const __m512i m = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(b, m));
    const __m512i hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(b, 4), m));
#endif
    w[0][0] = _mm512_and_si512(lo, low), w[1][0] = _mm512_srli_epi16(lo, 8);
    w[2][0] = _mm512_and_si512(hi, low), w[3][0] = _mm512_srli_epi16(hi, 8);
}
/* The 16 columns' sums from the nibble accumulators (low: columns 0-7, high: 8-15). */
static inline void nib_cols(hv lo, hv hi, vi out[1]) {
    out[0] = (vi)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#define IZERO _mm512_setzero_si512
#define IADD _mm512_add_epi32
#define ISET1 _mm512_set1_epi32
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
typedef __m256i iv;
#define QR 2
static inline iv dot16(iv acc, iv w, iv x) { return hdot(acc, w, x); }
static inline void byte_words(const uint8_t *body, int r, iv w[2]) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(body + 32 * r)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(body + 32 * r + 16)));
}
#define BV 2
static inline void mx4_words(const uint8_t *body, int t, iv w[4][2]) { /* as the AVX-512 one, in two halves */
    const __m256i tab = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15,
                                         16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i m = _mm256_set1_epi8(15), low = _mm256_set1_epi16(255);
    for (int v = 0; v < 2; v++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(body + 64 * t + 32 * v));
        const __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(b, m));
        const __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(b, 4), m));
        w[0][v] = _mm256_and_si256(lo, low), w[1][v] = _mm256_srli_epi16(lo, 8);
        w[2][v] = _mm256_and_si256(hi, low), w[3][v] = _mm256_srli_epi16(hi, 8);
    }
}
static inline void nib_cols(hv lo, hv hi, vi out[2]) {
    out[0] = (vi)lo;
    out[1] = (vi)hi;
}
#define IZERO _mm256_setzero_si256
#define IADD _mm256_add_epi32
#define ISET1 _mm256_set1_epi32
#else
#define QR 1
#endif
#if defined(__AVX512BW__) /* independent accumulators of one row's sums, over the rows of x of a pass */
#define PH 4
#else
#define PH 2 /* 16 registers */
#endif

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

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__))
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
        if (kfmt(fmt) && g % 8 == 0) head_scales(col, fmt, g, &hd);
        const int32_t *pairs[QR];
        for (int i = 0; i < nr; i++) pairs[i] = (const int32_t *)(xq->q + (int64_t)(m0 + i) * a->G * 32 + 32 * g);
#pragma GCC unroll 2
        for (int h = 0; h < parts; h++) {
            vi S[QR][16 / VW];
            if (nibbles(fmt) && fmt != QFMT_MX4) {
                hv lo[QR][PH], hi[QR][PH];
                for (int i = 0; i < nr; i++)
                    for (int p = 0; p < ph; p++) lo[i][p] = hi[i][p] = HZERO();
#pragma GCC unroll 16
                for (int rr = 0; rr < 16 / parts; rr++) { /* bounds known to the compiler: unrolled whole */
                    const int r = 16 / parts * h + rr;
                    /* 4-bit codes: the byte itself (low + 16 high) against x, and 16 times the high nibble
                     * (the byte masked, no shift): the low nibbles' sum is their difference (below). K6: the
                     * same with the 6-bit codes, lo + 16 hi (the byte plus its high bits put at 4-5 and 8-9)
                     * and 16 hi (the byte's high nibble and the high bits at 8-9) */
                    const hv w = nib_words(body, r);
                    hv wl = w, wh = HAND(w, 0xF0);
                    if (plane(fmt) == 2) {
                        const hv pw = plane_words(body, r), q = rr % 2 ? HSLL(HSRL(pw, 2), 4) : HSLL(pw, 4);
                        wl = _mm256_add_epi16(w, HAND(q, 0x330));
                        wh = HSEL(0xFCF0, w, q); /* q is 0 at bits 0-3, w at 10-15 */
                    }
                    for (int i = 0; i < nr; i++) {
                        const hv xp = HSET1(pairs[i][r]);
                        lo[i][rr % ph] = hdot(lo[i][rr % ph], wl, xp);
                        hi[i][rr % ph] = hdot(hi[i][rr % ph], wh, xp);
                    }
                }
                for (int i = 0; i < nr; i++) {
                    for (int p = 1; p < ph; p++) {
                        lo[i][0] = _mm256_add_epi32(lo[i][0], lo[i][p]);
                        hi[i][0] = _mm256_add_epi32(hi[i][0], hi[i][p]);
                    }
                    nib_cols(_mm256_sub_epi32(lo[i][0], hi[i][0]), _mm256_srai_epi32(hi[i][0], 4), S[i]);
                }
            } else {
                iv acc[QR][PH][BV];
                for (int i = 0; i < nr; i++)
                    for (int p = 0; p < ph; p++)
                        for (int v = 0; v < BV; v++) acc[i][p][v] = IZERO();
                iv quad[4][BV]; /* MX4: four rows' words from one lookup */
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) {
                    iv w[BV];
                    if (fmt == QFMT_MX4 && r % 4 == 0) mx4_words(body, r / 4, quad);
                    if (fmt == QFMT_MX4)
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
            for (int i = 0; i < nr; i++) {
                const int64_t m = m0 + i;
                const int32_t *s = xq->s + m * 2 * G + 2 * g;
                const int32_t sx = parts == 2 ? s[h] : s[0] + s[1];
                const float dx = xq->d[m * G + g];
                for (int c = 0; c < 16 / VW; c++)
                    F[i][c] += tof(S[i][c] - offset(fmt) * sx) * (wa[c] * dx) + wb[c] * (dx * (float)sx);
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        float *o = a->out + (int64_t)(m0 + i) * a->ldo;
        float tmp[16];
        memcpy(tmp, F[i], sizeof tmp);
        for (int c = 0; c < 16 && 16 * cb + c < a->N; c++) {
            const int n = 16 * cb + c;
            const float x = tmp[c] + (a->bias ? a->bias[n] : 0.0f);
            o[n] = a->accumulate ? o[n] + x : x;
        }
    }
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
    default: fn(QFMT_K6, __VA_ARGS__); break;                                                                  \
    }
#else
/* The portable build: the same sums, one code at a time. */
static int code_at(const uint8_t *body, int fmt, int c, int k) {
    const int r = k / 2, j = 2 * (c % 8) + k % 2;
    if (fmt == QFMT_MX4) /* row r = 4 t + p: byte p % 2 of word 2 c + k % 2 in quad t, nibble p / 2 */
        return MX4_VALUES[body[64 * (r / 4) + 2 * (2 * c + k % 2) + r % 2] >> (4 * (r % 4 / 2)) & 15] + offset(fmt);
    if (!nibbles(fmt)) return (int8_t)body[32 * r + 2 * c + k % 2];
    const int nib = c < 8 ? body[16 * r + j] & 15 : body[16 * r + j] >> 4;
    if (plane(fmt) != 2) return nib;
    const int pb = body[256 + 16 * (r / 2) + j] >> (2 * (r % 2) + 4 * (c >= 8));
    return nib | (pb & 3) << 4;
}
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
    float *o = a->out + (int64_t)m * a->ldo;
    for (int c = 0; c < 16 && 16 * cb + c < a->N; c++) {
        const int n = 16 * cb + c;
        const float x = F[c] + (a->bias ? a->bias[n] : 0.0f);
        o[n] = a->accumulate ? o[n] + x : x;
    }
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
#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__))
    EACH_DOT_FORMAT(fmt, DOT_ROWS, a, xq, col, cb)
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


/* ---- bfloat16 x quantized weights: AMX (Sapphire Rapids and later), else AVX-512 BF16 dot products --------
 * For steps of many rows the matmul is bound by arithmetic, not by the weights' bytes. AMX multiplies 16 x 32
 * bfloat16 tiles at many times the AVX-512 float32 rate; without AMX, AVX-512 BF16's vdpbf16ps (Zen 4 and
 * later, Cooper Lake) still does two multiply-adds a lane per instruction, twice the float32 FMA. A tile of our
 * layout is exactly an AMX B tile once each row is converted to bfloat16, and each of its rows is one vdpbf16ps
 * operand (lane c: column c's k pair), so a column block is dequantized once into [G][16][32] bfloat16 and
 * multiplied with every row of x. The weights round to bfloat16 here, as they do in a dense bfloat16 model;
 * this route serves only --dtype bfloat16, from the row count that kernel_choice.py measures it faster. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
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

/* nr (<= 8) rows m0.. of one 16-row tile of x against column blocks cb0 (and cb0 + 1 with `two`), from their
 * bfloat16 panels `bb`: a lane sums its column's k pairs in k order, whatever the block (batch invariance). The
 * rows of x lie 64 bytes apart in their tile, so one base register serves all of them. */
static inline __attribute__((always_inline)) void dot_block(const QMatmulBf16 *a, const uint16_t *bb, int m0,
                                                            const int nr, int cb0, const int two) {
    const int G = a->G;
    const uint32_t *xr = (const uint32_t *)(a->xb + (int64_t)(m0 / 16) * G * 512 + (m0 % 16) * 32);
    __m512 acc[2][8];
#pragma GCC unroll 8
    for (int i = 0; i < nr; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++, xr += 256)
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
        store_cols(a, m0 + i, cb0, acc[0][i]);
        if (two) store_cols(a, m0 + i, cb0 + 1, acc[1][i]);
    }
}

#define DOT_BLOCK(n)                                                                                            \
    case n: two ? dot_block(a, bbuf, m0, n, cb0, 1) : dot_block(a, bbuf, m0, n, cb0, 0); break;

/* Column blocks 2p and 2p + 1 for all rows with vdpbf16ps: each 16-row tile of x in two blocks of <= 8 rows. */
static void dot_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf) {
    const int NB = (a->N + 15) / 16, cb0 = 2 * p, two = cb0 + 1 < NB;
    dequant_bf16(a->w, a->fmt, a->G, cb0, bbuf);
    if (two) dequant_bf16(a->w, a->fmt, a->G, cb0 + 1, bbuf + (int64_t)a->G * 512);
    for (int t0 = 0; t0 < a->M; t0 += 16) {
        const int rows = a->M - t0 < 16 ? a->M - t0 : 16, blocks = (rows + 7) / 8;
        for (int b = 0, m0 = t0; b < blocks; b++) {
            const int nr = rows / blocks + (b < rows % blocks);
            switch (nr) {
                DOT_BLOCK(1) DOT_BLOCK(2) DOT_BLOCK(3) DOT_BLOCK(4) DOT_BLOCK(5) DOT_BLOCK(6) DOT_BLOCK(7)
            default: two ? dot_block(a, bbuf, m0, 8, cb0, 1) : dot_block(a, bbuf, m0, 8, cb0, 0); break;
            }
            m0 += nr;
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

#if !defined(__AVX512BF16__)
void qmm_amx_convert_row(uint16_t *xb, const float *x, int m, int G) { (void)xb, (void)x, (void)m, (void)G; }
#endif

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
#pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++)
            if (bbuf) qmm_amx_pair(&a, p, bbuf);
        qmm_amx_end();
        free(bbuf);
    }
    free(xb);
    return status;
}
