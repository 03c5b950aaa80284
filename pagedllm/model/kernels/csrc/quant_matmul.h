/* The quantized matmul's entry points, one C file per route: float32 direct and panel (qmm_f32.c), 16-bit
 * integer activations (qmm_dot.c), 8-bit ones (qmm_i8.c), bfloat16 on AVX-512 BF16 / AMX (qmm_bf16.c); the tiles
 * they read are in qtile.h. Shared with the fused decode step (model_step.c) and the experts (moe.c).
 * cpu_kernel.py declares every prototype of this file (and of the other headers) to ctypes as written here:
 * arguments are pointers, int, int64_t, float or double. */
#ifndef PAGEDLLM_QUANT_MATMUL_H
#define PAGEDLLM_QUANT_MATMUL_H
#include <stdint.h>

/* Weight formats (quant.py's FORMATS; the tile layouts are in qtile.h's header comment). */
#define QFMT_Q4 0    /* 4-bit, w = d * q + m per group of 32 (Q4_0, Q4_1, int4) */
#define QFMT_Q8 1    /* 8-bit, w = d * q, q signed (Q8_0, int8) */
#define QFMT_Q8M 2   /* 8-bit, w = d * q + m */
#define QFMT_F16 3   /* float16 values */
#define QFMT_BF16 4  /* bfloat16 values */
#define QFMT_K4M 5   /* super-blocks of 256: w = D * s * q - M * mi, s / mi per 32, q 4-bit (Q4_K) */
#define QFMT_K8M 6   /* the same with 8-bit q and s / mi per 16 (Q2_K) */
#define QFMT_K8 7    /* w = D * s * q, s per 16, q signed 8-bit (Q3_K) */
#define QFMT_Q5 8    /* 5-bit, w = d * (q - 16) (Q5_0) */
#define QFMT_Q5M 9   /* 5-bit, w = d * q + m (Q5_1) */
#define QFMT_K5M 10  /* as K4M with 5-bit q (Q5_K) */
#define QFMT_K6 11   /* as K8 with 6-bit q - 32 (Q6_K) */
#define QFMT_Q40 12  /* 4-bit, w = d * (q - 8) per group of 32 (Q4_0 at its file's 4.5 bits a weight) */
#define QFMT_MX4 13  /* 4-bit E2M1 codes, w = kvalues_mxfp4[q] 2^(e - 128), an E8M0 byte e per group (MXFP4) */
#define QFMT_IQ4NL 14 /* 4-bit codes, w = d * iq4_values[q], float16 d per group (IQ4_NL at its file's 4.5 bits) */
#define QFMT_MIXED 15 /* column blocks of different formats: a table of (offset << 5 | format) per block first */
#define QFMT_IQ4XS 16 /* super-blocks of 256: w = D * s * iq4_values[q], s per 32 (IQ4_XS, 4.31 bits: 1.015x) */
#define QFMT_LAST 16  /* the largest format number */

typedef struct {
    float *out;
    const float *x;
    const uint8_t *w;
    const float *bias;
    int M, N, G, ldx, ldo, fmt, accumulate;
} QMatmul;

typedef struct { /* the same product with x as bfloat16 A tiles (see qmm_amx_convert_row) */
    float *out;
    const uint16_t *xb;
    const uint8_t *w;
    const float *bias;
    int M, N, G, ldo, fmt, accumulate;
} QMatmulBf16;

typedef struct { /* rows of x rounded to 16-bit integers per group of 32 (the dot route) */
    int16_t *q; /* [M][K] the rounded activations */
    float *d;   /* [M][G] their scale per group */
    int32_t *s; /* [M][2 G] the sum of q per 16 inputs */
} XQ16;

typedef struct { /* rows of x rounded to 8-bit integers per group of 32 (the int8 route) */
    int8_t *q;  /* [M][passes K] the rounded activations (two passes: a group's 32 codes, then its residual's) */
    float *d;   /* [M][G] their scale per group (of the combined code 254 q1 + q2 with two passes) */
    int32_t *s; /* [M][2 G] the sum of the (combined) codes per 16 inputs */
    int passes; /* 1: x ~ d q, llama.cpp's Q8_0; 2: x ~ d (254 q1 + q2), the error of 16-bit codes */
} XQ8;

/* Bytes of one column block (16 output features) of a weight with K = 32 G inputs; 0 for a format without a
 * fixed size (mixed) or a G it cannot take (the K formats need G % 8 == 0). */
int64_t qcol_bytes(int fmt, int G);
/* AMX: 1 where this CPU and kernel allow it; begin/end configure and release the tiles of the calling thread
 * (nothing without AMX). The bfloat16 route: 2 on AMX, 1 on AVX-512 BF16 dot products, 0 none; qmm_amx_pair
 * runs whichever there is. */
int qmm_amx_available(void);
int qmm_bf16_kind(void);
void qmm_amx_begin(void);
void qmm_amx_end(void);
void qmm_amx_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf);
/* The same on AVX-512 BF16 dot products only (no tile configuration needed); nothing where qmm_bf16_kind is 0. */
void qmm_bf16_dot_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf);
/* Rows per block of a bfloat16 product of M rows of K inputs, so that a block of x stays in the cache while the
 * column pairs read it (qmm_bf16.c says why). */
int qmm_bf16_row_block(int M, int K);
/* Column block pairs [u0, u1) of product `a` for all its rows, in those blocks of rows: on qmm_amx_pair, or on
 * qmm_bf16_dot_pair with `dot_only` (threads that have not configured AMX tiles). */
void qmm_bf16_pairs(const QMatmulBf16 *a, int u0, int u1, uint16_t *bbuf, int dot_only);
/* Row m of x into xb, laid out as AMX A tiles ([m / 16][K / 32][16][32] bfloat16; whole tiles, zero-padded). */
void qmm_amx_convert_row(uint16_t *xb, const float *x, int m, int G);
/* One block of 16 output columns for all M rows; `panel` (K * 16 floats, or NULL) serves many rows. */
void qmm_column_block(const QMatmul *a, int cb, float *panel);
/* The dot route: row x [K] into q [K], d [K / 32], s [K / 16]; one column block for all M rows of such x (a
 * block of a format the route does not run takes the float32 route, through `panel` when not NULL). */
void qdot_quantize_row(int16_t *q, float *d, int32_t *s, const float *x, int K);
void qdot_column_block(const QMatmul *a, const XQ16 *xq, int cb, float *panel);
/* The int8 route: the same with 8-bit x (q [K] int8); `panel` (K * 16 floats) is needed for any M. */
int qi8_runs(int fmt); /* 1: the route runs this format (a mixed weight: its blocks of those formats) */
void qi8_quantize_row(int8_t *q, float *d, int32_t *s, const float *x, int K, int passes);
void qi8_column_block(const QMatmul *a, const XQ8 *xq, int cb, float *panel);

/* out[M, N] (+)= x[M, K] @ W[N, K]^T for W in tiles of `fmt`, on the float32 routes; 0, -1 (out of memory) or -2
 * (bad sizes). */
int qmm_f32(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads);
/* The same with x rounded to 16 bits per group of 32 (the dot route). */
int qmm_dot(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads);
/* The same with x rounded to 8 bits per group of 32 (the int8 route, for many rows). */
int qmm_i8(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
           int fmt, int accumulate, int num_threads);
/* The same in two passes of 8 bits (x ~ d (254 q1 + q2): 16-bit codes' error, the int8 route's byte products). */
int qmm_i8x2(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
             int fmt, int accumulate, int num_threads);
/* The same with x rounded to bfloat16, on AMX or AVX-512 BF16 (qmm_bf16_kind); -6 where neither is here. */
int qmm_amx(float *out, const float *x, const uint8_t *w, const float *bias, int M, int N, int K, int ldx, int ldo,
            int fmt, int accumulate, int num_threads);
/* Rows `ids` [T] of W as float32 (a quantized embedding table's lookup); 0, -2 (bad sizes), -3 (an id outside). */
int qrows_f32(float *out, const int64_t *ids, int T, const uint8_t *w, int N, int K, int fmt);
/* "matmul=<isa> dot=<isa> i8=<isa> amx=<yes|no>": the vector path each route was compiled with (cpu_kernel.isa()). */
const char *kernel_isa(void);
#endif
