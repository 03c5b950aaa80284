/* Shared by the decode-attention kernel (paged_attention.c) and the fused decode step (model_step.c). */
#ifndef PAGEDLLM_PAGED_ATTENTION_H
#define PAGEDLLM_PAGED_ATTENTION_H
#include <stdint.h>

/* What a KV cache holds: float32, bfloat16, or one-byte codes with one bfloat16 scale per (token, KV head) row
 * (llama.cpp's q8_0 cache, ik_llama's Q8_KV): D codes then the scale, the row rotated by kv_rotate before it was
 * quantized (model/kernels/kv_quant.py). */
enum { KV_F32, KV_BF16, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 };
static inline int kv_row_bytes(int D) { return D + 2; }

typedef struct {
    float *out;                 /* [S, H, D] */
    const float *q;             /* [S, H, D] */
    const void *k_cache; /* [num_blocks, block_size, KVH, D] float32 / bfloat16, or [..., kv_row_bytes(D)] bytes */
    const void *v_cache;
    const int64_t *block_tables; /* [S, max_blocks] */
    const int64_t *context_lens; /* [S] */
    int H, KVH, D, block_size, max_blocks, cache_kind; /* cache_kind: KV_F32 ... */
    float scale;
    int64_t max_ctx;
    int nq, q_stride, out_stride; /* queries per sequence (consecutive tokens), floats between their rows */
    int64_t window;               /* > 0: a query sees only its last `window` positions, itself included */
    float softcap;                /* > 0: scores become softcap * tanh(score / softcap) before the softmax */
    const float *sinks; /* [H] or NULL: gpt-oss's learned logit per head, one more term in the softmax's sum */
    /* cache elements (bytes for a quantized cache) from one token's KV row to the next; 0: the row is its KVH
     * heads (kv_stride_of). Wider: a layer whose rows fill the front of a wider slot's (Gemma 4's two shapes) */
    int64_t kv_stride;
} Args;

/* The stride of a's cache rows in its elements (bytes for a quantized cache). */
static inline int64_t kv_stride_of(const Args *a) {
    if (a->kv_stride) return a->kv_stride;
    return (int64_t)a->KVH * (a->cache_kind >= KV_INT8 ? kv_row_bytes(a->D) : a->D);
}

/* The first position a query whose context is ctx tokens attends to (0 without a window). */
static inline int64_t window_start(const Args *a, int64_t ctx) {
    return a->window > 0 && ctx > a->window ? ctx - a->window : 0;
}

/* Sequence s, query heads h0..h1-1 of its nq queries; scores: nq * H * (context + nq - 1 + 16) floats (each
 * row has room for a whole group of rows past its end), buf: block_size * KVH * D floats. */
void paged_attention_heads(const Args *a, int s, int h0, int h1, float *scores, float *buf);
/* x (D floats) rotated in place by the normalized Walsh-Hadamard transform over each block of P values, P the
 * largest power of two dividing D: its own inverse. A quantized cache stores keys and values rotated, so the
 * caller rotates the queries before attention and the outputs after it. */
void kv_rotate(float *x, int D);
/* 0, or -3 for a context length outside the block table, -4 for a block id outside the cache (only the blocks
 * inside the window are read, so only those are checked). */
int paged_attention_check(const Args *a, int S, int64_t num_blocks, int64_t *max_ctx);
/* One decode query per sequence over the paged caches (the layouts in paged_attention.c's header comment); 0, -1
 * (out of memory), -2 (bad sizes), -3 (a context length outside the block table), -4 (a block id outside the
 * cache). */
int paged_decode_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, int S, int H, int KVH,
                           int D, int block_size, int max_blocks, int64_t num_blocks, float scale, int cache_kind,
                           int64_t window, float softcap, const float *sinks, int num_threads);
/* n quantized cache rows -> n rows of D floats (still rotated); 0, or -2 for bad sizes. */
int kv_dequantize_rows(float *dst, const uint8_t *src, int64_t n, int D, int kind);
#endif
