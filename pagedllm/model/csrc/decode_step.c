/*
 * One whole decode step of a quantized Llama-family model in one call: embedding lookup, every layer (RMSNorm,
 * QKV, RoPE, KV-cache write, paged attention, output projection, RMSNorm, gated MLP, residual adds), the final
 * norm and the LM head, for T sequences with one new token each.
 *
 * Why: with the weights quantized, the matmuls of a one-sequence step take a few milliseconds, and the ~40
 * torch ops and Python lines around them in each of 30 layers cost more than that (dispatch, allocation,
 * casts). Here the step is one parallel region: the threads split each matmul by column blocks and each
 * attention by (sequence, KV head), and meet at a barrier between phases; no tensor is allocated per op.
 * Activations stay float32 whatever the model's dtype; the KV cache may be float32 or bfloat16.
 *
 * Numerics follow transformers' float32 path (RMSNorm as x * rsqrt(mean(x^2) + eps) * w, rotate-half RoPE
 * from the same float32 cos/sin tables, silu(g) * u); matmuls sum in the kernels' fixed order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "quant_matmul.h"

typedef struct {
    const float *attn_norm, *ffn_norm; /* [hidden] float32 */
    const uint8_t *qkv, *o, *gate_up, *down;
    int qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    const float *qkv_bias; /* [(heads + 2 kv_heads) * head_dim] or NULL */
    void *k_cache, *v_cache;
} DecodeLayer;

typedef struct {
    int hidden, inter, heads, kv_heads, head_dim, layers, vocab, block_size, cache_bf16;
    int64_t num_blocks, max_positions;
    float eps, scale;
    const float *final_norm;
    const uint8_t *embed, *lm_head;
    int embed_fmt, lm_head_fmt;
    const float *cos, *sin; /* [max_positions, head_dim] */
} DecodeModel;

typedef struct {
    const int64_t *tokens, *positions, *slots, *block_tables, *context_lens;
    int T, max_blocks;
    float *logits; /* [T, vocab] */
} DecodeBatch;

typedef struct { /* the step's activations, float32, rows of T */
    float *h, *x, *qkv, *attn, *gu, *act;
} Buffers;

int qrows_f32(float *out, const int64_t *ids, int T, const uint8_t *w, int N, int K, int fmt);

static void rmsnorm(float *out, const float *h, const float *w, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += h[i] * h[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

/* Rotate-half RoPE of one head in place: x * cos + cat(-x2, x1) * sin. */
static void rope(float *x, const float *cos, const float *sin, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + (-b) * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void store_row(void *cache, int64_t offset, const float *src, int n, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + offset, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)cache + offset;
    for (int i = 0; i < n; i++) { /* round to nearest even, as torch's .to(bfloat16) */
        uint32_t u;
        memcpy(&u, src + i, 4);
        dst[i] = (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 64) : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

static float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* out[T, N] (+)= x[T, K] @ W^T, split over the threads by column blocks (call from inside the region). */
static void matmul(float *out, const float *x, const uint8_t *w, int fmt, const float *bias, int T, int N, int K,
                   int accumulate, float *panel) {
    const QMatmul a = {out, x, w, bias, T, N, K / 32, K, N, fmt, accumulate};
    const int NB = (N + 15) / 16;
#pragma omp for schedule(static)
    for (int cb = 0; cb < NB; cb++) qmm_column_block(&a, cb, panel);
}

/* Normalize every row of h into x (split over the threads by rows). */
static void norm_rows(float *x, const float *h, const float *w, int T, int n, float eps) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) rmsnorm(x + (int64_t)t * n, h + (int64_t)t * n, w, n, eps);
}

/* RoPE on q and k, then k and v into the cache at each token's slot. */
static void rope_and_store(const DecodeModel *m, const DecodeLayer *L, const DecodeBatch *b, float *qkv) {
    const int D = m->head_dim, H = m->heads, KVH = m->kv_heads, width = (H + 2 * KVH) * D;
#pragma omp for schedule(static)
    for (int t = 0; t < b->T; t++) {
        float *row = qkv + (int64_t)t * width;
        const float *cos = m->cos + b->positions[t] * D, *sin = m->sin + b->positions[t] * D;
        for (int h = 0; h < H + KVH; h++) rope(row + h * D, cos, sin, D);
        const int64_t at = b->slots[t] * KVH * D;
        store_row(L->k_cache, at, row + H * D, KVH * D, m->cache_bf16);
        store_row(L->v_cache, at, row + (H + KVH) * D, KVH * D, m->cache_bf16);
    }
}

static void attention(const DecodeModel *m, const DecodeLayer *L, const DecodeBatch *b, const Buffers *buf,
                      float *scores, float *block) {
    const int H = m->heads, KVH = m->kv_heads, D = m->head_dim, G = H / KVH, width = (H + 2 * KVH) * D;
    /* q rows sit inside qkv (row stride `width`): attend with a per-token view. */
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < b->T * KVH; i++) {
        const int t = i / KVH, kvh = i % KVH;
        Args a = {buf->attn + (int64_t)t * H * D, buf->qkv + (int64_t)t * width, L->k_cache, L->v_cache,
                  b->block_tables + (int64_t)t * b->max_blocks, b->context_lens + t, H, KVH, D, m->block_size,
                  b->max_blocks, m->cache_bf16, m->scale, 0};
        paged_attention_heads(&a, 0, kvh * G, kvh * G + G, scores, block);
    }
}

static void mlp_act(const DecodeModel *m, const Buffers *buf, int T) {
    const int I = m->inter;
#pragma omp for schedule(static)
    for (int i = 0; i < T * I; i++) {
        const int t = i / I, j = i % I;
        buf->act[i] = silu_mul(buf->gu[(int64_t)t * 2 * I + j], buf->gu[(int64_t)t * 2 * I + I + j]);
    }
}

static void layer(const DecodeModel *m, const DecodeLayer *L, const DecodeBatch *b, const Buffers *buf,
                  float *panel, float *scores, float *block) {
    const int T = b->T, E = m->hidden, HD = m->heads * m->head_dim, QKV = (m->heads + 2 * m->kv_heads) * m->head_dim;
    norm_rows(buf->x, buf->h, L->attn_norm, T, E, m->eps);
    matmul(buf->qkv, buf->x, L->qkv, L->qkv_fmt, L->qkv_bias, T, QKV, E, 0, panel);
    rope_and_store(m, L, b, buf->qkv);
    attention(m, L, b, buf, scores, block);
    matmul(buf->h, buf->attn, L->o, L->o_fmt, NULL, T, E, HD, 1, panel);
    norm_rows(buf->x, buf->h, L->ffn_norm, T, E, m->eps);
    matmul(buf->gu, buf->x, L->gate_up, L->gate_up_fmt, NULL, T, 2 * m->inter, E, 0, panel);
    mlp_act(m, buf, T);
    matmul(buf->h, buf->act, L->down, L->down_fmt, NULL, T, E, m->inter, 1, panel);
}

/* -2 bad sizes, -3 a context length outside the block table, -4 a block id outside the cache, -5 a token id,
 * position or slot out of range, -1 out of memory. */
static int check(const DecodeModel *m, const DecodeBatch *b, int64_t *max_ctx) {
    if (b->T <= 0 || m->heads % m->kv_heads || m->head_dim % 2 || m->hidden % 32 || m->inter % 32) return -2;
    for (int t = 0; t < b->T; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= m->vocab || b->positions[t] < 0 ||
            b->positions[t] >= m->max_positions || b->slots[t] < 0 ||
            b->slots[t] >= m->num_blocks * m->block_size || b->positions[t] >= b->context_lens[t])
            return -5;
    Args a = {0};
    a.block_tables = b->block_tables;
    a.context_lens = b->context_lens;
    a.max_blocks = b->max_blocks;
    a.block_size = m->block_size;
    return paged_attention_check(&a, b->T, m->num_blocks, max_ctx);
}

int decode_step(const DecodeModel *m, const DecodeLayer *layers, const DecodeBatch *b, int num_threads) {
    int64_t max_ctx = 0;
    const int bad = check(m, b, &max_ctx);
    if (bad) return bad;
    const int T = b->T, E = m->hidden, I = m->inter, HD = m->heads * m->head_dim;
    const int QKV = (m->heads + 2 * m->kv_heads) * m->head_dim;
    const int64_t per_row = 2 * (int64_t)E + QKV + HD + 3 * (int64_t)I;
    float *mem = malloc((size_t)T * per_row * sizeof(float));
    if (!mem) return -1;
    Buffers buf = {mem, mem + (int64_t)T * E, mem + 2 * (int64_t)T * E, mem + (int64_t)T * (2 * E + QKV),
                   mem + (int64_t)T * (2 * E + QKV + HD), mem + (int64_t)T * (2 * E + QKV + HD + 2 * I)};
    int K = E > I ? E : I;
    K = K > HD ? K : HD;
    int status = qrows_f32(buf.h, b->tokens, T, m->embed, m->vocab, E, m->embed_fmt);
    if (status) {
        free(mem);
        return status;
    }
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *panel = malloc((size_t)K * 16 * sizeof(float));
        float *scores = malloc((size_t)max_ctx * m->heads * sizeof(float));
        float *block = malloc((size_t)m->block_size * m->kv_heads * m->head_dim * sizeof(float));
        int ok = panel && scores && block;
        if (!ok) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp barrier
        for (int l = 0; l < m->layers && status == 0; l++) layer(m, &layers[l], b, &buf, panel, scores, block);
        if (status == 0) {
            norm_rows(buf.x, buf.h, m->final_norm, T, E, m->eps);
            matmul(b->logits, buf.x, m->lm_head, m->lm_head_fmt, NULL, T, m->vocab, E, 0, panel);
        }
        free(panel);
        free(scores);
        free(block);
    }
    free(mem);
    return status;
}
