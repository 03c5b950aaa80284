/* Packing weights into the kernels' tiles (quant_pack.c; the layout is qtile.h's). */
#ifndef PAGEDLLM_QUANT_PACK_H
#define PAGEDLLM_QUANT_PACK_H
#include <stdint.h>

/* Weight [n, k] of format `fmt` (its codes and per-row scales) into `out`: ceil(n / 16) column blocks of
 * `col_bytes`; 0, or -2 (bad sizes, a part the format needs missing). */
int qpack_tiles(uint8_t *out, const void *codes, const void *d, const void *m, const void *s, const void *mi,
                int64_t n, int64_t k, int fmt, int64_t col_bytes, int threads);
/* Codes [n, k] of n rows of GGML type `ggml_type` stored back to back (`raw`); 0, or -2 (bad sizes, a type this
 * does not read). */
int gguf_codes(int8_t *codes, const uint8_t *raw, int64_t n, int64_t k, int ggml_type, int threads);
#endif
