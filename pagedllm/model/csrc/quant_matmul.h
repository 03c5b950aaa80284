/* Shared by the quantized matmul (quant_matmul.c) and the fused decode step (decode_step.c). */
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

int qtile_bytes(int fmt);
/* One block of 16 output columns for all M rows; `panel` (K * 16 floats, or NULL) serves many rows. */
void qmm_column_block(const QMatmul *a, int cb, float *panel);
#endif
