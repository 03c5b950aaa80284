/* The recurrent mixers of hybrid models' linear layers in the fused step (recurrent.c): Gated DeltaNet (Qwen3.5,
 * Qwen3-Next), Mamba2 (Granite 4.0-H) and LFM2's short conv. fused_step.py builds its ctypes copy of RecMixer by
 * reading this file (cpu_kernel.c_structs) and checks its size against rec_struct_size() at load.
 *
 * model_step.c runs a mixer's matmuls (its input projections into columns of one row, its output projection) as
 * it runs any matmul; between them come this file's phases of independent work items: the projection's columns
 * in the canonical order (Qwen3-Next's interleaved ones), the causal conv per (sequence, channel chunk), the
 * recurrence per (sequence, head), Mamba2's gated norm per token. */
#ifndef PAGEDLLM_RECURRENT_H
#define PAGEDLLM_RECURRENT_H
#include <stdint.h>

enum { MIX_GATED_DELTANET, MIX_MAMBA2, MIX_SHORT_CONV }; /* RecMixer.kind: ModelConfig.recurrent_mixer */

/* One linear layer's mixer. The canonical projection row [width] (each input projection i writes columns
 * in_off[i].. of it, or of the raw row that `perm` reorders):
 * - Gated DeltaNet: [q (groups * dk), k (groups * dk), v (heads * dv), z (heads * dv), b (heads), a (heads)], the conv
 *   over the first conv_dim (q, k, v), the state [heads, dk, dv] (groups: key heads);
 * - Mamba2: [z (heads * dk), xBC (conv_dim), dt (heads)], the conv over xBC, the state [heads, dk, dv] = [heads,
 *   head dim, state size] (groups: B's and C's groups);
 * - short conv: [B, C, x] (conv_dim each), the conv over B * x, gated by C; no state but the conv's. */
typedef struct {
    int kind, width, conv_dim, kernel, heads, groups, dk, dv;
    int tiled;           /* DeltaNet: value head h reads key head h % groups (llama.cpp's order), else h / (heads / groups) */
    int out_k;           /* the output projection's input size (its rows of `out`) */
    int n_in;            /* input projections */
    const uint8_t **in;  /* [n_in] quantized tiles, K = hidden */
    const int64_t *in_n; /* [n_in] each one's output size, N */
    const int64_t *in_fmt;
    const float **in_bias; /* [n_in] (an entry NULL: none) */
    const int64_t *perm;   /* [width] or NULL: canonical column j is column perm[j] of the projections' row */
    const uint8_t *out;
    int out_fmt;
    const float *out_bias;
    const float *conv_w, *conv_b;     /* [conv_dim, kernel] float32, [conv_dim] or NULL */
    const float *a_log, *dt_bias, *d; /* [heads] (d: Mamba2's skip, else NULL) */
    const float *norm;                /* the gated norm's weight: [dv] per head (DeltaNet), [heads * dv] (Mamba2) */
    float dt_min, dt_max;             /* Mamba2's time-step limits */
    float eps;
    void *conv_state;  /* [slots, conv_dim, kernel - 1], float32 or bfloat16 (conv_bf16) */
    float *rec_state;  /* [slots, heads, dk, dv] float32 (NULL: short conv) */
    int conv_bf16;
    int64_t slots;
} RecMixer;

/* A step's view for the mixers, built by model_step.c: its sequences (rows first[s] .. first[s] + len[s] - 1 of
 * the flat batch, each from state slot slot[s], from zeros where its first position is 0) and room for a layer's
 * rows (rec_row_floats per token), which each mixer lays out by its own sizes: the projections' raw row [T,
 * width], the canonical row [T, width] (the raw one where the mixer has no perm), the conv's output [T, conv_dim],
 * the mixer's output [T, out_k] (rec_out: the output projection's input).
 *
 * Marks (prefix-cache checkpoints inside a prompt chunk, --mamba-cache-mode all; NULL mark_first: none): sequence
 * s's state after its first mark_at[j] tokens (0 < mark_at[j] < len[s], ascending) is also written to state row
 * mark_row[j] (a row of the same state tensors, none of the step's slots), for j in mark_first[s] ..
 * mark_first[s + 1] - 1: the conv's last K-1 inputs and the recurrent state as the scan passes t (a chunk of
 * recurrent.c's chunked scan ends there). */
typedef struct {
    const int64_t *first, *len, *slot, *positions;
    int T, S;
    float *rows;
    const int64_t *mark_first, *mark_at, *mark_row;
} RecStep;

int64_t rec_struct_size(const char *name);
/* floats per token a mixer's rows take (raw, canon, conv, out); where its output rows start */
int64_t rec_row_floats(const RecMixer *r);
float *rec_out(const RecMixer *r, const RecStep *s);
/* 0, or -2 (bad sizes), -5 (a state slot or mark out of range, or two sequences' or marks' rows the same) */
int rec_check(const RecMixer *r, const RecStep *s, int hidden);
int rec_conv_items(const RecMixer *r, int S);
int rec_scan_items(const RecMixer *r, int S);
void rec_permute(const RecMixer *r, const RecStep *s, int t);
void rec_conv(const RecMixer *r, const RecStep *s, int i);
/* The bytes of a thread's scratch for this mixer's rec_scan items (0: none needed), best 64-byte aligned (the
 * chunked scan's rows are cache lines): model_step.c gives each thread the largest of its layers' (a chunk's
 * scratch is a few hundred KiB, more than a thread's stack may be: musl's 128 KiB, a small OMP_STACKSIZE). */
int64_t rec_scratch_bytes(const RecMixer *r);
/* Item i of the recurrence, with the calling thread's scratch (rec_scratch_bytes of this mixer, or more). */
void rec_scan(const RecMixer *r, const RecStep *s, int i, void *scratch);
/* rec_scan's item by the chunked scan (chunked 1: Gated DeltaNet's or Mamba2's, where the head fits it) or by the
 * token loop (0), whatever the sequence's length: rec_scan picks by length; tests and
 * benchmarks/kernels/recurrent_scan.py compare the two. */
void rec_scan_as(const RecMixer *r, const RecStep *s, int i, int chunked, void *scratch);
void rec_norm(const RecMixer *r, const RecStep *s, int t);
#endif
