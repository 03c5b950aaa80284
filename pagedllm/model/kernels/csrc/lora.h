/* The LoRA term of the fused step's matmuls (lora.c): out[row] += B (A x[row]) for the rows of a step that run
 * under an adapter, each row through its own adapter's A and B (the scale folded into B), as vLLM's punica ops
 * (sgmv, bgmv) compute it. model_step.c calls it after each targeted matmul (StepBatch.lora); the LoRA manager
 * (model/lora.py) builds the ctypes copies of these structures by reading this file (cpu_kernel.c_structs) and
 * checks their sizes against lora_struct_size() at load. */
#ifndef PAGEDLLM_LORA_H
#define PAGEDLLM_LORA_H
#include <stdint.h>

/* A layer's targeted matmuls, in weights.LORA_SLOTS' order */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_SLOTS };

typedef struct {
    const void *at;        /* [K, r]: A transposed (the q/k/v or gate/up pieces' A stacked along r) */
    const void *bt;        /* [r, N]: B transposed, the scale folded in (each piece's B in its own block) */
    const int64_t *pieces; /* [pieces * 4]: output columns [n0, n1) take tmp's [j0, j1) (bt is zero elsewhere) */
    int r;                 /* 0: the adapter does not target this matmul */
    int n_pieces;
} LoraMat;

typedef struct {
    const LoraMat **adapters; /* [A]: each of the step's adapters' matrices, [layers * LORA_SLOTS] */
    const int64_t *rows;      /* [n] the step's rows that have an adapter, grouped by adapter */
    const int64_t *groups;    /* [G * 3]: adapter, first index into rows, rows (1 to lora_group_rows()) */
    float *tmp;               /* [T * max_rank]: each row's A x between the two halves */
    int A, n, G, max_rank, layers;
    int bf16; /* 1: every LoraMat's at / bt are bfloat16; 0: float32 */
} LoraStep;

int64_t lora_struct_size(const char *name);
int lora_group_rows(void); /* the most rows one group holds: the rows that share each read of A and B */
/* 0, or -2 (bad sizes) / -5 (a row, adapter or group out of range): checked before the step runs. */
int lora_check(const LoraStep *s, int T, int layers);
int lora_targets(const LoraStep *s, int layer, int slot); /* 1: an adapter of the step adapts that matmul */
/* Work items of the two halves of one matmul's term (N: its output width; 0 for the first half), each half
 * done for every item before the other starts: lora_shrink (tmp = x A^T) then lora_expand (out += tmp B^T). */
int lora_items(const LoraStep *s, int N);
void lora_shrink(const LoraStep *s, int layer, int slot, const float *x, int K, int item);
void lora_expand(const LoraStep *s, int layer, int slot, float *out, int N, int ld, int item); /* ld: out's row stride */
#endif
