/*
 * One whole step of a quantized decoder in one call: embedding lookup, every layer (RMSNorm, QKV, q/k norms,
 * RoPE, KV-cache write, paged attention, output projection, RMSNorm, gated MLP, residual adds), the final norm
 * and the LM head for the rows asked for. Any mix of decode tokens and prefill chunks.
 *
 * Every family runs here as the shared decoder (decoder.py) describes it, with no code of its own: which norms a
 * layer has (before and / or after attention and the MLP, q/k norms per head or over the whole projection; the
 * weights hold Gemma's 1 + w already), SwiGLU or GeGLU, biases, the embedding / residual multipliers and the
 * logits' divisor and soft-cap, and per layer its RoPE (none, the global base, Gemma 3's local one; partial
 * rotary: the first rotary_dim dims of each head) and its attention (window, scale, soft-cap), a sparse layer's
 * router, experts and shared expert (a dense MLP beside them, with their own norms: Gemma 4). model_step.h says
 * where each lives.
 *
 * Why: with the weights quantized, the matmuls of a one-sequence decode step take a few milliseconds, and the
 * ~40 torch ops and Python lines around them in each of 30 layers cost more than that (dispatch, allocation,
 * casts). Here the step is one parallel region: the threads take work items (column blocks of a matmul,
 * (token, head) pairs of attention, rows) from shared counters, phase after phase (see "the step as a list of
 * phases" below); no tensor is allocated per op.
 *
 * Attention treats every token as a query of its own over its sequence's cache up to its own position (all of
 * the step's K/V are written first), so a prefill chunk is causal attention and a decode token the usual
 * decode attention, through the same code. Every token is therefore computed the same way whatever else is in
 * the step and however its prompt was chunked: with the float32 kernels a sequence's result does not depend on
 * the batch, bit for bit. Activations are float32; the KV cache float32 or bfloat16. With `amx_min_rows` > 0
 * (--dtype bfloat16 on a CPU with AMX or AVX-512 BF16) matmuls of at least that many rows round their inputs to
 * bfloat16 and run on AMX or vdpbf16ps: faster for many rows, and then the batch does change a sequence's numbers.
 *
 * Numerics follow transformers' float32 path (RMSNorm as x * rsqrt(mean(x^2) + eps) * w, rotate-half RoPE
 * from the same float32 cos/sin tables, silu(g) * u, gelu_tanh(g) * u); matmuls sum in the kernels' fixed order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "lora.h"
#include "model_step.h"
#include "moe.h"
#include "paged_attention.h"
#include "quant_matmul.h"
#include "recurrent.h"
#include "simd.h"
#include "vmath.h"

enum { P_NORM, P_QKV, P_ROPE, P_ATTN, P_O, P_GATE_UP, P_ACT, P_DOWN, P_LM_HEAD, P_ROUTER, P_EXPERTS, N_PHASES };

#define TILE 16 /* consecutive tokens of a prefill chunk whose attention reads each block once */

typedef struct { /* the step's activations (float32, T rows) and scratch */
    float *h, *x, *qkv, *attn, *gu, *act;
    float *y;        /* a branch's output before its norm and residual add (post-norms, a residual multiplier) */
    int64_t *ctx;    /* [T] tokens each query attends to */
    int *tiles;      /* [n_tiles] first token of each attention tile (a run of <= TILE tokens of one sequence) */
    int n_tiles;
    uint16_t *xb;  /* x as bfloat16 for AMX: [T padded to 16, widest K] */
    int amx_rows; /* matmuls of at least this many rows run on AMX; 0: none */
    XQ16 xq;      /* x rounded for the dot route: [T, widest K] codes, their scales and sums */
    int dot;      /* matmuls (but those on AMX or the int8 route) take the dot route */
    XQ8 xq8;      /* x rounded for the int8 route: [T, widest K] */
    int i8_rows;  /* matmuls of at least this many rows take the int8 route (a format it runs); 0: none */
    int i8_kinds; /* ... of the kinds whose bit is set (StepModel.i8_kinds): the torch path's choice per weight */
    /* sparse layers: each token's experts and their weights [T, topk], the shared expert's gate_up / act /
     * output rows, the routed experts' plan (moe.h), and the first error of a grouping (0: none) */
    int64_t *ids;
    float *rw, *sgu, *sact, *sy, *rlogits; /* rlogits: [T, experts] the router's logits, then probabilities */
    MoePlan *plan;
    int *moe_status;
    RecStep rec; /* a hybrid model's mixers' rows and sequences (recurrent.h) */
    /* Gemma 4's per-layer inputs: [T, layers * ple_width] each token's (the table's rows, then mixed in place),
     * the projection of its embedding, and [T, ple_width] a layer's gate */
    float *ple, *ple_proj, *ple_gate;
    float *yd; /* [T, hidden] a sparse layer's dense MLP's output beside its experts' (StepLayer.moe_norm) */
    /* [T, moe_latent] each: the routed experts' input (latent_in of the block's input) and their weighted sum,
     * before latent_out (StepModel.moe_latent; NULL without it) */
    float *xl, *yl;
} Buffers;

typedef struct { /* per thread */
    float *panel, *scores, *block;
    uint16_t *bbuf;
    void *rec; /* the recurrent mixers' scan scratch (rec_scratch_bytes; NULL where no layer needs one) */
} Scratch;

int qrows_f32(float *out, const int64_t *ids, int T, const uint8_t *w, int N, int K, int fmt);

/* sizeof a structure of model_step.h by name, or -1: fused_step.py checks its ctypes copies against these. */
int64_t step_struct_size(const char *name) {
    if (!strcmp(name, "StepLayer")) return sizeof(StepLayer);
    if (!strcmp(name, "StepModel")) return sizeof(StepModel);
    if (!strcmp(name, "StepBatch")) return sizeof(StepBatch);
    return -1;
}

#ifdef _OPENMP
#include <omp.h>
static int omp_thread(void) { return omp_get_thread_num(); }
#else
static int omp_thread(void) { return 0; }
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Adds the time since *t to phase `p` and restarts *t. Every phase ends at a barrier, so the first thread's
 * clock is the step's; the others leave `t` NULL. */
static void mark(const StepBatch *b, double *t, int p) {
    if (!t) return;
    const double n = now();
    b->profile[p] += n - *t;
    *t = n;
}

/* 1 / rms(h) over n floats: four partial sums of squares, so the adds overlap. */
static float rms_inv(const float *h, int n, float eps) {
    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        s0 += ld(h + i) * ld(h + i);
        s1 += ld(h + i + VW) * ld(h + i + VW);
        s2 += ld(h + i + 2 * VW) * ld(h + i + 2 * VW);
        s3 += ld(h + i + 3 * VW) * ld(h + i + 3 * VW);
    }
    for (; i + VW <= n; i += VW) s0 += ld(h + i) * ld(h + i);
    const vf s = (s0 + s1) + (s2 + s3);
    float ss = 0.0f;
    for (int l = 0; l < VW; l++) ss += s[l];
    for (; i < n; i++) ss += h[i] * h[i]; /* a head size no multiple of VW */
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* out = w * (h / rms(h)); out may be h (a q/k norm in place). */
static void rmsnorm(float *out, const float *h, const float *w, int n, float eps) {
    const float r = rms_inv(h, n, eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (h[i] * r);
}

/* out = silu(g) * u = g / (1 + e^-g) * u, n a multiple of VW. */
static void silu_mul(float *out, const float *g, const float *u, int n) {
    for (int j = 0; j < n; j += VW) {
        const vf gv = ld(g + j);
        *(vfu *)(out + j) = gv / (1.0f + vexp(-gv)) * ld(u + j);
    }
}

/* out = gelu_tanh(g) * u, n a multiple of VW: 0.5 g (1 + tanh(a)) = g sigmoid(2 a), a = sqrt(2 / pi) (g +
 * 0.044715 g^3), the form with one exp and no cancellation near 0. */
static void gelu_tanh_mul(float *out, const float *g, const float *u, int n) {
    for (int j = 0; j < n; j += VW) {
        const vf gv = ld(g + j), a = 0.7978845608028654f * (gv + 0.044715f * gv * gv * gv);
        *(vfu *)(out + j) = gv / (1.0f + vexp(-2.0f * a)) * ld(u + j);
    }
}

/* out = relu(x)^2 (Nemotron-H's ungated MLP), n elements. */
static void relu2_row(float *out, const float *x, int n) {
    for (int j = 0; j < n; j++) {
        const float v = x[j] > 0.0f ? x[j] : 0.0f;
        out[j] = v * v;
    }
}

/* Rotate-half RoPE of the first R dims of one head in place (R: the rotary width; the rest pass as they are):
 * x * cos + cat(-x2, x1) * sin. */
static void rope(float *x, const float *cos, const float *sin, int R) {
    const int half = R / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + (-b) * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* float -> float8 (e4m3fn: m = 3, bias = 7; e5m2: m = 2, bias = 15), round to nearest even as torch's
 * .to(float8_*), for |x| within the format's range (the caller scales and clamps it there); a NaN gives a signed
 * zero. Branch-free on the bits so a row's loop vectorizes (frexp / ldexp per value made fp8 writes slow): a
 * normal value rounds its mantissa in place, a carry moving it to the next binade; one below the smallest
 * normal is rounded by adding a float whose last place is the format's subnormal step, whose bits then count
 * steps. Compiled without -ffast-math, so that add rounds as IEEE says. */
static inline uint8_t to_fp8(float x, const int m, const int bias) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 24) & 0x80, mag = u & 0x7fffffff, shift = 23 - m;
    const uint32_t normal = ((mag + (1u << (shift - 1)) - 1 + ((mag >> shift) & 1)) >> shift) -
                            ((uint32_t)(127 - bias) << m);
    const float magic = m == 3 ? 0x1p14f : 0x1p7f; /* last place 2^(1-bias-m): the subnormal step */
    float a;
    memcpy(&a, &mag, 4);
    const float sum = a + magic;
    uint32_t sub, magic_bits;
    memcpy(&sub, &sum, 4);
    memcpy(&magic_bits, &magic, 4);
    sub -= magic_bits;
    const uint32_t min_normal = (uint32_t)(128 - bias) << 23; /* 2^(1-bias) */
    const uint32_t code = mag > 0x7f800000u ? 0 : mag < min_normal ? sub : normal;
    return (uint8_t)(sign | code);
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16); NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 64)
                                         : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* One (token, KV head) row of a quantized cache: D codes, then their bfloat16 scale, as kv_quant.quantize writes
 * them from the row already rotated (kv_rotate): the scale is amax / the format's largest value, rounded up to a
 * bfloat16 so no code overflows. */
static void store_quantized(uint8_t *row, const float *src, int D, int kind) {
    const float top = kind == KV_INT8 ? 127.0f : kind == KV_FP8_E4M3 ? 448.0f : 57344.0f;
    float amax = 0.0f;
    for (int j = 0; j < D; j++) amax = fabsf(src[j]) > amax ? fabsf(src[j]) : amax;
    float scale = amax / top;
    scale = scale < 0x1p-100f ? 0x1p-100f : scale;
    uint32_t bits;
    memcpy(&bits, &scale, 4);
    bits = (bits + 0xffff) & 0xffff0000u;
    memcpy(&scale, &bits, 4);
    for (int j = 0; kind == KV_INT8 && j < D; j++) { /* a loop per kind: each vectorizes */
        const float q = src[j] / scale;
        row[j] = (uint8_t)(int8_t)rintf(q > top ? top : q < -top ? -top : q);
    }
    for (int j = 0; kind == KV_FP8_E4M3 && j < D; j++) {
        const float q = src[j] / scale;
        row[j] = to_fp8(q > top ? top : q < -top ? -top : q, 3, 7);
    }
    for (int j = 0; kind == KV_FP8_E5M2 && j < D; j++) {
        const float q = src[j] / scale;
        row[j] = to_fp8(q > top ? top : q < -top ? -top : q, 2, 15);
    }
    row[D] = (uint8_t)(bits >> 16);
    row[D + 1] = (uint8_t)(bits >> 24);
}

/* n rows of D floats (rotated already) -> n quantized cache rows, as the step writes them: the tests compare the
 * bytes with kv_quant.encode's. 0, or -2 for bad sizes. */
int kv_quantize_rows(uint8_t *dst, const float *src, int64_t n, int D, int kind) {
    if (n < 0 || D <= 0 || kind < KV_INT8 || kind > KV_FP8_E5M2) return -2;
    for (int64_t r = 0; r < n; r++) store_quantized(dst + r * kv_row_bytes(D), src + r * D, D, kind);
    return 0;
}

/* Token `slot`'s keys (or values) for all KVH heads into the cache (rotated already for a quantized one). */
static void store_row(void *cache, int64_t slot, const float *src, int KVH, int D, int kind, int64_t stride) {
    const int64_t n = (int64_t)KVH * D; /* stride: cache elements (bytes if quantized) from a token's row to the next */
    if (kind == KV_F32) {
        memcpy((float *)cache + slot * stride, src, (size_t)n * sizeof(float));
    } else if (kind == KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + slot * stride;
        for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
    } else {
        for (int h = 0; h < KVH; h++)
            store_quantized((uint8_t *)cache + slot * stride + h * kv_row_bytes(D), src + (int64_t)h * D, D, kind);
    }
}

/* ---- the step as a list of phases ------------------------------------------------------------------------
 * Each phase is a set of independent work items (rows, column blocks, (token, KV head) pairs); the threads
 * take items from an atomic counter and the next phase starts once every item of this one is done. There is
 * no barrier: a thread that the OS has put aside (this machine is shared) holds up at most the item it is
 * working on, where a barrier would hold up every phase of the step until it came back. Items write
 * disjoint outputs, so which thread runs an item changes nothing in the result. */
enum { K_NORM, K_CVT, K_Q16, K_Q8, K_MATMUL, K_ROPE, K_ATTN, K_ACT, K_RESID, K_SCALE, K_LOGIT, K_ROUTE, K_TOPK,
       K_MOE_GROUP, K_MOE_GATHER, K_MOE_GATE_UP, K_MOE_ACT, K_MOE_DOWN, K_MOE_COMBINE, K_SHARED, K_LORA_A, K_LORA_B,
       K_REC_PERM, K_REC_CONV, K_REC_SCAN, K_REC_NORM, K_PLE_MIX, K_PLE_ACT, K_LSCALE, K_BESIDE };

typedef struct {
    int kind, layer, items, prof; /* prof: the profile slot the phase's time goes to */
    float *out;                   /* norm: out row i = norm(x row i (or rows[i])); matmul: out (+)= x @ W^T */
    const float *x, *w_norm, *bias;
    const int64_t *rows;
    const uint8_t *w;
    int fmt, M, N, K, accumulate, amx, dot, i8, per_item;
    int lora; /* the LoRA phases': which matmul of the layer (LORA_QKV ...) */
    int ldo; /* a matmul's output row stride (0: N) */
} Phase;

static Phase norm_phase(float *x, const float *h, const float *w, const int64_t *rows, int n) {
    return (Phase){.kind = K_NORM, .items = n, .prof = P_NORM, .out = x, .x = h, .w_norm = w, .rows = rows};
}

/* The matmul out[M, N] (+)= x[M, K] @ W^T as one phase (two with AMX: x to bfloat16 tiles first; two on the
 * dot and int8 routes: x rounded to 16- or 8-bit integers first). */
/* 38 + 18 (a mixer's phases) + 8 (the LoRA halves of qkv, o, gate_up, down) + 4 (a latent MoE's projections) */
#define MAX_LAYER_PHASES 68
#define ROUTER_EXPERTS 16 /* experts per router work item: a decode token's router spread over the threads */
#define ROUTER_CHUNKS(m) (((m)->experts + ROUTER_EXPERTS - 1) / ROUTER_EXPERTS)

/* matmul_phases' `prof` or-ed with NO_KIND: a matmul of none of the kinds of StepModel.i8_kinds' profile slots
 * (a recurrent mixer's projections, the per-layer inputs', a sparse block's latent projections), whose int8 route
 * is bit I8_NO_KIND's */
#define NO_KIND 0x100
#define I8_NO_KIND N_PHASES

static int matmul_phases(Phase *ph, const Buffers *buf, int prof, float *out, const float *x, const uint8_t *w,
                         int fmt, const float *bias, int M, int N, int K, int accumulate, int nthreads) {
    const int kind = prof & NO_KIND ? I8_NO_KIND : prof;
    prof &= ~NO_KIND;
    const int i8 = buf->i8_rows && M >= buf->i8_rows && (buf->i8_kinds >> kind & 1) && qi8_runs(fmt);
    const int amx = !i8 && buf->amx_rows && M >= buf->amx_rows, units = amx ? (N + 31) / 32 : (N + 15) / 16;
    const int dot = !amx && !i8 && buf->dot, items = 8 * nthreads < units ? 8 * nthreads : units;
    int n = 0;
    if (amx) ph[n++] = (Phase){.kind = K_CVT, .items = M, .prof = prof, .x = x, .K = K};
    if (dot) ph[n++] = (Phase){.kind = K_Q16, .items = M, .prof = prof, .x = x, .K = K};
    if (i8) ph[n++] = (Phase){.kind = K_Q8, .items = M, .prof = prof, .x = x, .K = K};
    ph[n++] = (Phase){.kind = K_MATMUL, .items = items, .prof = prof, .out = out, .x = x, .bias = bias, .w = w,
                      .fmt = fmt, .M = M, .N = N, .K = K, .accumulate = accumulate, .amx = amx, .dot = dot,
                      .i8 = i8, .per_item = (units + items - 1) / items};
    return n;
}

/* The LoRA term (lora.c) of the matmul just planned in ph[0, k) (matmul_phases' or branch_phases'), slot `slot`
 * of layer l: its two halves after the matmul and before a residual add that ends the branch; k when no adapter
 * of the step adapts that matmul. */
static int with_lora(Phase *ph, int k, const StepBatch *b, int l, int slot) {
    if (!b->lora || !lora_targets(b->lora, l, slot)) return k;
    const int resid = ph[k - 1].kind == K_RESID, n = k - resid;
    const Phase mm = ph[n - 1], add = ph[k - 1];
    ph[n] = (Phase){.kind = K_LORA_A, .layer = l, .lora = slot, .items = lora_items(b->lora, 0), .prof = mm.prof,
                    .x = mm.x, .K = mm.K};
    ph[n + 1] = (Phase){.kind = K_LORA_B, .layer = l, .lora = slot, .items = lora_items(b->lora, mm.N),
                        .prof = mm.prof, .out = mm.out, .N = mm.N, .ldo = mm.ldo};
    if (resid) ph[n + 2] = add;
    return k + 2;
}

/* Attention's items per tile: `split` runs of H / split query heads, each within one KV head's group, so that a
 * block's rows are read (and a bfloat16 or quantized row widened) once for the heads of an item. Fewer items widen
 * less; more keep the threads busy (one sequence of 3 KV heads on 2 threads: 3 items leave one thread idle a third
 * of the time, 9 widen every row 3 times). The split taken minimizes the items a thread runs times an item's
 * cost, counted as 2 (its reads and widening) + 1 per query head; a head's result is the same in any split. */
static int attention_split(int tiles, int H, int KVH, int nthreads) {
    int best = KVH;
    int64_t best_cost = -1;
    for (int s = KVH; s <= H; s += KVH) {
        if (H % s) continue;
        const int64_t rounds = ((int64_t)tiles * s + nthreads - 1) / nthreads, cost = rounds * (2 + H / s);
        if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
    }
    return best;
}

/* A row of qkv: H query heads (each followed by its gate's rows with an output gate), KVH key and value heads;
 * qkv_width: the widest layer's (the buffer's), layer_width: the layer's own (the row stride its phases use, with
 * room for V where it projects fewer: rope_and_store fills it). */
static int qkv_width(const StepModel *m) { return (m->heads * (m->attn_gate ? 2 : 1) + 2 * m->kv_heads) * m->head_dim; }
static int layer_width(const StepModel *m, const StepLayer *L) {
    return (m->heads * (m->attn_gate ? 2 : 1) + 2 * L->kv_heads) * L->head_dim;
}

/* A branch's output projection (attention's o, the MLP's down) and its residual add: straight into h when the
 * layer adds it as it is; else into y, then h += residual_scale * norm(y) row by row. */
static int branch_phases(Phase *ph, const StepModel *m, const Buffers *buf, int prof, const float *x,
                         const uint8_t *w, int fmt, const float *bias, const float *out_norm, int T, int K,
                         int nthreads) {
    const int direct = !out_norm && m->residual_scale == 1.0f;
    int n = matmul_phases(ph, buf, prof, direct ? buf->h : buf->y, x, w, fmt, bias, T, m->hidden, K, direct,
                          nthreads);
    if (!direct)
        ph[n++] = (Phase){.kind = K_RESID, .items = T, .prof = P_NORM, .out = buf->h, .x = buf->y, .w_norm = out_norm};
    return n;
}

/* A sparse layer's block (in the MLP's place) from xm into y, then its residual add: the router per token (its
 * top k experts and weights), the routed experts as moe.c's phases (each routed expert's weights read once for
 * all of its rows), the shared expert's matmuls and its gated add, as SparseMoE.forward sums them (the routed
 * experts' sum + sigmoid(gate . x) * shared(x)). Latent experts (StepModel.moe_latent) read latent_in(x) and sum
 * into yl, which latent_out projects into y before the shared expert's add (the router and the shared expert read
 * x at the hidden width, as SparseMoE.forward). With a dense MLP beside it (DecoderLayer._mlp: Gemma 4), that
 * MLP first, from xm into yd; then the experts' and the router's own norms of the stream (into x, whose MLP input
 * is spent, and y, which the router has read before the top-k phase clears it); the two outputs, each normed,
 * summed into y before the residual add. */
static int moe_phases(Phase *ph, const StepModel *m, const StepLayer *L, int l, const StepBatch *b,
                      const Buffers *buf, const float *xm, int T, int nthreads) {
    const int S = T * m->topk, items = moe_plan_items(buf->plan), SI = m->shared_inter, E = m->hidden, I = L->inter;
    const int LAT = m->moe_latent;
    const float *xr = xm;
    int n = 0;
    if (L->gate_up) {
        n += with_lora(ph + n,
                       matmul_phases(ph + n, buf, P_GATE_UP, buf->gu, xm, L->gate_up, L->gate_up_fmt, NULL, T, 2 * I,
                                     E, 0, nthreads),
                       b, l, LORA_GATE_UP);
        ph[n++] = (Phase){.kind = K_ACT, .items = T, .prof = P_ACT, .out = buf->act, .x = buf->gu, .N = I};
        n += with_lora(ph + n,
                       matmul_phases(ph + n, buf, P_DOWN, buf->yd, buf->act, L->down, L->down_fmt, NULL, T, E, I, 0,
                                     nthreads),
                       b, l, LORA_DOWN);
    }
    if (L->moe_norm) {
        ph[n++] = norm_phase(buf->x, buf->h, L->moe_norm, NULL, T);
        xm = xr = buf->x;
    }
    if (L->router_norm) {
        ph[n++] = norm_phase(buf->y, buf->h, L->router_norm, NULL, T);
        xr = buf->y;
    }
    ph[n++] = (Phase){.kind = K_ROUTE, .layer = l, .items = T * ROUTER_CHUNKS(m), .prof = P_ROUTER, .x = xr};
    ph[n++] = (Phase){.kind = K_TOPK, .layer = l, .items = T, .prof = P_ROUTER};
    ph[n++] = (Phase){.kind = K_MOE_GROUP, .layer = l, .items = 1, .prof = P_ROUTER};
    if (LAT)
        n += matmul_phases(ph + n, buf, P_EXPERTS | NO_KIND, buf->xl, xm, L->latent_in, L->latent_in_fmt, NULL, T,
                           LAT, E, 0, nthreads);
    ph[n++] = (Phase){.kind = K_MOE_GATHER, .items = S, .prof = P_EXPERTS, .x = LAT ? buf->xl : xm};
    ph[n++] = (Phase){.kind = K_MOE_GATE_UP, .items = items, .prof = P_EXPERTS};
    ph[n++] = (Phase){.kind = K_MOE_ACT, .items = S, .prof = P_EXPERTS};
    ph[n++] = (Phase){.kind = K_MOE_DOWN, .items = items, .prof = P_EXPERTS};
    ph[n++] = (Phase){.kind = K_MOE_COMBINE, .items = T, .prof = P_EXPERTS, .out = LAT ? buf->yl : buf->y};
    if (LAT) /* overwrites y (the top-k phase cleared yl, the sum's rows, instead) */
        n += matmul_phases(ph + n, buf, P_EXPERTS | NO_KIND, buf->y, buf->yl, L->latent_out, L->latent_out_fmt, NULL,
                           T, E, LAT, 0, nthreads);
    if (L->shared_gate_up) {
        n += matmul_phases(ph + n, buf, P_GATE_UP, buf->sgu, xm, L->shared_gate_up, L->shared_gate_up_fmt, NULL, T,
                           (m->act == ACT_RELU2 ? 1 : 2) * SI, E, 0, nthreads);
        ph[n++] = (Phase){.kind = K_ACT, .items = T, .prof = P_ACT, .out = buf->sact, .x = buf->sgu, .N = SI};
        n += matmul_phases(ph + n, buf, P_DOWN, buf->sy, buf->sact, L->shared_down, L->shared_down_fmt, NULL, T, E,
                           SI, 0, nthreads);
        ph[n++] = (Phase){.kind = K_SHARED, .layer = l, .items = T, .prof = P_DOWN, .x = xm};
    }
    if (L->gate_up) ph[n++] = (Phase){.kind = K_BESIDE, .layer = l, .items = T, .prof = P_NORM};
    ph[n++] = (Phase){.kind = K_RESID, .items = T, .prof = P_NORM, .out = buf->h, .x = buf->y,
                      .w_norm = L->ffn_out_norm};
    return n;
}

/* A linear layer's mixer in attention's place (recurrent.h): its input projections, each into its columns of
 * the raw row, reordered where it has a permutation; the conv per (sequence, channel chunk); the recurrence per
 * (sequence, head); Mamba2's gated norm per row; the output projection and its residual add. */
static int mixer_phases(Phase *ph, const StepModel *m, const StepLayer *L, int l, const Buffers *buf,
                        const float *xa, int T, int nthreads) {
    const RecMixer *r = L->mixer;
    const int S = buf->rec.S;
    int n = 0;
    for (int i = 0, off = 0; i < r->n_in; off += (int)r->in_n[i], i++) {
        n += matmul_phases(ph + n, buf, P_QKV | NO_KIND, buf->rec.rows + off, xa, r->in[i], (int)r->in_fmt[i],
                           r->in_bias[i], T, (int)r->in_n[i], m->hidden, 0, nthreads);
        ph[n - 1].ldo = r->width;
    }
    if (r->perm) ph[n++] = (Phase){.kind = K_REC_PERM, .layer = l, .items = T, .prof = P_ROPE};
    ph[n++] = (Phase){.kind = K_REC_CONV, .layer = l, .items = rec_conv_items(r, S), .prof = P_ROPE};
    if (rec_scan_items(r, S))
        ph[n++] = (Phase){.kind = K_REC_SCAN, .layer = l, .items = rec_scan_items(r, S), .prof = P_ATTN};
    if (r->kind == MIX_MAMBA2) ph[n++] = (Phase){.kind = K_REC_NORM, .layer = l, .items = T, .prof = P_ATTN};
    return n + branch_phases(ph + n, m, buf, P_O | NO_KIND, rec_out(r, &buf->rec), r->out, r->out_fmt, r->out_bias,
                             L->attn_out_norm, T, r->out_k, nthreads);
}

/* What Gemma 4 adds at a layer's end: its per-layer input (gate, act times the layer's slice, proj, norm, added)
 * and its scalar. */
static int layer_end_phases(Phase *ph, const StepModel *m, const StepLayer *L, int l, const Buffers *buf, int T,
                            int nthreads) {
    int n = 0;
    if (L->ple_gate) {
        n += matmul_phases(ph + n, buf, P_GATE_UP | NO_KIND, buf->ple_gate, buf->h, L->ple_gate, L->ple_gate_fmt,
                           NULL, T, m->ple_width, m->hidden, 0, nthreads);
        ph[n++] = (Phase){.kind = K_PLE_ACT, .layer = l, .items = T, .prof = P_ACT};
        n += matmul_phases(ph + n, buf, P_DOWN | NO_KIND, buf->y, buf->ple_gate, L->ple_proj, L->ple_proj_fmt, NULL,
                           T, m->hidden, m->ple_width, 0, nthreads);
        ph[n++] = (Phase){.kind = K_RESID, .items = T, .prof = P_NORM, .out = buf->h, .x = buf->y, .w_norm = L->ple_norm};
    }
    if (L->scalar) ph[n++] = (Phase){.kind = K_LSCALE, .layer = l, .items = T, .prof = P_NORM};
    return n;
}

/* Every phase of the step, in order; returns how many (at most MAX_LAYER_PHASES per layer and 5 more). */
static int plan(Phase *ph, const StepModel *m, const StepLayer *layers, const StepBatch *b, const Buffers *buf,
                int nthreads) {
    const int T = b->T, E = m->hidden, LW = m->layers * m->ple_width;
    int n = 0;
    if (m->embed_scale != 1.0f) ph[n++] = (Phase){.kind = K_SCALE, .items = T, .prof = P_NORM};
    if (m->ple_width) { /* the per-layer inputs, from the scaled embedding and the looked-up table rows */
        n += matmul_phases(ph + n, buf, P_NORM | NO_KIND, buf->ple_proj, buf->h, m->ple_projection,
                           m->ple_projection_fmt, NULL, T, LW, E, 0, nthreads);
        ph[n++] = (Phase){.kind = K_PLE_MIX, .items = T, .prof = P_NORM};
    }
    for (int l = 0; l < m->layers; l++) {
        const StepLayer *L = &layers[l];
        const int I = L->inter, HD = m->heads * L->head_dim, QKV = layer_width(m, L);
        const int N_QKV = (m->heads * (m->attn_gate ? 2 : 1) + L->kv_parts * L->kv_heads) * L->head_dim;
        const int attn_split = attention_split(buf->n_tiles, m->heads, L->kv_heads, nthreads);
        const float *xa = L->attn_norm ? buf->x : buf->h, *xm = L->ffn_norm ? buf->x : buf->h; /* no norm: h */
        if (!L->no_mixer) { /* else a single-block layer's MLP alone */
            if (L->attn_norm) ph[n++] = norm_phase(buf->x, buf->h, L->attn_norm, NULL, T);
            if (L->mixer) {
                n += mixer_phases(ph + n, m, L, l, buf, xa, T, nthreads);
            } else {
                const int k = matmul_phases(ph + n, buf, P_QKV, buf->qkv, xa, L->qkv, L->qkv_fmt, L->qkv_bias, T,
                                            N_QKV, E, 0, nthreads);
                ph[n + k - 1].ldo = QKV;
                n += with_lora(ph + n, k, b, l, LORA_QKV);
                ph[n++] = (Phase){.kind = K_ROPE, .layer = l, .items = T, .prof = P_ROPE};
                ph[n++] = (Phase){.kind = K_ATTN, .layer = l, .items = buf->n_tiles * attn_split, .prof = P_ATTN};
                n += with_lora(ph + n,
                               branch_phases(ph + n, m, buf, P_O, buf->attn, L->o, L->o_fmt, L->o_bias,
                                             L->attn_out_norm, T, HD, nthreads),
                               b, l, LORA_O);
            }
        }
        if (L->no_mlp) { /* a single-block layer's mixer alone */
            n += layer_end_phases(ph + n, m, L, l, buf, T, nthreads);
            continue;
        }
        if (L->ffn_norm) ph[n++] = norm_phase(buf->x, buf->h, L->ffn_norm, NULL, T);
        if (L->moe) {
            n += moe_phases(ph + n, m, L, l, b, buf, xm, T, nthreads);
            n += layer_end_phases(ph + n, m, L, l, buf, T, nthreads);
            continue;
        }
        n += with_lora(ph + n,
                       matmul_phases(ph + n, buf, P_GATE_UP, buf->gu, xm, L->gate_up, L->gate_up_fmt, NULL, T,
                                     (m->act == ACT_RELU2 ? 1 : 2) * I, E, 0, nthreads),
                       b, l, LORA_GATE_UP);
        ph[n++] = (Phase){.kind = K_ACT, .items = T, .prof = P_ACT, .out = buf->act, .x = buf->gu, .N = I};
        n += with_lora(ph + n,
                       branch_phases(ph + n, m, buf, P_DOWN, buf->act, L->down, L->down_fmt, NULL, L->ffn_out_norm,
                                     T, I, nthreads),
                       b, l, LORA_DOWN);
        n += layer_end_phases(ph + n, m, L, l, buf, T, nthreads);
    }
    if (b->R > 0) {
        ph[n++] = norm_phase(buf->x, buf->h, m->final_norm, b->logit_rows, b->R);
        n += matmul_phases(ph + n, buf, P_LM_HEAD, b->logits, buf->x, m->lm_head, m->lm_head_fmt, NULL, b->R,
                           m->vocab, E, 0, nthreads);
        if (m->logit_divisor != 1.0f || m->logit_softcap > 0.0f)
            ph[n++] = (Phase){.kind = K_LOGIT, .items = b->R, .prof = P_LM_HEAD, .out = b->logits};
    }
    return n;
}

/* Token t's q and k normed (q/k norms) and rotated (unless NoPE), then its k and v into the cache at its slot. A
 * quantized cache holds rotated rows (kv_rotate): q, k and v are all rotated here, and attention() rotates the
 * outputs back. */
static void rope_and_store(const StepModel *m, const StepLayer *L, const StepBatch *b, float *qkv, int t) {
    const int D = L->head_dim, H = m->heads, KVH = L->kv_heads, width = layer_width(m, L), R = L->rotary_dim;
    const int KN = L->kv_parts ? KVH : 0; /* the K heads it normalizes and rotates */
    float *row = qkv + (int64_t)t * width;
    if (m->attn_gate) { /* [q_0, gate_0, q_1, gate_1, ..., k, v] -> [q, k, v, gate]: every reader's offsets as ungated */
        float qg[2 * H * D];
        memcpy(qg, row, sizeof qg);
        memmove(row + H * D, row + 2 * H * D, (size_t)2 * KVH * D * sizeof(float));
        for (int h = 0; h < H; h++) {
            memcpy(row + h * D, qg + 2 * h * D, (size_t)D * sizeof(float));
            memcpy(row + (H + 2 * KVH + h) * D, qg + (2 * h + 1) * D, (size_t)D * sizeof(float));
        }
    }
    if (L->kv_parts == 1) /* V is K's projection before K's norm and RoPE */
        memcpy(row + (H + KVH) * D, row + H * D, (size_t)KVH * D * sizeof(float));
    for (int h = 0; L->v_norm && h < KN; h++) {
        float *v = row + (H + KVH + h) * D;
        const float r = rms_inv(v, D, m->eps);
        for (int j = 0; j < D; j++) v[j] *= r;
    }
    if (L->q_norm && L->qk_norm_full) {
        rmsnorm(row, row, L->q_norm, H * D, m->eps);
        if (KN) rmsnorm(row + H * D, row + H * D, L->k_norm, KVH * D, m->eps);
    }
    for (int h = 0; L->q_norm && !L->qk_norm_full && h < H + KN; h++)
        rmsnorm(row + h * D, row + h * D, h < H ? L->q_norm : L->k_norm, D, m->eps);
    if (L->rope != ROPE_NONE) {
        const int local = L->rope == ROPE_LOCAL;
        const float *cos = (local ? m->local_cos : m->cos) + b->positions[t] * R;
        const float *sin = (local ? m->local_sin : m->sin) + b->positions[t] * R;
        for (int h = 0; h < H + KN; h++) rope(row + h * D, cos, sin, R);
    }
    for (int h = 0; m->cache_kind >= KV_INT8 && h < H + 2 * KN; h++) kv_rotate(row + h * D, D);
    if (!L->kv_parts) return; /* it reads an earlier layer's KV */
    const int64_t slot = b->slots[(int64_t)L->group * b->T + t];
    store_row(L->k_cache, slot, row + H * D, KVH, D, m->cache_kind, L->kv_stride);
    store_row(L->v_cache, slot, row + (H + KVH) * D, KVH, D, m->cache_kind, L->kv_stride);
}

/* Row i of the residual add: h += residual_scale * norm(y) (the norm only where the layer has one). */
static void residual_row(const StepModel *m, const Phase *p, int i) {
    const int E = m->hidden;
    const float *y = p->x + (int64_t)i * E, *w = p->w_norm, s = m->residual_scale;
    const float r = w ? rms_inv(y, E, m->eps) : 1.0f;
    float *h = p->out + (int64_t)i * E;
    for (int j = 0; j < E; j++) {
        const float v = w ? w[j] * (y[j] * r) : y[j];
        h[j] += s == 1.0f ? v : v * s;
    }
}

/* Row t of the per-layer inputs: each layer's slice (norm(projection / sqrt(hidden)) + table row * sqrt(width)) /
 * sqrt(2), as PerLayerEmbedding computes it (each product rounded to float32 as torch rounds it). */
static void ple_mix_row(const StepModel *m, const Buffers *buf, int t) {
    const int W = m->ple_width, E = m->hidden;
    const float down = (float)(1.0 / sqrt((double)E)), up = sqrtf((float)W), half = (float)(1.0 / sqrt(2.0));
    for (int l = 0; l < m->layers; l++) {
        float *own = buf->ple + ((int64_t)t * m->layers + l) * W, *proj = buf->ple_proj + ((int64_t)t * m->layers + l) * W;
        for (int j = 0; j < W; j++) proj[j] *= down;
        const float r = rms_inv(proj, W, m->eps);
        for (int j = 0; j < W; j++) own[j] = (m->ple_proj_norm[j] * (proj[j] * r) + own[j] * up) * half;
    }
}

/* Row r of the logits divided by logit_divisor, then soft-capped, as CausalLM._logits does it. */
static void logit_row(const StepModel *m, float *logits, int r) {
    float *z = logits + (int64_t)r * m->vocab;
    const float div = m->logit_divisor, cap = m->logit_softcap;
    for (int j = 0; div != 1.0f && j < m->vocab; j++) z[j] /= div;
    for (int j = 0; cap > 0.0f && j < m->vocab; j++) z[j] = tanhf(z[j] / cap) * cap;
}

/* Item i of `split` per tile (KV heads or query heads): those query heads of the tile's tokens over the
 * sequence's cache through the layer's group's table, each token up to its own position and back no further
 * than the layer's window: paged_attention_heads starts at the block of the tile's first window start, so the
 * null blocks a sliding group holds before its window are never read. */
static void attention(const StepModel *m, const StepLayer *L, const StepBatch *b, const Buffers *buf,
                      const Scratch *sc, int i, int split) {
    const int H = m->heads, KVH = L->kv_heads, D = L->head_dim, width = layer_width(m, L);
    const int tile = i / split, h0 = i % split * (H / split), t = buf->tiles[tile];
    const int end = tile + 1 < buf->n_tiles ? buf->tiles[tile + 1] : b->T;
    const int64_t *table = b->block_tables + ((int64_t)L->group * b->S + b->seq[t]) * b->max_blocks;
    Args a = {buf->attn + (int64_t)t * H * D, buf->qkv + (int64_t)t * width, L->k_cache, L->v_cache,
              table, buf->ctx + t, H, KVH, D, m->block_size, b->max_blocks,
              m->cache_kind, L->scale, 0, end - t, width, H * D, L->window, L->softcap, L->sinks, L->kv_stride};
    paged_attention_heads(&a, 0, h0, h0 + H / split, sc->scores, sc->block);
    for (int u = t; m->cache_kind >= KV_INT8 && u < end; u++)
        for (int h = h0; h < h0 + H / split; h++) kv_rotate(buf->attn + ((int64_t)u * H + h) * D, D);
    for (int u = t; m->attn_gate && u < end; u++) { /* times sigmoid(gate), the gate after q, k, v (rope_and_store) */
        float *o = buf->attn + ((int64_t)u * H + h0) * D;
        const float *g = buf->qkv + (int64_t)u * width + (H + 2 * KVH + h0) * D;
        for (int j = 0; j < H / split * D; j++) o[j] *= 1.0f / (1.0f + expf(-g[j]));
    }
}

/* Split the tokens into attention tiles: runs of consecutive positions of one sequence, at most TILE long. */
static int make_tiles(const StepBatch *b, int *tiles) {
    int n = 0;
    for (int t = 0; t < b->T; t++)
        if (t == 0 || b->seq[t] != b->seq[t - 1] || b->positions[t] != b->positions[t - 1] + 1 || t - tiles[n - 1] == TILE)
            tiles[n++] = t;
    return n;
}

/* a . b over n floats (a multiple of VW), four partial sums so the adds overlap. */
static float dot_f32(const float *a, const float *b, int n) {
    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        s0 += ld(a + i) * ld(b + i);
        s1 += ld(a + i + VW) * ld(b + i + VW);
        s2 += ld(a + i + 2 * VW) * ld(b + i + 2 * VW);
        s3 += ld(a + i + 3 * VW) * ld(b + i + 3 * VW);
    }
    for (; i < n; i += VW) s0 += ld(a + i) * ld(b + i);
    const vf s = (s0 + s1) + (s2 + s3);
    float r = 0.0f;
    for (int l = 0; l < VW; l++) r += s[l];
    return r;
}

/* Whether the grouped router's shape is one topk_row runs: 1 group, or (ROUTE_SIGMOID) at most 64 equal groups of
 * at least 2, topk_group of them holding at least the top k. */
static int bad_groups(const StepModel *m) {
    const int G = m->expert_groups;
    if (G == 1) return 0;
    return G < 1 || G > 64 || m->router != ROUTE_SIGMOID || m->experts % G || m->experts / G < 2 ||
           m->topk_group < 1 || m->topk_group > G || m->topk > m->topk_group * (m->experts / G);
}

/* Item i of the router: token i / chunks, its logits of the chunk i % chunks of ROUTER_EXPERTS experts. */
static void router_item(const StepModel *m, const StepLayer *L, const Buffers *buf, const float *x, int i) {
    const int E = m->hidden, X = m->experts, chunks = ROUTER_CHUNKS(m), t = i / chunks;
    const int e0 = i % chunks * ROUTER_EXPERTS, e1 = e0 + ROUTER_EXPERTS < X ? e0 + ROUTER_EXPERTS : X;
    const float *xt = x + (int64_t)t * E;
    float *logits = buf->rlogits + (int64_t)t * X;
    for (int e = e0; e < e1; e++)
        logits[e] = dot_f32(xt, L->router + (int64_t)e * E, E) + (L->router_bias ? L->router_bias[e] : 0.0f);
}

/* The groups token's experts may come from, as bits (all of them with one group): the topk_group groups whose two
 * largest score + bias sum highest (ties: the lower group), as route() keeps them. */
static uint64_t best_groups(const StepModel *m, const float *scores, const float *bias) {
    const int G = m->expert_groups, per_group = m->experts / G;
    if (G == 1) return 1;
    float sum[64];
    for (int g = 0; g < G; g++) {
        float a = -INFINITY, b = -INFINITY; /* the two largest */
        for (int e = g * per_group; e < (g + 1) * per_group; e++) {
            const float v = scores[e] + (bias ? bias[e] : 0.0f);
            if (v > a) b = a, a = v;
            else if (v > b) b = v;
        }
        sum[g] = a + b;
    }
    uint64_t kept = 0;
    for (int j = 0; j < m->topk_group; j++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!(kept >> g & 1) && (best < 0 || sum[g] > sum[best])) best = g;
        kept |= (uint64_t)1 << best;
    }
    return kept;
}

/* Token t's experts and their weights from its router logits, as moe.py's route() picks them: softmax over
 * every expert's logit, the k largest (ties: the lower id), renormalised to sum 1 when norm_topk
 * (ROUTE_SOFTMAX_TOPK); the k largest logits, softmaxed among themselves (ROUTE_TOPK_SOFTMAX); or sigmoid scores,
 * the k largest of score + the layer's score_bias, weighed by their scores, divided by their sum + 1e-6 when
 * norm_topk, times route_scale (ROUTE_SIGMOID: LFM2-MoE; over groups, from best_groups' only); then each times its expert's expert_scale, where the layer
 * has one (Gemma 4). Also clears the token's row of y, which the routed
 * experts' sum goes into (yl, moe_latent wide, with latent experts). */
static void topk_row(const StepModel *m, const StepLayer *L, const Buffers *buf, int t) {
    const int E = m->hidden, X = m->experts, k = m->topk;
    float *logits = buf->rlogits + (int64_t)t * X;
    if (m->router == ROUTE_SOFTMAX_TOPK) {
        float mx = logits[0], sum = 0.0f;
        for (int e = 1; e < X; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int e = 0; e < X; e++) sum += logits[e] = expf(logits[e] - mx);
        for (int e = 0; e < X; e++) logits[e] /= sum;
    } else if (m->router == ROUTE_SIGMOID) {
        for (int e = 0; e < X; e++) logits[e] = 1.0f / (1.0f + expf(-logits[e]));
    }
    const float *bias = m->router == ROUTE_SIGMOID ? L->score_bias : NULL;
    const uint64_t groups = best_groups(m, logits, bias);
    const int per_group = X / m->expert_groups;
    int64_t *ids = buf->ids + (int64_t)t * k;
    float *w = buf->rw + (int64_t)t * k, total = 0.0f;
    for (int j = 0; j < k; j++) { /* selection: k is small */
        int best = -1;
        float key = 0.0f;
        for (int e = 0; e < X; e++) {
            int taken = !(groups >> (e / per_group) & 1);
            for (int i = 0; i < j && !taken; i++) taken = ids[i] == e;
            const float ke = logits[e] + (bias ? bias[e] : 0.0f);
            if (!taken && (best < 0 || ke > key)) best = e, key = ke;
        }
        ids[j] = best;
        w[j] = logits[best];
    }
    if (m->router == ROUTE_TOPK_SOFTMAX) {
        for (int j = 0; j < k; j++) total += w[j] = expf(w[j] - logits[ids[0]]);
        for (int j = 0; j < k; j++) w[j] /= total;
    } else if (m->norm_topk) {
        for (int j = 0; j < k; j++) total += w[j];
        const float d = m->router == ROUTE_SIGMOID ? total + 1e-6f : total;
        for (int j = 0; j < k; j++) w[j] /= d;
    }
    if (m->router == ROUTE_SIGMOID)
        for (int j = 0; j < k; j++) w[j] *= m->route_scale;
    for (int j = 0; L->expert_scale && j < k; j++) w[j] *= L->expert_scale[ids[j]];
    const int W = m->moe_latent ? m->moe_latent : E;
    memset((m->moe_latent ? buf->yl : buf->y) + (int64_t)t * W, 0, (size_t)W * sizeof(float));
}

/* Row t of y += sigmoid(gate . x) * the shared expert's output (or the output itself, ungated). */
static void shared_row(const StepModel *m, const StepLayer *L, const Buffers *buf, const float *x, int t) {
    const int E = m->hidden;
    const float g = L->shared_gate ? 1.0f / (1.0f + expf(-dot_f32(x + (int64_t)t * E, L->shared_gate, E))) : 1.0f;
    float *y = buf->y + (int64_t)t * E;
    const float *s = buf->sy + (int64_t)t * E;
    for (int j = 0; j < E; j++) y[j] += L->shared_gate ? g * s[j] : s[j];
}

/* Row t of y = moe_out_norm(y) + dense_out_norm(yd): a sparse block's output and the dense MLP's beside it, each
 * normed where the layer has that norm, summed as DecoderLayer._mlp sums them. */
static void beside_row(const StepModel *m, const StepLayer *L, const Buffers *buf, int t) {
    const int E = m->hidden;
    float *y = buf->y + (int64_t)t * E;
    const float *d = buf->yd + (int64_t)t * E, *wy = L->moe_out_norm, *wd = L->dense_out_norm;
    const float ry = wy ? rms_inv(y, E, m->eps) : 1.0f, rd = wd ? rms_inv(d, E, m->eps) : 1.0f;
    for (int j = 0; j < E; j++) y[j] = (wd ? wd[j] * (d[j] * rd) : d[j]) + (wy ? wy[j] * (y[j] * ry) : y[j]);
}

static void matmul_item(const Phase *p, const Buffers *buf, const Scratch *sc, int i) {
    const int units = p->amx ? (p->N + 31) / 32 : (p->N + 15) / 16;
    const int end = (i + 1) * p->per_item < units ? (i + 1) * p->per_item : units;
    if (p->amx) {
        const QMatmulBf16 a = {p->out, buf->xb, p->w, p->bias, p->M, p->N, p->K / 32, p->ldo ? p->ldo : p->N, p->fmt,
                               p->accumulate};
        qmm_bf16_pairs(&a, i * p->per_item, end, sc->bbuf, 0);
        return;
    }
    const QMatmul a = {p->out, p->x, p->w, p->bias, p->M, p->N, p->K / 32, p->K, p->ldo ? p->ldo : p->N, p->fmt,
                       p->accumulate};
    for (int u = i * p->per_item; u < end; u++)
        if (p->i8)
            qi8_column_block(&a, &buf->xq8, u, sc->panel);
        else if (p->dot)
            qdot_column_block(&a, &buf->xq, u, sc->panel);
        else
            qmm_column_block(&a, u, sc->panel);
}

static void run_item(const Phase *p, const StepModel *m, const StepLayer *layers, const StepBatch *b,
                     const Buffers *buf, const Scratch *sc, int i) {
    const int E = m->hidden;
    switch (p->kind) {
    case K_NORM:
        rmsnorm(p->out + (int64_t)i * E, p->x + (p->rows ? p->rows[i] : i) * E, p->w_norm, E, m->eps);
        break;
    case K_CVT:
        qmm_amx_convert_row(buf->xb, p->x + (int64_t)i * p->K, i, p->K / 32);
        break;
    case K_Q16: /* row i of this matmul's x, rows of its own K side by side */
        qdot_quantize_row(buf->xq.q + (int64_t)i * p->K, buf->xq.d + (int64_t)i * (p->K / 32),
                          buf->xq.s + (int64_t)i * (p->K / 16), p->x + (int64_t)i * p->K, p->K);
        break;
    case K_Q8:
        qi8_quantize_row(buf->xq8.q + (int64_t)i * p->K, buf->xq8.d + (int64_t)i * (p->K / 32),
                         buf->xq8.s + (int64_t)i * (p->K / 16), p->x + (int64_t)i * p->K, p->K, 1);
        break;
    case K_MATMUL:
        matmul_item(p, buf, sc, i);
        break;
    case K_ROPE:
        rope_and_store(m, &layers[p->layer], b, buf->qkv, i);
        break;
    case K_ATTN:
        attention(m, &layers[p->layer], b, buf, sc, i, p->items / buf->n_tiles);
        break;
    case K_ACT: /* row i of act(gate) * up, N wide; ungated (ACT_RELU2): relu(up)^2 of a row N wide */
        if (m->act == ACT_RELU2) {
            relu2_row(p->out + (int64_t)i * p->N, p->x + (int64_t)i * p->N, p->N);
            break;
        }
        (m->act == ACT_GELU_TANH ? gelu_tanh_mul : silu_mul)(p->out + (int64_t)i * p->N, p->x + (int64_t)i * 2 * p->N,
                                                             p->x + (int64_t)i * 2 * p->N + p->N, p->N);
        break;
    case K_ROUTE:
        router_item(m, &layers[p->layer], buf, p->x, i);
        break;
    case K_TOPK:
        topk_row(m, &layers[p->layer], buf, i);
        break;
    case K_MOE_GROUP: {
        const StepLayer *L = &layers[p->layer];
        const int status = moe_group(buf->plan, L->moe, buf->ids, b->T, m->topk, L->expert_load);
        if (status && !*buf->moe_status) *buf->moe_status = status;
        if (m->expert_reads) *m->expert_reads += moe_plan_active(buf->plan);
        break;
    }
    case K_MOE_GATHER:
        moe_gather(buf->plan, p->x, i);
        break;
    case K_MOE_GATE_UP:
    case K_MOE_DOWN:
        moe_matmul(buf->plan, p->kind == K_MOE_DOWN, i, sc->panel);
        break;
    case K_MOE_ACT:
        moe_activate(buf->plan, i);
        break;
    case K_MOE_COMBINE:
        moe_combine(buf->plan, p->out, buf->rw, i);
        break;
    case K_SHARED:
        shared_row(m, &layers[p->layer], buf, p->x, i);
        break;
    case K_BESIDE:
        beside_row(m, &layers[p->layer], buf, i);
        break;
    case K_LORA_A:
        lora_shrink(b->lora, p->layer, p->lora, p->x, p->K, i);
        break;
    case K_LORA_B:
        lora_expand(b->lora, p->layer, p->lora, p->out, p->N, p->ldo ? p->ldo : p->N, i);
        break;
    case K_REC_PERM:
        rec_permute(layers[p->layer].mixer, &buf->rec, i);
        break;
    case K_REC_CONV:
        rec_conv(layers[p->layer].mixer, &buf->rec, i);
        break;
    case K_REC_SCAN:
        rec_scan(layers[p->layer].mixer, &buf->rec, i, sc->rec);
        break;
    case K_REC_NORM:
        rec_norm(layers[p->layer].mixer, &buf->rec, i);
        break;
    case K_PLE_MIX:
        ple_mix_row(m, buf, i);
        break;
    case K_PLE_ACT: { /* row i of act(gate) times the layer's slice of the per-layer inputs, in place */
        const int W = m->ple_width;
        float *g = buf->ple_gate + (int64_t)i * W;
        const float *slice = buf->ple + ((int64_t)i * m->layers + p->layer) * W;
        (m->act == ACT_GELU_TANH ? gelu_tanh_mul : silu_mul)(g, g, slice, W);
        break;
    }
    case K_LSCALE: /* row i of h times the layer's scalar */
        for (int j = 0; j < E; j++) buf->h[(int64_t)i * E + j] *= *layers[p->layer].scalar;
        break;
    case K_RESID:
        residual_row(m, p, i);
        break;
    case K_SCALE: /* row i of the embeddings times embed_scale */
        for (int j = 0; j < E; j++) buf->h[(int64_t)i * E + j] *= m->embed_scale;
        break;
    default: /* K_LOGIT */
        logit_row(m, p->out, i);
    }
}

static void pause_cpu(int *spins) {
    if (++*spins > 2000) { /* the item in flight is held by a thread that is not running: give way */
        sched_yield();
        *spins = 0;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* What every thread runs: take items of each phase in turn, wait until the phase is done, go on. */
static void work(const Phase *ph, int n, int *next, int *done, const StepModel *m, const StepLayer *layers,
                 const StepBatch *b, const Buffers *buf, const Scratch *sc, double *clock) {
    for (int p = 0; p < n; p++) {
        int i;
        while ((i = __atomic_fetch_add(&next[p], 1, __ATOMIC_RELAXED)) < ph[p].items) {
            run_item(&ph[p], m, layers, b, buf, sc, i);
            __atomic_fetch_add(&done[p], 1, __ATOMIC_RELEASE);
        }
        int spins = 0;
        while (__atomic_load_n(&done[p], __ATOMIC_ACQUIRE) < ph[p].items) pause_cpu(&spins);
        mark(b, clock, ph[p].prof);
    }
}

/* Every index the step will follow is checked first: 0, or -2 bad sizes, -3 a context longer than its block
 * table, -4 a block id outside the cache, -5 a token id, position, sequence, slot or logit row out of range. */
static int check(const StepModel *m, const StepLayer *layers, const StepBatch *b, const RecStep *rec, int64_t *ctx,
                 int64_t *max_ctx) {
    if (b->T <= 0 || b->R < 0 || b->groups <= 0 || m->heads % m->kv_heads || m->rotary_dim % 2 || m->rotary_dim < 0 ||
        m->rotary_dim > m->head_dim || m->hidden % 32 || m->inter % 32 || m->cache_kind < KV_F32 ||
        (m->ple_width && (m->ple_width % 32 || m->ple_vocab <= 0 || m->residual_scale != 1.0f || !m->ple_proj_norm)) ||
        m->cache_kind > KV_FP8_E5M2 || m->act < ACT_SILU || m->act > ACT_RELU2 ||
        (m->act == ACT_RELU2 && m->ple_width) ||
        (m->experts && (m->topk <= 0 || m->topk > m->experts || m->moe_ffn <= 0 || m->moe_ffn % 32 ||
                        m->shared_inter < 0 || m->shared_inter % 32 || m->router < ROUTE_SOFTMAX_TOPK ||
                        m->router > ROUTE_SIGMOID || bad_groups(m) || m->moe_latent < 0 || m->moe_latent % 32)))
        return -2;
    for (int l = 0; l < m->layers; l++) {
        const StepLayer *L = &layers[l];
        const MoeLayer *moe = L->moe;
        if (L->rope < ROPE_NONE || L->rope > ROPE_LOCAL || (L->rope == ROPE_LOCAL && !m->local_cos) ||
            (L->kv_parts && !L->q_norm != !L->k_norm) || L->group < 0 || L->group >= b->groups ||
            L->head_dim <= 0 || L->head_dim > m->head_dim || L->kv_heads <= 0 || L->kv_heads > m->kv_heads ||
            m->heads % L->kv_heads || L->rotary_dim % 2 || L->rotary_dim < 0 || L->rotary_dim > L->head_dim ||
            L->inter > m->inter || L->inter % 32 || L->kv_parts < 0 || L->kv_parts > 2 ||
            (!L->mixer && !L->no_mixer &&
             L->kv_stride < (int64_t)L->kv_heads *
                                (m->cache_kind >= KV_INT8 ? kv_row_bytes(L->head_dim) : L->head_dim)) ||
            (L->rope != ROPE_NONE && !L->rotary_dim) || !L->ple_gate != !L->ple_proj ||
            (L->ple_gate && (!m->ple_width || !L->ple_norm)) ||
            (!moe && !L->no_mlp && (!L->gate_up || !L->down)) || !L->gate_up != !L->down ||
            (L->gate_up && L->inter <= 0) || (L->no_mixer && (L->no_mlp || L->mixer)) ||
            (moe && (!m->experts || !L->router || moe->experts != m->experts ||
                     moe->hidden != (m->moe_latent ? m->moe_latent : m->hidden) || moe->ffn != m->moe_ffn ||
                     !L->shared_gate_up != !L->shared_down || (L->shared_gate_up && !m->shared_inter) ||
                     !L->latent_in != !m->moe_latent || !L->latent_out != !m->moe_latent)))
            return -2;
        if (L->mixer) {
            const int status = rec ? rec_check(L->mixer, rec, m->hidden) : -2;
            if (status) return status;
        }
    }
    *max_ctx = 0;
    for (int t = 0; t < b->T; t++) {
        const int64_t p = b->positions[t], s = b->seq[t];
        if (b->tokens[t] < 0 || b->tokens[t] >= m->vocab || p < 0 || p >= m->max_positions || s < 0 || s >= b->S ||
            (m->local_cos && p >= m->max_local_positions))
            return -5;
        ctx[t] = p + 1;
        if (ctx[t] > (int64_t)b->max_blocks * m->block_size) return -3;
        if (ctx[t] > *max_ctx) *max_ctx = ctx[t];
        for (int g = 0; g < b->groups; g++) {
            const int64_t slot = b->slots[(int64_t)g * b->T + t];
            const int64_t *table = b->block_tables + ((int64_t)g * b->S + s) * b->max_blocks;
            if (slot < 0 || slot >= m->num_blocks * m->block_size) return -5;
            for (int64_t k = 0; k < (ctx[t] + m->block_size - 1) / m->block_size; k++)
                if (table[k] < 0 || table[k] >= m->num_blocks) return -4;
        }
    }
    for (int r = 0; r < b->R; r++)
        if (b->logit_rows[r] < 0 || b->logit_rows[r] >= b->T) return -5;
    return 0;
}

/* The widest input of a mixer's output projection (0: none). */
static int mixer_k(const StepModel *m, const StepLayer *layers) {
    int k = 0;
    for (int l = 0; l < m->layers; l++) {
        const RecMixer *r = layers[l].mixer;
        if (r && r->out_k > k) k = r->out_k;
    }
    return k;
}

/* The largest scan scratch of the model's mixers, rounded up to 64 bytes for aligned_alloc (0: none). */
static size_t mixer_scratch(const StepModel *m, const StepLayer *layers) {
    int64_t n = 0;
    for (int l = 0; l < m->layers; l++) {
        const RecMixer *r = layers[l].mixer;
        if (r && rec_scratch_bytes(r) > n) n = rec_scratch_bytes(r);
    }
    return (size_t)(n + 63) / 64 * 64;
}

static int run(const StepModel *m, const StepLayer *layers, const StepBatch *b, Buffers *buf, int64_t max_ctx,
               int nthreads) {
    const int E = m->hidden, HD = m->heads * m->head_dim, max_phases = m->layers * MAX_LAYER_PHASES + 5;
    int K = E > m->inter ? (E > HD ? E : HD) : (m->inter > HD ? m->inter : HD);
    K = K > m->moe_ffn ? K : m->moe_ffn;
    K = K > m->shared_inter ? K : m->shared_inter;
    K = K > m->moe_latent ? K : m->moe_latent;
    K = K > mixer_k(m, layers) ? K : mixer_k(m, layers);
    Phase *ph = malloc((size_t)max_phases * sizeof(Phase));
    int *counters = calloc((size_t)2 * max_phases, sizeof(int));
    Scratch *sc = calloc((size_t)nthreads, sizeof(Scratch));
    const size_t rec_bytes = mixer_scratch(m, layers);
    int status = ph && counters && sc ? 0 : -1;
    for (int t = 0; t < nthreads && status == 0; t++) {
        sc[t] = (Scratch){malloc((size_t)K * 16 * sizeof(float)),
                          malloc((size_t)TILE * (max_ctx + TILE) * m->heads * sizeof(float)),
                          malloc((size_t)m->block_size * m->kv_heads * m->head_dim * sizeof(float)),
                          buf->amx_rows ? malloc((size_t)2 * (K / 32) * 512 * sizeof(uint16_t)) : NULL,
                          rec_bytes ? aligned_alloc(64, rec_bytes) : NULL};
        if (!sc[t].panel || !sc[t].scores || !sc[t].block || (buf->amx_rows && !sc[t].bbuf) ||
            (rec_bytes && !sc[t].rec))
            status = -1;
    }
    if (status == 0) {
        const int n = plan(ph, m, layers, b, buf, nthreads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            const int me = omp_thread();
            double start = now(), *clock = b->profile && me == 0 ? &start : NULL;
            if (buf->amx_rows) qmm_amx_begin();
            work(ph, n, counters, counters + max_phases, m, layers, b, buf, &sc[me], clock);
            if (buf->amx_rows) qmm_amx_end();
        }
    }
    for (int t = 0; sc && t < nthreads; t++) {
        free(sc[t].panel);
        free(sc[t].scores);
        free(sc[t].block);
        free(sc[t].bbuf);
        free(sc[t].rec);
    }
    free(sc);
    free(ph);
    free(counters);
    return status;
}

/* The mixers' view of the step (recurrent.h), where a layer has one: each sequence's rows (a sequence's tokens
 * are one run of the flat batch) and state slot, and rows for the widest mixer; else *r stays empty. 0, -1 (out of
 * memory), -2 (no state slots), -5 (a sequence's tokens apart or out of order). */
static int rec_step(const StepModel *m, const StepLayer *layers, const StepBatch *b, RecStep *r, float **mem,
                    int64_t **seqs) {
    int64_t row = 0;
    for (int l = 0; l < m->layers; l++)
        if (layers[l].mixer && rec_row_floats(layers[l].mixer) > row) row = rec_row_floats(layers[l].mixer);
    if (!row) return 0;
    if (!b->state_slots) return -2;
    *seqs = malloc((size_t)2 * b->S * sizeof(int64_t));
    *mem = malloc((size_t)b->T * row * sizeof(float));
    if (!*seqs || !*mem) return -1;
    int64_t *first = *seqs, *len = first + b->S;
    for (int s = 0; s < b->S; s++) len[s] = 0;
    for (int t = 0; t < b->T; t++) {
        const int64_t s = b->seq[t];
        if (s < 0 || s >= b->S || (t > 0 && s != b->seq[t - 1] && len[s])) return -5;
        if (!len[s]++) first[s] = t;
    }
    for (int s = 0; s < b->S; s++)
        if (!len[s]) return -5;
    *r = (RecStep){first, len, b->state_slots, b->positions, b->T, b->S, *mem, b->mark_first, b->mark_at, b->mark_row};
    return 0;
}

/* Whether some sparse layer's experts take the bfloat16 route at T rows (MoeLayer.bf16_min_rows): the plan's room. */
static int moe_bf16(const StepModel *m, const StepLayer *layers, int T) {
    for (int l = 0; l < m->layers; l++) {
        const MoeLayer *L = layers[l].moe;
        if (L && L->bf16_min_rows > 0 && T >= L->bf16_min_rows) return 1;
    }
    return 0;
}

int model_step(const StepModel *m, const StepLayer *layers, const StepBatch *b, int num_threads) {
    const int T = b->T, E = m->hidden, I = m->inter, HD = m->heads * m->head_dim, SI = m->experts ? m->shared_inter : 0;
    const int QKV = qkv_width(m), nthreads = num_threads < 1 ? 1 : num_threads, LAT = m->experts ? m->moe_latent : 0;
    int K = E > I ? (E > HD ? E : HD) : (I > HD ? I : HD);
    K = K > SI ? K : SI;
    K = K > LAT ? K : LAT;
    K = K > mixer_k(m, layers) ? K : mixer_k(m, layers);
    const int amx = m->amx_min_rows > 0 && T >= m->amx_min_rows && qmm_bf16_kind() ? m->amx_min_rows : 0;
    const int64_t per_row = 3 * (int64_t)E + QKV + HD + 3 * (int64_t)I;
    /* a sparse model's rows: rw, sgu, sact, sy, rlogits, yd, xl, yl */
    const int64_t moe_row = m->experts ? 3 * (int64_t)SI + 2 * (int64_t)E + m->topk + m->experts + 2 * (int64_t)LAT : 0;
    float *mem = malloc((size_t)T * (per_row + moe_row) * sizeof(float));
    int64_t *ctx = malloc((size_t)T * sizeof(int64_t));
    int64_t *ids = m->experts ? malloc((size_t)T * (m->topk > 0 ? m->topk : 1) * sizeof(int64_t)) : NULL;
    int *tiles = malloc((size_t)T * sizeof(int));
    uint16_t *xb = amx ? calloc((size_t)(T + 15) / 16 * 16 * K, sizeof(uint16_t)) : NULL;
    const int dot = m->dot != 0;
    XQ16 xq = {dot ? malloc((size_t)T * K * sizeof(int16_t)) : NULL, dot ? malloc((size_t)T * (K / 32) * sizeof(float)) : NULL,
               dot ? malloc((size_t)T * (K / 16) * sizeof(int32_t)) : NULL};
    const int i8 = m->i8_min_rows > 0 && T >= m->i8_min_rows ? m->i8_min_rows : 0;
    XQ8 xq8 = {i8 ? malloc((size_t)T * K) : NULL, i8 ? malloc((size_t)T * (K / 32) * sizeof(float)) : NULL,
               i8 ? malloc((size_t)T * (K / 16) * sizeof(int32_t)) : NULL, 1};
    int64_t max_ctx = 0;
    RecStep rec = {0};
    float *rec_mem = NULL;
    int64_t *seqs = NULL;
    const int64_t LW = (int64_t)m->layers * m->ple_width;
    float *ple = m->ple_width ? malloc((size_t)T * (2 * LW + m->ple_width) * sizeof(float)) : NULL;
    int status = (!mem || !ctx || !tiles || (amx && !xb) || (dot && (!xq.q || !xq.d || !xq.s)) ||
                  (i8 && (!xq8.q || !xq8.d || !xq8.s)) || (m->experts && !ids) || (m->ple_width && !ple))
                     ? -1
                     : rec_step(m, layers, b, &rec, &rec_mem, &seqs);
    if (status == 0) status = check(m, layers, b, rec.S ? &rec : NULL, ctx, &max_ctx);
    if (status == 0 && b->lora) status = lora_check(b->lora, T, m->layers);
    MoePlan *plan = NULL;
    if (status == 0 && m->experts) {
        plan = moe_plan_new(m->experts, T * m->topk, LAT ? LAT : E, m->moe_ffn, dot, m->i8_min_rows > 0,
                            moe_bf16(m, layers, T), nthreads);
        status = plan ? 0 : -1;
    }
    if (status == 0) {
        int moe_status = 0;
        float *moe = mem + (int64_t)T * per_row;
        Buffers buf = {mem, mem + (int64_t)T * E, mem + 2 * (int64_t)T * E, mem + (int64_t)T * (2 * E + QKV),
                       mem + (int64_t)T * (2 * E + QKV + HD), mem + (int64_t)T * (2 * E + QKV + HD + 2 * I),
                       mem + (int64_t)T * (2 * E + QKV + HD + 3 * I), ctx, tiles, make_tiles(b, tiles), xb, amx,
                       xq, dot, xq8, i8, m->i8_kinds, ids, moe, moe + (int64_t)T * m->topk,
                       moe + (int64_t)T * (m->topk + 2 * SI),
                       moe + (int64_t)T * (m->topk + 3 * SI), moe + (int64_t)T * (m->topk + 3 * SI + E), plan,
                       &moe_status, rec, ple, ple + T * LW, ple + 2 * T * LW,
                       moe + (int64_t)T * (m->topk + 3 * SI + E + m->experts),
                       LAT ? moe + (int64_t)T * (m->topk + 3 * SI + 2 * E + m->experts) : NULL,
                       LAT ? moe + (int64_t)T * (m->topk + 3 * SI + 2 * E + m->experts + LAT) : NULL};
        status = qrows_f32(buf.h, b->tokens, T, m->embed, m->vocab, E, m->embed_fmt);
        if (status == 0 && m->ple_width)
            status = qrows_f32(buf.ple, b->tokens, T, m->ple_embed, m->ple_vocab, (int)LW, m->ple_embed_fmt);
        if (status == 0) status = run(m, layers, b, &buf, max_ctx, nthreads);
        if (status == 0) status = moe_status;
    }
    moe_plan_free(plan);
    free(rec_mem);
    free(seqs);
    free(ple);
    free(mem);
    free(ctx);
    free(ids);
    free(tiles);
    free(xb);
    free(xq.q);
    free(xq.d);
    free(xq.s);
    free(xq8.q);
    free(xq8.d);
    free(xq8.s);
    return status;
}
