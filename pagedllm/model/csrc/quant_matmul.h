/* Shared by the quantized matmul (quant_matmul.c) and the fused decode step (model_step.c). */
#ifndef PAGEDLLM_QUANT_MATMUL_H
#define PAGEDLLM_QUANT_MATMUL_H
#include <stdint.h>

#define QFMT_Q4 0 /* 4-bit, w = d * q + m, q in 0..15 (Q4_0, Q4_1, int4) */
#define QFMT_Q8 1 /* 8-bit, w = d * q, q in -128..127 (Q8_0, int8) */

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

int qtile_bytes(int fmt);
/* AMX: 1 where this CPU and kernel allow it; begin/end configure and release the tiles of the calling thread. */
int qmm_amx_available(void);
void qmm_amx_begin(void);
void qmm_amx_end(void);
void qmm_amx_pair(const QMatmulBf16 *a, int p, uint16_t *bbuf);
/* Row m of x into xb, laid out as AMX A tiles ([m / 16][K / 32][16][32] bfloat16; whole tiles, zero-padded). */
void qmm_amx_convert_row(uint16_t *xb, const float *x, int m, int G);
/* One block of 16 output columns for all M rows; `panel` (K * 16 floats, or NULL) serves many rows. */
void qmm_column_block(const QMatmul *a, int cb, float *panel);
#endif
