/*
 * The routed experts of a mixture-of-experts layer for one step, quantized as stored: y[t] += sum_j w_tj
 * expert_{e_tj}(x[t]), expert(x) = down(act(gate_up(x))). The router stays in torch (moe_kernel.py): it is one
 * small matmul and a top-k, and the families differ in it; the experts are where the bytes are.
 *
 * Why: a decode step of a model with 128 experts of which 8 are routed should read 8 experts' weights, not 128
 * (and not 8 gathered copies of them): the top-k experts' matmuls run straight from their stored tiles. With
 * many rows in the step (prefill chunks, batched decode), the rows are grouped by expert so that each routed
 * expert's weights are read once per step for all of its rows (llama.cpp's MUL_MAT_ID, vLLM's fused_moe): a
 * count per expert, prefix sums, and a slot per (token, choice) in expert order; each active expert's rows then
 * are one multi-row matmul through the dense kernels' column-block routes (qmm_f32.c, qmm_dot.c: the dot route or the
 * float32 direct / panel routes, the same ones qmm_dot / qmm_f32 run), in parallel over (expert, column range)
 * work items. A slot's row is computed exactly as a dense matmul computes a row, whatever the other rows of its
 * expert, and each token sums its experts' outputs in its own choice order: a token's result does not depend on
 * what else is in the step, bit for bit. The exception is the opt-in int8 route (qmm_i8.c, MoeLayer.i8_min_rows):
 * as a dense matmul takes it from a row count on, so does an expert's, counting the rows routed to that expert;
 * its rows are then rounded to 8 bits, so a token's numbers depend on how many rows share its experts.
 *
 * The work as phases of independent items (MoePlan, moe.h): grouping (one item), gather x into slot order
 * (rounded for the dot route), gate_up per expert, the activation per slot, down per expert (into the gathered
 * rows' buffer), then per token the weighted sum into y. moe_experts runs them in one OpenMP region; the fused
 * step (model_step.c) runs them as phases of its own step, after its router phase. One allocation per plan.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "quant_matmul.h"
#include "simd.h"
#include "vmath.h"

#ifdef _OPENMP
#include <omp.h>
static int omp_thread(void) { return omp_get_thread_num(); }
#else
static int omp_thread(void) { return 0; }
#endif

/* sizeof a structure of moe.h by name, or -1: moe_kernel.py checks its ctypes copy against it. */
int64_t moe_struct_size(const char *name) { return strcmp(name, "MoeLayer") ? -1 : (int64_t)sizeof(MoeLayer); }

#define ROWS_PER_READ 8 /* the work of reading an expert's weights, in rows of arithmetic: sizes the work items */

struct MoePlan {
    const MoeLayer *L;  /* the layer of the step at hand (moe_group) */
    int E, max_slots, H, F, target; /* what the buffers were sized for: experts, slots, hidden, ffn, ~items */
    int T, topk, S, A;  /* this call's tokens, choices, slots (T * topk; 0 after a failed moe_group), experts used */
    int *off;           /* [experts + 1] the first slot of each expert's rows */
    int *active;        /* [A] the experts with rows, ascending */
    int *row_of;        /* [S] the token of each slot */
    int *slot_of;       /* [T * topk] the slot of each (token, choice) */
    int *items[2];      /* per matmul (gate_up, down): [n][3] active index, chunk, chunks */
    int n_items[2];
    float *xs, *gu, *act; /* xs: [S, hidden] gathered x, then the experts' outputs */
    XQ16 xq;            /* the rows of the matmul at hand rounded for the dot route: [S, max(hidden, ffn)] */
    XQ8 xq8;            /* ... for the int8 route (the rows of experts that take it) */
    int *expert_of;     /* [S] the expert of each slot */
    int bf16;           /* this call's matmuls take the bfloat16 route (moe_group) */
    int *poff;          /* [experts + 1] the bfloat16 rows' offsets: each expert's rows from a multiple of 16 */
    uint16_t *xb;       /* the rows of the matmul at hand as bfloat16 A tiles (qmm_amx_convert_row), per expert */
};

static int fmt_ok(int fmt, int K) { return fmt == QFMT_MIXED || qcol_bytes(fmt, K / 32) > 0; }

/* The rows of an expert's gate_up: gate and up, or up alone (ungated). */
static int gu_rows(const MoeLayer *L) { return L->act == MOE_RELU2 ? L->ffn : 2 * L->ffn; }

static int bad_layer(const MoeLayer *L, int T, int topk) {
    return T <= 0 || topk <= 0 || topk > L->experts || L->hidden <= 0 || L->ffn <= 0 || L->hidden % 32 ||
           L->ffn % 32 || !fmt_ok(L->gate_up_fmt, L->hidden) || !fmt_ok(L->down_fmt, L->ffn) || L->act < MOE_SILU ||
           L->act > MOE_RELU2 || !L->gate_up || !L->down;
}

/* Carves n bytes (64-aligned) off *at. */
static void *carve(uint8_t **at, size_t n) {
    void *r = *at;
    *at += (n + 63) / 64 * 64;
    return r;
}

MoePlan *moe_plan_new(int experts, int max_slots, int hidden, int ffn, int dot, int i8, int bf16, int num_threads) {
    const int E = experts, S = max_slots, H = hidden, F = ffn, K = H > F ? H : F;
    const int target = 8 * (num_threads < 1 ? 1 : num_threads);
    if (E <= 0 || S <= 0 || H <= 0 || F <= 0) return NULL;
    const size_t kq = dot ? (size_t)S * K : 0, k8 = i8 ? (size_t)S * K : 0;
    const size_t kb = bf16 ? ((size_t)S + 16 * (size_t)E) * K : 0; /* each expert's rows padded to a tile */
    const size_t ints = (size_t)3 * E + 2 + 3 * (size_t)S + 6 * ((size_t)E + target);
    const size_t floats = (size_t)S * (H + 3 * (size_t)F);
    const size_t bytes = sizeof(MoePlan) + ints * 4 + floats * 4 + kq * 2 + kq / 32 * 4 + kq / 16 * 4 + k8 +
                         k8 / 32 * 4 + k8 / 16 * 4 + kb * 2 + 22 * 64;
    uint8_t *at = malloc(bytes);
    if (!at) return NULL;
    MoePlan *p = carve(&at, sizeof(MoePlan));
    *p = (MoePlan){.E = E, .max_slots = S, .H = H, .F = F, .target = target};
    p->off = carve(&at, (size_t)(E + 1) * 4);
    p->active = carve(&at, (size_t)E * 4);
    p->row_of = carve(&at, (size_t)S * 4);
    p->slot_of = carve(&at, (size_t)S * 4);
    p->expert_of = carve(&at, (size_t)S * 4);
    p->poff = carve(&at, (size_t)(E + 1) * 4);
    p->xb = bf16 ? carve(&at, kb * 2) : NULL;
    p->items[0] = carve(&at, (size_t)3 * (E + target) * 4);
    p->items[1] = carve(&at, (size_t)3 * (E + target) * 4);
    p->xs = carve(&at, (size_t)S * H * 4);
    p->gu = carve(&at, (size_t)S * 2 * F * 4);
    p->act = carve(&at, (size_t)S * F * 4);
    if (dot) p->xq = (XQ16){carve(&at, kq * 2), carve(&at, kq / 32 * 4), carve(&at, kq / 16 * 4)};
    if (i8) p->xq8 = (XQ8){carve(&at, k8), carve(&at, k8 / 32 * 4), carve(&at, k8 / 16 * 4), 1};
    return p;
}

void moe_plan_free(MoePlan *p) { free(p); }

int moe_plan_items(const MoePlan *p) { return p->E + p->target; }

int moe_plan_active(const MoePlan *p) { return p->A; }

/* Work items of one matmul of NB column blocks: each active expert in chunks of column blocks, about `target`
 * items in all, an expert's share by its rows plus the cost of reading its weights once (a hot expert that
 * takes every row is split, not left to one thread). At most A + target items. */
static int make_items(const MoePlan *p, int NB, int *items) {
    int64_t total = 0;
    for (int a = 0; a < p->A; a++) total += ROWS_PER_READ + p->off[p->active[a] + 1] - p->off[p->active[a]];
    int n = 0;
    for (int a = 0; a < p->A; a++) {
        const int64_t work = ROWS_PER_READ + p->off[p->active[a] + 1] - p->off[p->active[a]];
        int chunks = (int)((p->target * work + total - 1) / total);
        chunks = chunks < 1 ? 1 : chunks > NB ? NB : chunks;
        for (int c = 0; c < chunks; c++, n++) {
            items[3 * n] = a;
            items[3 * n + 1] = c;
            items[3 * n + 2] = chunks;
        }
    }
    return n;
}

/* A matmul's units of work over N columns: column blocks of 16, on the bfloat16 route pairs of them. */
static int units(const MoePlan *p, int N) { return p->bf16 ? (N + 31) / 32 : (N + 15) / 16; }

/* Counts, prefix sums and slots, in token order within each expert; -5 for an id out of range or an active
 * expert without weights. */
static int group_rows(MoePlan *p, const int64_t *ids) {
    const MoeLayer *L = p->L;
    const int n = p->T * p->topk;
    int *fill = p->active; /* the cursor per expert, before it holds the active list */
    memset(p->off, 0, (size_t)(L->experts + 1) * sizeof(int));
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= L->experts) return -5;
        p->off[ids[i] + 1]++;
    }
    p->A = 0;
    for (int e = 0; e < L->experts; e++) {
        if (p->off[e + 1] && (!L->gate_up[e] || !L->down[e])) return -5;
        fill[e] = p->off[e];
        p->off[e + 1] += p->off[e];
    }
    for (int i = 0; i < n; i++) {
        const int s = fill[ids[i]]++;
        p->slot_of[i] = s;
        p->row_of[s] = i / p->topk;
        p->expert_of[s] = (int)ids[i];
    }
    p->poff[0] = 0;
    for (int e = 0; e < L->experts; e++) {
        if (p->off[e + 1] > p->off[e]) p->active[p->A++] = e;
        p->poff[e + 1] = p->poff[e] + (p->off[e + 1] - p->off[e] + 15) / 16 * 16;
    }
    return 0;
}

int moe_group(MoePlan *p, const MoeLayer *L, const int64_t *ids, int T, int topk, int64_t *load) {
    p->L = L, p->T = T, p->topk = topk, p->S = 0, p->A = 0, p->n_items[0] = p->n_items[1] = 0;
    p->bf16 = L->bf16_min_rows > 0 && T >= L->bf16_min_rows && qmm_bf16_kind() > 0;
    if (bad_layer(L, T, topk) || L->experts > p->E || L->hidden != p->H || L->ffn > p->F ||
        T * topk > p->max_slots || (L->dot && !p->xq.q) || (L->i8_min_rows > 0 && T >= L->i8_min_rows && !p->xq8.q) ||
        (p->bf16 && !p->xb))
        return -2;
    const int status = group_rows(p, ids);
    if (status != 0) {
        p->A = 0;
        return status;
    }
    p->S = T * topk;
    p->n_items[0] = make_items(p, units(p, gu_rows(L)), p->items[0]);
    p->n_items[1] = make_items(p, units(p, L->hidden), p->items[1]);
    for (int e = 0; load && e < L->experts; e++) load[e] += p->off[e + 1] - p->off[e];
    return 0;
}

/* Whether expert e's matmul `which` (gate_up 0, down 1) takes the int8 route: rows enough, a format it runs. */
static int on_i8(const MoePlan *p, int e, int which) {
    const MoeLayer *L = p->L;
    return L->i8_min_rows > 0 && p->off[e + 1] - p->off[e] >= L->i8_min_rows &&
           qi8_runs(which ? L->down_fmt : L->gate_up_fmt);
}

/* Row s of matmul `which`'s input rounded for its route (rows K apart, as moe_matmul reads them): the int8
 * route's 8 bits where the slot's expert takes it, else bfloat16 (in A tiles, its expert's from row poff) on
 * the bfloat16 route, else the dot route's 16 (or, float32, as it is). */
static void round_row(const MoePlan *p, const float *row, int s, int which, int K) {
    const int e = p->expert_of[s];
    if (on_i8(p, e, which))
        qi8_quantize_row(p->xq8.q + (int64_t)s * K, p->xq8.d + (int64_t)s * (K / 32),
                         p->xq8.s + (int64_t)s * (K / 16), row, K, 1);
    else if (p->bf16)
        qmm_amx_convert_row(p->xb, row, p->poff[e] + s - p->off[e], K / 32);
    else if (p->L->dot)
        qdot_quantize_row(p->xq.q + (int64_t)s * K, p->xq.d + (int64_t)s * (K / 32),
                          p->xq.s + (int64_t)s * (K / 16), row, K);
}

void moe_gather(const MoePlan *p, const float *x, int s) {
    if (s >= p->S) return;
    const int H = p->L->hidden;
    float *row = p->xs + (int64_t)s * H;
    memcpy(row, x + (int64_t)p->row_of[s] * H, (size_t)H * sizeof(float));
    round_row(p, row, s, 0, H);
}

void moe_matmul(const MoePlan *p, int which, int i, float *panel) {
    if (i >= p->n_items[which]) return;
    const MoeLayer *L = p->L;
    const int *it = p->items[which] + 3 * i, e = p->active[it[0]], m0 = p->off[e], M = p->off[e + 1] - m0;
    const int N = which ? L->hidden : gu_rows(L), K = which ? L->ffn : L->hidden, NB = units(p, N);
    const float *bias = which ? L->down_bias : L->gate_up_bias;
    const QMatmul a = {which ? p->xs + (int64_t)m0 * N : p->gu + (int64_t)m0 * N,
                       which ? p->act + (int64_t)m0 * K : p->xs + (int64_t)m0 * K,
                       which ? L->down[e] : L->gate_up[e],
                       bias ? bias + (int64_t)e * N : NULL,
                       M, N, K / 32, K, N, which ? L->down_fmt : L->gate_up_fmt, 0};
    const XQ16 xq = {p->xq.q + (int64_t)m0 * K, p->xq.d + (int64_t)m0 * (K / 32), p->xq.s + (int64_t)m0 * (K / 16)};
    const XQ8 xq8 = {p->xq8.q + (int64_t)m0 * K, p->xq8.d + (int64_t)m0 * (K / 32), p->xq8.s + (int64_t)m0 * (K / 16),
                     1};
    const int i8 = on_i8(p, e, which);
    if (!i8 && p->bf16) { /* units are column block pairs; `panel` holds the pair's 2 G * 512 bfloat16 */
        const QMatmulBf16 b = {a.out, p->xb + (int64_t)p->poff[e] * K, a.w, a.bias, M, N, K / 32, N, a.fmt, 0};
        qmm_bf16_pairs(&b, it[1] * NB / it[2], (it[1] + 1) * NB / it[2], (uint16_t *)panel, 1);
        return;
    }
    for (int cb = it[1] * NB / it[2]; cb < (it[1] + 1) * NB / it[2]; cb++)
        if (i8)
            qi8_column_block(&a, &xq8, cb, panel);
        else if (L->dot)
            qdot_column_block(&a, &xq, cb, panel);
        else
            qmm_column_block(&a, cb, panel);
}

/* out = act(gate, up) over n (a multiple of VW) elements (MOE_RELU2: relu(up)^2, `gate` unread); the formulas are
 * transformers' in float32. */
static void activate(const MoeLayer *L, float *out, const float *gate, const float *up, int n) {
    for (int j = 0; j < n; j += VW) {
        vf g = *(const vfu *)(gate + j), u = *(const vfu *)(up + j), r;
        if (L->act == MOE_RELU2) {
            u = vmax(u, (vf){0});
            r = u * u;
        } else if (L->act == MOE_SILU) {
            r = g / (1.0f + vexp(-g)) * u;
        } else if (L->act == MOE_GELU_TANH) { /* 0.5 g (1 + tanh(z)), tanh(z) = 1 - 2 / (e^2z + 1) */
            const vf z = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
            r = 0.5f * g * (1.0f + (1.0f - 2.0f / (vexp(2.0f * z) + 1.0f))) * u;
        } else {
            const vf lim = (vf){0} + L->limit;
            g = vmin(g, lim);
            u = vmax(vmin(u, lim), -lim);
            r = (u + 1.0f) * (g * (1.0f / (1.0f + vexp(-(g * L->alpha)))));
        }
        *(vfu *)(out + j) = r;
    }
}

void moe_activate(const MoePlan *p, int s) {
    if (s >= p->S) return;
    const int F = p->L->ffn, N = gu_rows(p->L);
    const float *gu = p->gu + (int64_t)s * N;
    activate(p->L, p->act + (int64_t)s * F, gu, gu + N - F, F);
    round_row(p, p->act + (int64_t)s * F, s, 1, F);
}

void moe_combine(const MoePlan *p, float *y, const float *weights, int t) {
    if (t >= p->T || !p->S) return;
    const int H = p->L->hidden, topk = p->topk;
    float *yt = y + (int64_t)t * H;
    for (int i = 0; i < H; i += VW) {
        vf acc = (vf){0};
        for (int j = 0; j < topk; j++)
            acc += weights[(int64_t)t * topk + j] * *(const vfu *)(p->xs + (int64_t)p->slot_of[t * topk + j] * H + i);
        *(vfu *)(yt + i) = *(const vfu *)(yt + i) + acc;
    }
}

int moe_experts(float *y, const float *x, const int64_t *ids, const float *weights, int T, int topk,
                const MoeLayer *L, int64_t *load, int num_threads) {
    if (bad_layer(L, T, topk)) return -2;
    const int nthreads = num_threads < 1 ? 1 : num_threads, K = L->hidden > L->ffn ? L->hidden : L->ffn;
    MoePlan *p = moe_plan_new(L->experts, T * topk, L->hidden, L->ffn, L->dot, L->i8_min_rows > 0 && T >= L->i8_min_rows,
                              L->bf16_min_rows > 0 && T >= L->bf16_min_rows, nthreads);
    float *panels = malloc((size_t)nthreads * K * 16 * sizeof(float));
    int status = p && panels ? moe_group(p, L, ids, T, topk, load) : -1;
    if (status == 0) {
        const int S = p->S, n0 = p->n_items[0], n1 = p->n_items[1];
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            float *panel = panels + (int64_t)omp_thread() * K * 16;
#pragma omp for schedule(static)
            for (int s = 0; s < S; s++) moe_gather(p, x, s);
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < n0; i++) moe_matmul(p, 0, i, panel);
#pragma omp for schedule(static)
            for (int s = 0; s < S; s++) moe_activate(p, s);
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < n1; i++) moe_matmul(p, 1, i, panel);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) moe_combine(p, y, weights, t);
        }
    }
    moe_plan_free(p);
    free(panels);
    return status;
}
