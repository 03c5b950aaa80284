/*
 * The recurrent mixers of a hybrid model's linear layers as work items of the fused step (model_step.c runs their
 * matmuls; recurrent.h lays out the rows): the causal depthwise conv over the last K-1 inputs each sequence keeps,
 * then Gated DeltaNet's delta rule or Mamba2's SSM over the float32 state, then the gated norm; LFM2's short conv
 * is the conv alone, gated. Each layer's states are read and written in place in their slot: model_step.c checks
 * everything a step follows before its first phase, so no step stops midway with a state half advanced.
 *
 * Prompt rows take a chunked scan, everything else the token loop (decode, short sequences, heads wider than
 * SCAN_HEAD): Gated DeltaNet's from SCAN_MIN_TOKENS tokens (deltanet_chunked: deltanet.py's WY form in 64-token
 * chunks), Mamba2's from MAMBA2_MIN_TOKENS (mamba2_chunked: mamba2.py's SSD form, as many chunks). Why, measured
 * (benchmarks/kernels/recurrent_scan.py, one thread, CPU time, AMD EPYC Zen 5, docs/benchmarks.md "The fused
 * step's Gated DeltaNet recurrence" and "... Mamba2 recurrence"): a token of one DeltaNet head in the loop is
 * Dk x Dv multiply-adds that read and write the whole state (64 KiB at 128 x 128, past L1) twice; the chunked
 * scan does about as many multiply-adds per token, as products register-blocked over a chunk, the state read
 * twice and written once per chunk. At Qwen3.5's shapes it is ~2x the loop with AVX-512 from 64 tokens up (1.6x
 * to 2.5x on a shared machine), 1.2-1.5x with AVX2 at 256 and 1024 tokens, 1.4x at 8 tokens; at 1-2 tokens the
 * loop is as fast or faster (a chunk's fixed work: the transposed keys, the decays), so shorter sequences keep
 * it. The recurrence was ~6-7% of a Qwen3.5-2B-shaped prefill step with the loop, ~3.5% now. A Mamba2 token of
 * a 64 x 128 head is 2 P N multiply-adds in the loop (its 32 KiB state stays in L1, but each is a store and a
 * load of the state, and each channel ends in a horizontal sum); the SSD form does ~1.7x as many (the scores C
 * B^T, C S0^T, the scores times x, the state's update: 4 products of about P N each per token) register-blocked,
 * and is ~1.6-1.8x the loop with AVX-512 and ~1.1-1.2x with AVX2 from 16 tokens up at Granite-4.0-H-Tiny's and
 * Nemotron-H's shapes, 0.8-0.9x at 8 and 0.25x at 1 (a chunk's fixed work: the transposes, the state copied in
 * and out). The scans' numbers are the token loops' up to the order of the sums (the same recurrence,
 * reassociated, as the torch path's chunked scans are). A prompt chunk's prefix-cache checkpoints (RecStep's
 * marks, --mamba-cache-mode all) end a scan chunk, so the state after t tokens is exact there and copied to its
 * row.
 *
 * Numerics follow the torch path in float32: softplus with torch's threshold of 20, sigmoid(b), l2norm x *
 * rsqrt(sum(x^2) + 1e-6), RMS norms x * rsqrt(mean(x^2) + eps) * w, silu(z) = z sigmoid(z).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "recurrent.h"
#include "simd.h"
#include "vmath.h"

#define CONV_CH 64   /* channels per conv work item */
#define MAX_KEEP 15  /* the longest conv state (kernel - 1) */
#define MAX_HEAD 512 /* the widest head (dk, dv) the token loop keeps on its stack */

int64_t rec_struct_size(const char *name) {
    if (!strcmp(name, "RecMixer")) return sizeof(RecMixer);
    if (!strcmp(name, "RecStep")) return sizeof(RecStep);
    return -1;
}

int64_t rec_row_floats(const RecMixer *r) {
    return 2 * (int64_t)r->width + r->conv_dim + r->out_k;
}

/* The rows of a step's layer (RecStep): raw, canonical, conv, out, one after the other. */
static float *raw_rows(const RecStep *s) { return s->rows; }
static float *canon_rows(const RecMixer *r, const RecStep *s) {
    return r->perm ? s->rows + (int64_t)s->T * r->width : s->rows;
}
static float *conv_rows(const RecMixer *r, const RecStep *s) { return s->rows + 2 * (int64_t)s->T * r->width; }
float *rec_out(const RecMixer *r, const RecStep *s) { return conv_rows(r, s) + (int64_t)s->T * r->conv_dim; }

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static float silu(float x) { return x / (1.0f + expf(-x)); }

static float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 64)
                                         : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* The step's marks (RecStep): offsets ascending inside their sequence, rows in range, apart from each other and
 * from every slot the step reads (a mark's row is written while the other sequences still read theirs). */
static int marks_check(const RecMixer *r, const RecStep *s) {
    if (!s->mark_first) return 0;
    if (s->mark_first[0] != 0) return -5;
    for (int q = 0; q < s->S; q++) {
        if (s->mark_first[q + 1] < s->mark_first[q]) return -5;
        for (int64_t j = s->mark_first[q]; j < s->mark_first[q + 1]; j++) {
            const int64_t at = s->mark_at[j], row = s->mark_row[j];
            if (at <= (j > s->mark_first[q] ? s->mark_at[j - 1] : 0) || at >= s->len[q] || row < 0 || row >= r->slots)
                return -5;
            for (int p = 0; p < s->S; p++)
                if (s->slot[p] == row) return -5;
            for (int64_t i = 0; i < j; i++)
                if (s->mark_row[i] == row) return -5;
        }
    }
    return 0;
}

int rec_check(const RecMixer *r, const RecStep *s, int hidden) {
    const int keep = r->kernel - 1;
    if (r->kind < MIX_GATED_DELTANET || r->kind > MIX_SHORT_CONV || keep < 0 || keep > MAX_KEEP ||
        r->n_in < 1 || r->n_in > 4 || !r->conv_w || !r->conv_state || r->out_k % 32 || r->heads < 1 ||
        r->groups < 1 || r->heads % r->groups || r->dk < 1 || r->dv < 1 || r->dk > MAX_HEAD || r->dv > MAX_HEAD)
        return -2;
    int64_t n = 0;
    for (int i = 0; i < r->n_in; i++) n += r->in_n[i];
    if (n != r->width) return -2;
    const int64_t value = (int64_t)r->heads * r->dv;
    if (r->kind == MIX_GATED_DELTANET &&
        (r->conv_dim != 2 * r->groups * r->dk + value || r->width != r->conv_dim + value + 2 * r->heads ||
         r->out_k != value || !r->rec_state || !r->a_log || !r->dt_bias || !r->norm))
        return -2;
    /* Mamba2's state is [heads, head dim, state size]: dk = head dim, dv = state size */
    const int64_t inner = (int64_t)r->heads * r->dk;
    if (r->kind == MIX_MAMBA2 &&
        (r->conv_dim != inner + 2 * r->groups * r->dv || r->width != inner + r->conv_dim + r->heads ||
         r->out_k != inner || !r->rec_state || !r->a_log || !r->dt_bias || !r->d || !r->norm || inner % r->groups))
        return -2;
    if (r->kind == MIX_SHORT_CONV && (r->width != 3 * r->conv_dim || r->out_k != r->conv_dim || r->conv_dim != hidden))
        return -2;
    for (int q = 0; q < s->S; q++) {
        if (s->slot[q] < 0 || s->slot[q] >= r->slots) return -5;
        for (int p = 0; p < q; p++)
            if (s->slot[p] == s->slot[q]) return -5;
    }
    return marks_check(r, s);
}

int rec_conv_items(const RecMixer *r, int S) { return S * ((r->conv_dim + CONV_CH - 1) / CONV_CH); }

int rec_scan_items(const RecMixer *r, int S) { return r->kind == MIX_SHORT_CONV ? 0 : S * r->heads; }

/* Row t's projections in the canonical order (recurrent.h). */
void rec_permute(const RecMixer *r, const RecStep *s, int t) {
    const float *raw = raw_rows(s) + (int64_t)t * r->width;
    float *canon = canon_rows(r, s) + (int64_t)t * r->width;
    for (int j = 0; j < r->width; j++) canon[j] = raw[r->perm[j]];
}

/* A conv item's state (its n channels' last K-1 inputs, hist[0 .. K-1)) into the conv state at `base`: a slot's
 * row, or a mark's. */
static void store_conv(const RecMixer *r, int64_t base, float hist[][CONV_CH], int n) {
    const int keep = r->kernel - 1;
    for (int c = 0; c < n; c++)
        for (int k = 0; k < keep; k++) {
            const int64_t at = base + (int64_t)c * keep + k;
            if (r->conv_bf16)
                ((uint16_t *)r->conv_state)[at] = f32_to_bf16(hist[k][c]);
            else
                ((float *)r->conv_state)[at] = hist[k][c];
        }
}

/* Item i: one sequence's tokens through the causal conv for a chunk of CONV_CH channels, its conv state (in the
 * slot, zeros for a sequence at position 0) advanced in place. Gated DeltaNet and Mamba2: silu(conv) into the
 * conv rows; short conv: C * conv(B * x) into the output rows. The sum runs over the window in order, then the
 * bias: (window * w).sum(-1) + bias, as causal_conv.py computes a decode token. */
void rec_conv(const RecMixer *r, const RecStep *s, int i) {
    const int chunks = (r->conv_dim + CONV_CH - 1) / CONV_CH, q = i / chunks, c0 = i % chunks * CONV_CH;
    const int C = r->conv_dim, K = r->kernel, keep = K - 1, n = C - c0 < CONV_CH ? C - c0 : CONV_CH;
    const int64_t slot = s->slot[q], t0 = s->first[q], t1 = t0 + s->len[q];
    const int fresh = s->positions[t0] == 0, shortconv = r->kind == MIX_SHORT_CONV;
    const int in_off = r->kind == MIX_MAMBA2 ? r->heads * r->dk : shortconv ? 2 * C : 0;
    float hist[MAX_KEEP + 1][CONV_CH], w[MAX_KEEP + 1][CONV_CH], acc[CONV_CH];
    for (int c = 0; c < n; c++)
        for (int k = 0; k < K; k++) w[k][c] = r->conv_w[(int64_t)(c0 + c) * K + k];
    const int64_t base = (slot * C + c0) * keep;
    int64_t mark = s->mark_first ? s->mark_first[q] : 0;
    const int64_t mark_end = s->mark_first ? s->mark_first[q + 1] : 0;
    for (int c = 0; c < n; c++)
        for (int k = 0; k < keep; k++)
            hist[k][c] = fresh ? 0.0f
                         : r->conv_bf16 ? bf16_to_f32(((const uint16_t *)r->conv_state)[base + (int64_t)c * keep + k])
                                        : ((const float *)r->conv_state)[base + (int64_t)c * keep + k];
    for (int64_t t = t0; t < t1; t++) {
        const float *row = canon_rows(r, s) + t * r->width;
        float *in = hist[keep];
        for (int c = 0; c < n; c++) in[c] = shortconv ? row[c0 + c] * row[in_off + c0 + c] : row[in_off + c0 + c];
        for (int c = 0; c < n; c++) acc[c] = w[0][c] * hist[0][c];
        for (int k = 1; k < K; k++)
            for (int c = 0; c < n; c++) acc[c] += w[k][c] * hist[k][c];
        if (r->conv_b)
            for (int c = 0; c < n; c++) acc[c] += r->conv_b[c0 + c];
        if (shortconv) {
            float *out = rec_out(r, s) + t * C + c0;
            for (int c = 0; c < n; c++) out[c] = row[C + c0 + c] * acc[c];
        } else {
            float *out = conv_rows(r, s) + t * C + c0;
            for (int c = 0; c < n; c++) out[c] = silu(acc[c]);
        }
        for (int k = 0; k < keep; k++) memcpy(hist[k], hist[k + 1], (size_t)n * sizeof(float));
        if (mark < mark_end && s->mark_at[mark] == t + 1 - t0) /* a checkpoint after these t + 1 - t0 tokens */
            store_conv(r, (s->mark_row[mark++] * C + c0) * keep, hist, n);
    }
    store_conv(r, base, hist, n);
}

/* The sum of x[j]^2 over n floats, in VW lanes (a float sum is one chain of dependent adds: 4 cycles a float). */
static float sum_squares(const float *x, int n) {
    vf acc = {0};
    int j = 0;
    for (; j + VW <= n; j += VW) acc += ld(x + j) * ld(x + j);
    float ss = hsum(acc);
    for (; j < n; j++) ss += x[j] * x[j];
    return ss;
}

/* x / |x| over n floats, as l2norm: x * rsqrt(sum(x^2) + 1e-6), times `scale`. */
static void l2norm(float *out, const float *x, int n, float scale) {
    const float r = 1.0f / sqrtf(sum_squares(x, n) + 1e-6f);
    for (int j = 0; j < n; j++) out[j] = x[j] * r * scale;
}

/* A DeltaNet head's read-out o (dv floats) RMS-normed, times the norm's weight and silu(z), into `out` (which may
 * be o itself). silu by vexp: libm's expf per value took a third of a 256-token prompt's recurrence. */
static void gated_norm(const RecMixer *r, float *out, const float *o, const float *z) {
    const int dv = r->dv;
    const float rn = 1.0f / sqrtf(sum_squares(o, dv) / (float)dv + r->eps);
    int j = 0;
    for (; j + VW <= dv; j += VW) {
        const vf zj = ld(z + j);
        st(out + j, ld(r->norm + j) * (ld(o + j) * rn) * (zj / (1.0f + vexp(-zj))));
    }
    for (; j < dv; j++) out[j] = r->norm[j] * (o[j] * rn) * silu(z[j]);
}

/* One token of Gated DeltaNet's value head h: the state [dk, dv] decayed by exp(g), corrected toward v by beta
 * along k (the delta rule), read by q; then the head's RMS norm times silu(z) into `out`. */
static void deltanet_token(const RecMixer *r, float *st, const float *conv, const float *row, int h, float *out) {
    const int dk = r->dk, dv = r->dv, kh = r->tiled ? h % r->groups : h / (r->heads / r->groups), key = r->groups * dk;
    const int value = r->heads * dv, C = r->conv_dim;
    float q[MAX_HEAD], k[MAX_HEAD], mem[MAX_HEAD], o[MAX_HEAD];
    l2norm(q, conv + kh * dk, dk, 1.0f / sqrtf((float)dk));
    l2norm(k, conv + key + kh * dk, dk, 1.0f);
    const float *v = conv + 2 * key + h * dv, *z = row + C + h * dv;
    const float beta = sigmoid(row[C + value + h]);
    const float decay = expf(-expf(r->a_log[h]) * softplus(row[C + value + r->heads + h] + r->dt_bias[h]));
    for (int j = 0; j < dv; j++) mem[j] = 0.0f;
    for (int a = 0; a < dk; a++) {
        float *srow = st + (int64_t)a * dv;
        const float ka = k[a];
        for (int j = 0; j < dv; j++) {
            srow[j] *= decay;
            mem[j] += srow[j] * ka;
        }
    }
    for (int j = 0; j < dv; j++) {
        mem[j] = (v[j] - mem[j]) * beta; /* the delta */
        o[j] = 0.0f;
    }
    for (int a = 0; a < dk; a++) {
        float *srow = st + (int64_t)a * dv;
        const float ka = k[a], qa = q[a];
        for (int j = 0; j < dv; j++) {
            srow[j] += ka * mem[j];
            o[j] += srow[j] * qa;
        }
    }
    gated_norm(r, out, o, z);
}

/* One token of Mamba2's head h: the state [head dim, state size] decayed by exp(dt A), plus dt x B^T; y = state C
 * + D x into `out` (before the gated norm, rec_norm). */
static void mamba2_token(const RecMixer *r, float *state, const float *conv, const float *row, int h, float *out) {
    const int P = r->dk, N = r->dv, g = h / (r->heads / r->groups), inner = r->heads * P;
    const float *x = conv + h * P, *B = conv + inner + g * N, *Cm = conv + inner + r->groups * N + g * N;
    float dt = softplus(row[inner + r->conv_dim + h] + r->dt_bias[h]);
    dt = dt < r->dt_min ? r->dt_min : dt > r->dt_max ? r->dt_max : dt;
    const float decay = expf(dt * -expf(r->a_log[h])), D = r->d[h];
    for (int p = 0; p < P; p++) {
        float *srow = state + (int64_t)p * N;
        const float xp = dt * x[p];
        vf accv = {0}; /* the read-out's sum in VW lanes (a float sum does not vectorize by itself) */
        int j = 0;
        for (; j + VW <= N; j += VW) {
            const vf s = ld(srow + j) * decay + xp * ld(B + j);
            st(srow + j, s);
            accv += s * ld(Cm + j);
        }
        float acc = 0.0f;
        for (int l = 0; l < VW; l++) acc += accv[l];
        for (; j < N; j++) {
            srow[j] = srow[j] * decay + xp * B[j];
            acc += srow[j] * Cm[j];
        }
        out[p] = acc + x[p] * D;
    }
}

/* ---- Gated DeltaNet's chunked scan ----------------------------------------------------------------------------
 * A prompt's tokens in chunks of up to SCAN_CHUNK (ending at each mark too, so that the state there is exact),
 * deltanet.py's chunked (WY) form with the chunk's state S0 [dk, dv]: cum_i the chunk's cumulative log decay up
 * to token i, the strictly lower system A_ij = beta_i (k_i . k_j) e^(cum_i - cum_j), the corrected values
 * u = (I + A)^-1 beta (v - e^cum (K S0)) by forward substitution (v_new of deltanet.py: its values - k_cumdecay
 * S0, one solve instead of two), out_i = e^cum_i q_i S0 + sum_{j <= i} e^(cum_i - cum_j) (q_i . k_j) u_j, and
 * S = e^cum_last S0 + sum_j e^(cum_last - cum_j) k_j^T u_j. The products are register-blocked (mm_rows): the
 * state is read twice and written once per chunk instead of read and written twice per token. */

#define SCAN_CHUNK 64 /* tokens per chunk (deltanet.py's CHUNK); a multiple of VW */
#define SCAN_MIN_TOKENS 4 /* a sequence's tokens from which it takes the chunked scan (measured: see the top) */
#define MAMBA2_MIN_TOKENS 16 /* ... Mamba2's (at 8 tokens 0.8-0.9x the loop, at 16 1.1-1.2x: AVX-512, AVX2) */
#define SCAN_HEAD 128 /* the widest head (DeltaNet's dk, dv; Mamba2's P, N) the chunked scans' scratch holds; wider
                       * ones take the token loop */
#define SCAN_LD (SCAN_HEAD + 16) /* the scratch rows' stride: 576 bytes, so that a column slice of 128 rows
                                   * spreads over L1's sets (at 512 bytes it fell into a third of them) */
#define MM_ROWS 4     /* mm_rows' block: MM_ROWS rows x MM_VECS vectors of accumulators in registers */
#if VW == 16
#define MM_VECS 4 /* 16 of AVX-512's 32 registers */
#else
#define MM_VECS 2 /* 8 of AVX2's 16 */
#endif
#define SUB_VECS 4 /* the substitution's columns per pass: 2 x 4 accumulators */

/* out[i][c] = (acc ? keep * out[i][c] : 0) + sum_a x[i][a] b[a][c], for i < rows, c < cols. */
static void mm_rows(float *out, int ldo, const float *x, int ldx, int rows, const float *b, int ldb, int kdim,
                    int cols, float keep, int acc) {
    const vf zero = {0};
    int c = 0;
    /* column blocks outside, rows inside: a block's slice of b (kdim x MM_VECS vectors: 32 KiB of a 128 x 128
     * state) stays in L1 while every row block reads it, where rows outside read the whole state from L2 for
     * each block of rows */
    for (; c + MM_VECS * VW <= cols; c += MM_VECS * VW)
        for (int i = 0; i < rows; i += MM_ROWS) {
            int at[MM_ROWS]; /* a short block's missing rows repeat its first (computed, not stored) */
            for (int m = 0; m < MM_ROWS; m++) at[m] = i + m < rows ? i + m : i;
            const int nr = rows - i < MM_ROWS ? rows - i : MM_ROWS;
            vf sum[MM_ROWS][MM_VECS];
            for (int m = 0; m < MM_ROWS; m++)
                for (int v = 0; v < MM_VECS; v++)
                    sum[m][v] = acc ? keep * ld(out + (int64_t)at[m] * ldo + c + v * VW) : zero;
            for (int a = 0; a < kdim; a++) {
                vf bv[MM_VECS];
                for (int v = 0; v < MM_VECS; v++) bv[v] = ld(b + (int64_t)a * ldb + c + v * VW);
                for (int m = 0; m < MM_ROWS; m++) {
                    const float xm = x[(int64_t)at[m] * ldx + a];
                    for (int v = 0; v < MM_VECS; v++) sum[m][v] += xm * bv[v];
                }
            }
            for (int m = 0; m < nr; m++)
                for (int v = 0; v < MM_VECS; v++) st(out + (int64_t)(i + m) * ldo + c + v * VW, sum[m][v]);
        }
    for (; c + VW <= cols; c += VW)
        for (int i = 0; i < rows; i += MM_ROWS) {
            int at[MM_ROWS];
            for (int m = 0; m < MM_ROWS; m++) at[m] = i + m < rows ? i + m : i;
            const int nr = rows - i < MM_ROWS ? rows - i : MM_ROWS;
            vf sum[MM_ROWS];
            for (int m = 0; m < MM_ROWS; m++) sum[m] = acc ? keep * ld(out + (int64_t)at[m] * ldo + c) : zero;
            for (int a = 0; a < kdim; a++) {
                const vf bv = ld(b + (int64_t)a * ldb + c);
                for (int m = 0; m < MM_ROWS; m++) sum[m] += x[(int64_t)at[m] * ldx + a] * bv;
            }
            for (int m = 0; m < nr; m++) st(out + (int64_t)(i + m) * ldo + c, sum[m]);
        }
    for (; c < cols; c++)
        for (int i = 0; i < rows; i++) {
            float sum = acc ? keep * out[(int64_t)i * ldo + c] : 0.0f;
            for (int a = 0; a < kdim; a++) sum += x[(int64_t)i * ldx + a] * b[(int64_t)a * ldb + c];
            out[(int64_t)i * ldo + c] = sum;
        }
}

/* A chunk's scratch (a thread's, rec_scratch_bytes: ~320 KiB, past the stack a thread may get: musl's 128 KiB, a
 * small OMP_STACKSIZE): rows 0..n-1 of kq the keys, n..2n-1 the queries (l2-normed, the queries scaled); kt the keys
 * transposed (zeros past n; scaled by e^(cum_last - cum_j) for the state's update); ks rows K S0 then Q S0; w rows
 * K K^T then Q K^T, made A then the decayed causal scores in place; u the corrected values. */
typedef struct {
    float kq[2 * SCAN_CHUNK][SCAN_LD], kt[SCAN_HEAD][SCAN_CHUNK], ks[2 * SCAN_CHUNK][SCAN_LD], s[SCAN_HEAD][SCAN_LD];
    float w[2 * SCAN_CHUNK][SCAN_CHUNK], u[SCAN_CHUNK][SCAN_LD], beta[SCAN_CHUNK], cum[SCAN_CHUNK];
} ScanChunk;

/* Columns c .. c + nv VW of the chunk's substitution and read-out, row after row (row i needs u_j, j < i, of the
 * same columns only): u_i = beta_i (v_i - e^cum_i (K S0)_i) - sum_{j<i} A_ij u_j, then out_i = e^cum_i (Q S0)_i +
 * sum_{j<=i} D_ij u_j. nv is a constant at each call (inlined), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void subst_vecs(ScanChunk *w, int n, int c, int nv, const float *v0,
                                                            int64_t ldv, float *o0, int64_t ldo) {
    for (int i = 0; i < n; i++) {
        const float e = expf(w->cum[i]), b = w->beta[i];
        vf su[SUB_VECS], so[SUB_VECS];
        for (int x = 0; x < nv; x++) {
            su[x] = b * (ld(v0 + i * ldv + c + x * VW) - e * ld(w->ks[i] + c + x * VW));
            so[x] = e * ld(w->ks[n + i] + c + x * VW);
        }
        for (int j = 0; j < i; j++) {
            const float a = w->w[i][j], d = w->w[n + i][j];
            for (int x = 0; x < nv; x++) {
                const vf uj = ld(w->u[j] + c + x * VW);
                su[x] -= a * uj;
                so[x] += d * uj;
            }
        }
        const float d = w->w[n + i][i];
        for (int x = 0; x < nv; x++) {
            st(w->u[i] + c + x * VW, su[x]);
            st(o0 + i * ldo + c + x * VW, so[x] + d * su[x]);
        }
    }
}

/* subst_vecs for one column c past the last whole vector. */
static void subst_col(ScanChunk *w, int n, int c, const float *v0, int64_t ldv, float *o0, int64_t ldo) {
    for (int i = 0; i < n; i++) {
        const float e = expf(w->cum[i]);
        float su = w->beta[i] * (v0[i * ldv + c] - e * w->ks[i][c]), so = e * w->ks[n + i][c];
        for (int j = 0; j < i; j++) {
            su -= w->w[i][j] * w->u[j][c];
            so += w->w[n + i][j] * w->u[j][c];
        }
        w->u[i][c] = su;
        o0[i * ldo + c] = so + w->w[n + i][i] * su;
    }
}

/* The scratch's state (dk rows of dv) into a state row: the slot's, or a mark's. */
static void store_state(float *to, const ScanChunk *w, int dk, int dv) {
    for (int a = 0; a < dk; a++) memcpy(to + (int64_t)a * dv, w->s[a], (size_t)dv * sizeof(float));
}

/* Sequence q's tokens through value head h by chunks (SCAN_CHUNK, and each mark), its state advanced in place
 * and copied to each mark's row. */
static void deltanet_chunked(const RecMixer *r, const RecStep *s, int q, int h, float *state, ScanChunk *w) {
    const int dk = r->dk, dv = r->dv, kh = r->tiled ? h % r->groups : h / (r->heads / r->groups), key = r->groups * dk;
    const int value = r->heads * dv, C = r->conv_dim;
    const int64_t t0 = s->first[q], len = s->len[q], size = (int64_t)dk * dv;
    const float decay_rate = -expf(r->a_log[h]), qscale = 1.0f / sqrtf((float)dk);
    int64_t mark = s->mark_first ? s->mark_first[q] : 0;
    const int64_t mark_end = s->mark_first ? s->mark_first[q + 1] : 0;
    for (int a = 0; a < dk; a++) memcpy(w->s[a], state + (int64_t)a * dv, (size_t)dv * sizeof(float));
    for (int64_t c0 = 0; c0 < len;) {
        int64_t c1 = c0 + SCAN_CHUNK < len ? c0 + SCAN_CHUNK : len;
        if (mark < mark_end && s->mark_at[mark] < c1) c1 = s->mark_at[mark];
        const int n = (int)(c1 - c0), np = (n + VW - 1) / VW * VW;
        const float *conv0 = conv_rows(r, s) + (t0 + c0) * C, *row0 = canon_rows(r, s) + (t0 + c0) * r->width;
        float g = 0.0f;
        for (int i = 0; i < n; i++) {
            const float *conv = conv0 + (int64_t)i * C, *row = row0 + (int64_t)i * r->width;
            l2norm(w->kq[i], conv + key + kh * dk, dk, 1.0f);
            l2norm(w->kq[n + i], conv + kh * dk, dk, qscale);
            w->beta[i] = sigmoid(row[C + value + h]);
            g += decay_rate * softplus(row[C + value + r->heads + h] + r->dt_bias[h]);
            w->cum[i] = g;
        }
        for (int i = n; i < np; i++) w->cum[i] = g; /* read by the vector decays below, never used */
        for (int a = 0; a < dk; a++)
            for (int j = 0; j < np; j++) w->kt[a][j] = j < n ? w->kq[j][a] : 0.0f;
        mm_rows(w->ks[0], SCAN_LD, w->kq[0], SCAN_LD, 2 * n, w->s[0], SCAN_LD, dk, dv, 0.0f, 0);
        mm_rows(w->w[0], SCAN_CHUNK, w->kq[0], SCAN_LD, 2 * n, w->kt[0], SCAN_CHUNK, dk, np, 0.0f, 0);
        for (int i = 0; i < n; i++) { /* A (row i, j < i) and D (row n + i, j <= i) */
            for (int j = 0; j <= i; j += VW) {
                const vf e = vexp(w->cum[i] - ld(w->cum + j));
                st(w->w[i] + j, w->beta[i] * e * ld(w->w[i] + j));
                st(w->w[n + i] + j, e * ld(w->w[n + i] + j));
            }
        }
        float *out0 = rec_out(r, s) + (t0 + c0) * r->out_k + (int64_t)h * dv;
        const float *v0 = conv0 + 2 * key + h * dv;
        int c = 0;
        for (; c + SUB_VECS * VW <= dv; c += SUB_VECS * VW) subst_vecs(w, n, c, SUB_VECS, v0, C, out0, r->out_k);
        for (; c + VW <= dv; c += VW) subst_vecs(w, n, c, 1, v0, C, out0, r->out_k);
        for (; c < dv; c++) subst_col(w, n, c, v0, C, out0, r->out_k);
        float tail[SCAN_CHUNK]; /* e^(cum_last - cum_j): key j's decay to the chunk's end */
        for (int j = 0; j < n; j++) tail[j] = expf(g - w->cum[j]);
        for (int a = 0; a < dk; a++)
            for (int j = 0; j < n; j++) w->kt[a][j] *= tail[j];
        mm_rows(w->s[0], SCAN_LD, w->kt[0], SCAN_CHUNK, dk, w->u[0], SCAN_LD, n, dv, expf(g), 1);
        for (int i = 0; i < n; i++) {
            const float *z = row0 + (int64_t)i * r->width + C + h * dv;
            gated_norm(r, out0 + (int64_t)i * r->out_k, out0 + (int64_t)i * r->out_k, z);
        }
        if (mark < mark_end && s->mark_at[mark] == c1)
            store_state(r->rec_state + (s->mark_row[mark++] * r->heads + h) * size, w, dk, dv);
        c0 = c1;
    }
    store_state(state, w, dk, dv);
}

/* ---- Mamba2's chunked (SSD) scan -------------------------------------------------------------------------------
 * mamba2.py's chunked form per (sequence, head), in chunks as Gated DeltaNet's (SCAN_CHUNK, ending at each mark):
 * with dt_j the clamped time steps and cum_i the chunk's cumulative log decay (sum of dt A) up to token i, y_i =
 * e^cum_i C_i S0^T + sum_{j <= i} e^(cum_i - cum_j) dt_j (C_i . B_j) x_j + D x_i and S = e^cum_last S0 + sum_j
 * e^(cum_last - cum_j) dt_j x_j B_j^T, the state S [head dim P, state size N]. B and C are the head's group's. */

/* A Mamba2 chunk's scratch: s the state transposed [N, P] (the products read it as their right side); x the
 * chunk's inputs x_j [n, P], copied out of the conv rows (read once per block of rows: at the conv rows' stride,
 * 40 KiB at Nemotron-H's shape, they all fell into one L1 set); bt B transposed [N, chunk] (zeros past n; scaled
 * by dt_j e^(cum_last - cum_j) for the state's update); w the scores C B^T, made the decayed causal scores (D on
 * the diagonal) in place. */
typedef struct {
    float s[SCAN_HEAD][SCAN_LD], x[SCAN_CHUNK][SCAN_LD], bt[SCAN_HEAD][SCAN_CHUNK], w[SCAN_CHUNK][SCAN_CHUNK];
    float dt[SCAN_CHUNK], cum[SCAN_CHUNK];
} SsdChunk;

/* The scratch's state (transposed: N rows of P) into a state row [P, N]: the slot's, or a mark's. */
static void store_ssd_state(float *to, const SsdChunk *w, int P, int N) {
    for (int p = 0; p < P; p++)
        for (int a = 0; a < N; a++) to[(int64_t)p * N + a] = w->s[a][p];
}

/* Sequence q's tokens through Mamba2's head h by chunks (SCAN_CHUNK, and each mark), its state advanced in place
 * and copied to each mark's row; the output rows before the gated norm (rec_norm), as mamba2_token's. */
static void mamba2_chunked(const RecMixer *r, const RecStep *s, int q, int h, float *state, SsdChunk *w) {
    const int P = r->dk, N = r->dv, g = h / (r->heads / r->groups), inner = r->heads * P, C = r->conv_dim;
    const int64_t t0 = s->first[q], len = s->len[q], size = (int64_t)P * N;
    const float rate = -expf(r->a_log[h]), D = r->d[h];
    int64_t mark = s->mark_first ? s->mark_first[q] : 0;
    const int64_t mark_end = s->mark_first ? s->mark_first[q + 1] : 0;
    for (int p = 0; p < P; p++)
        for (int a = 0; a < N; a++) w->s[a][p] = state[(int64_t)p * N + a];
    for (int64_t c0 = 0; c0 < len;) {
        int64_t c1 = c0 + SCAN_CHUNK < len ? c0 + SCAN_CHUNK : len;
        if (mark < mark_end && s->mark_at[mark] < c1) c1 = s->mark_at[mark];
        const int n = (int)(c1 - c0), np = (n + VW - 1) / VW * VW;
        const float *conv0 = conv_rows(r, s) + (t0 + c0) * C, *row0 = canon_rows(r, s) + (t0 + c0) * r->width;
        const float *x0 = conv0 + h * P, *b0 = conv0 + inner + g * N, *c_0 = conv0 + inner + (r->groups + g) * N;
        float cum = 0.0f;
        for (int i = 0; i < n; i++) {
            float dt = softplus(row0[(int64_t)i * r->width + inner + C + h] + r->dt_bias[h]);
            w->dt[i] = dt < r->dt_min ? r->dt_min : dt > r->dt_max ? r->dt_max : dt;
            cum += rate * w->dt[i];
            w->cum[i] = cum;
        }
        for (int i = n; i < np; i++) { /* read by the vector decays below, never used */
            w->dt[i] = 0.0f;
            w->cum[i] = cum;
        }
        for (int j = 0; j < n; j++) memcpy(w->x[j], x0 + (int64_t)j * C, (size_t)P * sizeof(float));
        for (int j = 0; j < np; j++) /* row by row: a column of the conv rows would read one L1 set's lines */
            for (int a = 0; a < N; a++) w->bt[a][j] = j < n ? b0[(int64_t)j * C + a] : 0.0f;
        mm_rows(w->w[0], SCAN_CHUNK, c_0, C, n, w->bt[0], SCAN_CHUNK, N, np, 0.0f, 0);
        for (int i = 0; i < n; i++) { /* row i: e^(cum_i - cum_j) dt_j (C_i . B_j) for j <= i, D at i, zeros past */
            for (int j = 0; j <= i; j += VW) {
                const vf e = vexp(w->cum[i] - ld(w->cum + j));
                st(w->w[i] + j, e * ld(w->dt + j) * ld(w->w[i] + j));
            }
            for (int j = i + 1; j < np; j++) w->w[i][j] = 0.0f;
            w->w[i][i] += D;
        }
        float *out0 = rec_out(r, s) + (t0 + c0) * r->out_k + (int64_t)h * P;
        mm_rows(out0, r->out_k, c_0, C, n, w->s[0], SCAN_LD, N, P, 0.0f, 0); /* C_i S0^T, then decayed */
        for (int i = 0; i < n; i++) {
            float *y = out0 + (int64_t)i * r->out_k;
            const float e = expf(w->cum[i]);
            for (int p = 0; p < P; p++) y[p] *= e;
        }
        mm_rows(out0, r->out_k, w->w[0], SCAN_CHUNK, n, w->x[0], SCAN_LD, n, P, 1.0f, 1);
        float tail[SCAN_CHUNK]; /* dt_j e^(cum_last - cum_j): token j's input's decay to the chunk's end */
        for (int j = 0; j < n; j++) tail[j] = w->dt[j] * expf(cum - w->cum[j]);
        for (int a = 0; a < N; a++)
            for (int j = 0; j < n; j++) w->bt[a][j] *= tail[j];
        mm_rows(w->s[0], SCAN_LD, w->bt[0], SCAN_CHUNK, N, w->x[0], SCAN_LD, n, P, expf(cum), 1);
        if (mark < mark_end && s->mark_at[mark] == c1)
            store_ssd_state(r->rec_state + (s->mark_row[mark++] * r->heads + h) * size, w, P, N);
        c0 = c1;
    }
    store_ssd_state(state, w, P, N);
}

int64_t rec_scratch_bytes(const RecMixer *r) {
    if (r->kind == MIX_SHORT_CONV || r->dk > SCAN_HEAD || r->dv > SCAN_HEAD) return 0;
    return r->kind == MIX_GATED_DELTANET ? (int64_t)sizeof(ScanChunk) : (int64_t)sizeof(SsdChunk);
}

/* Item i: one sequence's tokens through head i % heads of the recurrence, its state (in the slot, zeros for a
 * sequence at position 0) advanced in place. */
void rec_scan_as(const RecMixer *r, const RecStep *s, int i, int chunked, void *scratch) {
    const int q = i / r->heads, h = i % r->heads;
    const int64_t size = (int64_t)r->dk * r->dv, t0 = s->first[q], t1 = t0 + s->len[q];
    float *st = r->rec_state + (s->slot[q] * r->heads + h) * size;
    if (s->positions[t0] == 0) memset(st, 0, (size_t)size * sizeof(float));
    if (chunked && rec_scratch_bytes(r)) {
        if (r->kind == MIX_GATED_DELTANET)
            deltanet_chunked(r, s, q, h, st, scratch);
        else
            mamba2_chunked(r, s, q, h, st, scratch);
        return;
    }
    const int head_out = r->kind == MIX_MAMBA2 ? r->dk : r->dv;
    int64_t mark = s->mark_first ? s->mark_first[q] : 0;
    const int64_t mark_end = s->mark_first ? s->mark_first[q + 1] : 0;
    for (int64_t t = t0; t < t1; t++) {
        const float *conv = conv_rows(r, s) + t * r->conv_dim, *row = canon_rows(r, s) + t * r->width;
        float *out = rec_out(r, s) + t * r->out_k + (int64_t)h * head_out;
        if (r->kind == MIX_MAMBA2)
            mamba2_token(r, st, conv, row, h, out);
        else
            deltanet_token(r, st, conv, row, h, out);
        if (mark < mark_end && s->mark_at[mark] == t + 1 - t0) /* a checkpoint after these t + 1 - t0 tokens */
            memcpy(r->rec_state + (s->mark_row[mark++] * r->heads + h) * size, st, (size_t)size * sizeof(float));
    }
}

void rec_scan(const RecMixer *r, const RecStep *s, int i, void *scratch) {
    const int64_t len = s->len[i / r->heads];
    rec_scan_as(r, s, i, len >= (r->kind == MIX_MAMBA2 ? MAMBA2_MIN_TOKENS : SCAN_MIN_TOKENS), scratch);
}

/* Row t of Mamba2's output: y * silu(z), RMS-normed over each group's channels, times the norm's weight. */
void rec_norm(const RecMixer *r, const RecStep *s, int t) {
    if (r->kind != MIX_MAMBA2) return;
    const int inner = r->heads * r->dk, per = inner / r->groups;
    const float *z = canon_rows(r, s) + (int64_t)t * r->width;
    float *y = rec_out(r, s) + (int64_t)t * r->out_k;
    for (int j = 0; j < inner; j++) y[j] *= silu(z[j]);
    for (int g = 0; g < r->groups; g++) {
        float *yg = y + g * per, ss = 0.0f;
        for (int j = 0; j < per; j++) ss += yg[j] * yg[j];
        const float rn = 1.0f / sqrtf(ss / (float)per + r->eps);
        for (int j = 0; j < per; j++) yg[j] = r->norm[g * per + j] * (yg[j] * rn);
    }
}
