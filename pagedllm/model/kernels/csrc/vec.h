/* The float vector of the widest registers the build has, shared by every kernel source (one source for every
 * width, as llama.cpp's simd-mappings): VW = 16 lanes with AVX-512, else 8 (AVX2; the portable build's generic
 * vectors too). Wider generic vectors than the target has become per-lane scalar code in GCC (a 16-wide exp on
 * AVX2 turned into a loop with branches), so nothing here is wider than the registers. */
#ifndef PAGEDLLM_VEC_H
#define PAGEDLLM_VEC_H
#include <stdint.h>

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4))); /* loadable from any float address */
typedef int32_t vi __attribute__((vector_size(4 * VW)));

#endif
