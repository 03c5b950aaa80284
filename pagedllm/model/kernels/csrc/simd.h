/* Every per-ISA primitive of the kernels, once (in the spirit of llama.cpp's ggml-cpu/simd-mappings.h): the float
 * vector of the widest registers the build has and its loads, stores, conversions and reductions, and the
 * 16-bit integer vectors of the dot route. A kernel source is written once, for every width, over these; the
 * `#if`s of the instruction sets live here and nowhere else.
 *
 * VW = 16 lanes with AVX-512, else 8 (AVX2; the portable build's generic vectors too). Wider generic vectors
 * than the target has become per-lane scalar code in GCC (a 16-wide exp on AVX2 turned into a loop with
 * branches), so nothing here is wider than the registers. Where GCC would turn a generic form into scalar code
 * (float16, bytes, nibbles), a primitive is the intrinsic of each class, with a portable loop of the same
 * results for the x86-64 build.
 *
 * SIMD_MATMUL_ISA / SIMD_DOT_ISA / SIMD_I8_ISA / SIMD_AMX name the path each route compiles (cpu_kernel.isa());
 * SIMD_INT16 is defined where the dot route has its vector form (AVX-512 BW, or AVX2 without AVX-512), SIMD_INT8
 * where the int8 route has its (the same classes; I8_VNNI where the byte dot product is one instruction). */
#ifndef PAGEDLLM_SIMD_H
#define PAGEDLLM_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4))); /* loadable from any float address */
typedef int32_t vi __attribute__((vector_size(4 * VW)));

#if defined(__AVX512F__)
#define SIMD_MATMUL_ISA "avx512"
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define SIMD_MATMUL_ISA "avx2"
#else
#define SIMD_MATMUL_ISA "portable"
#endif
#if defined(__AVX512BW__)
#define SIMD_DOT_ISA "avx512"
#define SIMD_INT16 1
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define SIMD_DOT_ISA "avx2"
#define SIMD_INT16 1
#else
#define SIMD_DOT_ISA "portable"
#endif
#if defined(__AVX512BW__)
#define SIMD_INT8 1
#if defined(__AVX512VNNI__)
#define SIMD_I8_ISA "avx512-vnni"
#define I8_VNNI 1
#else
#define SIMD_I8_ISA "avx512"
#endif
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define SIMD_INT8 1
#if defined(__AVXVNNI__)
#define SIMD_I8_ISA "avx2-vnni"
#define I8_VNNI 1
#else
#define SIMD_I8_ISA "avx2"
#endif
#else
#define SIMD_I8_ISA "portable"
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SIMD_AMX "yes"
#else
#define SIMD_AMX "no"
#endif

/* ---- float vectors: load, store, convert ------------------------------------------------------------------ */
static inline vf ld(const float *p) { return *(const vfu *)p; } /* VW floats from any address */
static inline void st(float *p, vf v) { *(vfu *)p = v; }
static inline vf tof(vi x) { return __builtin_convertvector(x, vf); }
/* A load kept in a register: for a block of few rows GCC would fold the load into every FMA that uses it, and
 * reloading the same panel vector once per row makes the micro-kernel wait on loads instead of FMAs. */
static inline vf ldr(const float *p) {
    vf v = ld(p);
#if defined(__AVX512F__) || defined(__AVX2__)
    __asm__("" : "+v"(v));
#endif
    return v;
}

/* VW bfloat16 values from any address, widened (exact, by a shift). */
typedef uint16_t vhu __attribute__((vector_size(2 * VW), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
static inline vf ld_bf16(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vhu *)p, vu) << 16); }

/* x's two floats (a k pair) in every lane pair; VW float16 / unsigned / signed bytes / 16-bit words as floats or
 * 32-bit lanes. */
#if defined(__AVX512F__)
static inline vf pairx(const float *x) { return (vf)_mm512_castpd_ps(_mm512_set1_pd(*(const double *)x)); }
static inline vf f16v(const uint8_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi u8v(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi s8v(const uint8_t *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi u16v(const uint8_t *p) { return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi u8v_halves(const uint8_t *p, const uint8_t *q) { /* 8 bytes from p, then 8 from q */
    const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)q));
    return (vi)_mm512_cvtepu8_epi32(b);
}
#elif defined(__AVX2__) && defined(__F16C__)
static inline vf pairx(const float *x) { return (vf)_mm256_castpd_ps(_mm256_broadcast_sd((const double *)x)); }
static inline vf f16v(const uint8_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vi u8v(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi s8v(const uint8_t *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi u16v(const uint8_t *p) { return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vf pairx(const float *x) {
    vf r;
    for (int i = 0; i < VW; i++) r[i] = x[i % 2];
    return r;
}
static inline vf f16v(const uint8_t *p) {
    vf r;
    for (int i = 0; i < VW; i++) {
        _Float16 h;
        memcpy(&h, p + 2 * i, 2);
        r[i] = (float)h;
    }
    return r;
}
static inline vi u8v(const uint8_t *p) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = p[i];
    return r;
}
static inline vi s8v(const uint8_t *p) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = (int8_t)p[i];
    return r;
}
static inline vi u16v(const uint8_t *p) {
    vi r;
    for (int i = 0; i < VW; i++) r[i] = p[2 * i] | p[2 * i + 1] << 8;
    return r;
}
#endif

/* MXFP4 (GGML type 39): the E2M1 value of each 4-bit code, doubled (llama.cpp's kvalues_mxfp4, gguf-py's
 * MXFP4.kvalues); a weight is kvalues[q] times its group's scale 2^(e - 128), the E8M0 byte e halved. IQ4_NL /
 * IQ4_XS (GGML types 20, 23): a non-linear 4-bit table (llama.cpp's kvalues_iq4nl), times the group's scale. */
static const int8_t MX4_VALUES[16] __attribute__((unused)) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t IQ4_VALUES[16] __attribute__((unused)) = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                              1,    13,   25,  38,  53,  69,  89,  113};

/* Codes 0..15 (one a lane) as their float values in a 16-entry table: a lookup in registers (vpermps). */
#if defined(__AVX512F__)
static inline vf lut16v(vi q, const float *t) { return (vf)_mm512_permutexvar_ps((__m512i)q, _mm512_loadu_ps(t)); }
#elif defined(__AVX2__) && defined(__F16C__)
static inline vf lut16v(vi q, const float *t) { /* 8 lanes: each half of the table, picked by the code's bit 3 */
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t), (__m256i)q);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t + 8), (__m256i)q);
    return (vf)_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32((__m256i)q, 28)));
}
#else
static inline vf lut16v(vi q, const float *t) {
    vf r;
    for (int i = 0; i < VW; i++) r[i] = t[q[i] & 15];
    return r;
}
#endif
static inline vf mx4v(vi q) { /* +0 for code 8, never -0 */
    static const float t[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    return lut16v(q, t);
}
static inline vf iq4v(vi q) {
    static const float t[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return lut16v(q, t);
}

/* ---- float vectors: reductions ---------------------------------------------------------------------------- */
/* The lanes of one vector summed, in a fixed order. */
static inline float hsum(vf x) {
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += x[l];
    return s;
}

/* r[t] = the sum of the lanes of x[t], t < VW: the horizontal sums of VW vectors at once, by a tree of
 * two-vector shuffles and adds (VW - 1 adds for VW sums instead of VW - 1 per sum). */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLE 1
#endif
#endif
#if defined(HAVE_SHUFFLE) && VW == 16
#define SH __builtin_shufflevector
static inline vf reduce_rows(const vf *x) {
    vf y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = SH(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SH(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        z[i] = SH(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SH(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = SH(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SH(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SH(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SH(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif defined(HAVE_SHUFFLE)
#define SH __builtin_shufflevector
static inline vf reduce_rows(const vf *x) {
    vf y[4], z[2];
    for (int i = 0; i < 4; i++)
        y[i] = SH(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SH(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        z[i] = SH(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               SH(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SH(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) + SH(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
static inline vf reduce_rows(const vf *x) {
    vf r;
    for (int t = 0; t < VW; t++) r[t] = hsum(x[t]);
    return r;
}
#endif

/* out[j] = scale x the value of float8 code j, for the first multiple of 16 of the D codes; returns how many
 * (0 without F16C: the caller's scalar loop does them all). Why: even as vectorized bit operations a widened fp8
 * block cost more than float32's whole read at a 4k-token context. A float8 code is a float16 with fewer bits:
 * e5m2 is a float16's top byte; e4m3fn shifted left by 7 (sign to bit 15) is a float16 of 2^-8 its value,
 * subnormals included, and its NaN code 0x7f becomes float16's NaN by one xor. F16C widens 8 float16s per
 * instruction; the 2^8 goes into the scale (a power of two: the products, and so the results, are bit for bit
 * the scalar path's). */
static inline int widen_fp8_f16c(float *out, const uint8_t *codes, int D, float scale, int e5m2) {
    int j = 0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256i low7 = _mm256_set1_epi16(0x7f), nan_fix = _mm256_set1_epi16(0x3f80 ^ 0x7e00);
    const __m256 s = _mm256_set1_ps(e5m2 ? scale : scale * 256.0f);
    for (; j + 16 <= D; j += 16) {
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + j)));
        __m256i h = _mm256_slli_epi16(w, 8);
        if (!e5m2) {
            const __m256i mag = _mm256_and_si256(w, low7);
            h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_andnot_si256(low7, w), 8));
            h = _mm256_xor_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, low7), nan_fix));
        }
        _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_cvtph_ps(_mm256_castsi256_si128(h))));
        _mm256_storeu_ps(out + j + 8, _mm256_mul_ps(s, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))));
    }
#else
    (void)out, (void)codes, (void)D, (void)scale, (void)e5m2;
#endif
    return j;
}

/* ---- 16-bit integer activations (the dot route, qmm_dot.c) -------------------------------------------------
 * One group of 32 inputs rounded with the factor inv: codes, and the sums of each half. In vectors where the
 * build has them (a scalar loop costs ~3.5 ns an input: at 64 rows that was a sixth of the 135M model's decode
 * step), with the scalar loop's exact results: round half to even, NaN to 0, clamped to +-32767. */
static inline void round_group(int16_t *q, int32_t *s, const float *x, float inv) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(inv), lim = _mm512_set1_ps(32767.0f);
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), f),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
        const __m512i c = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, lim), -lim));
        _mm256_storeu_si256((__m256i *)(q + 16 * h), _mm512_cvtepi32_epi16(c));
        s[h] = _mm512_reduce_add_epi32(c);
    }
#elif defined(__AVX2__)
    const __m256 f = _mm256_set1_ps(inv), lim = _mm256_set1_ps(32767.0f), nlim = _mm256_set1_ps(-32767.0f);
    for (int h = 0; h < 2; h++) {
        __m256i c[2];
        for (int j = 0; j < 2; j++) {
            __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * h + 8 * j), f),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
            c[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, lim), nlim));
        }
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + 16 * h), w);
        __m256i t = _mm256_add_epi32(c[0], c[1]);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        s[h] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
    }
#else
    s[0] = s[1] = 0;
    for (int k = 0; k < 32; k++) {
        float v = nearbyintf(x[k] * inv);
        v = v == v ? (v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v) : 0.0f;
        q[k] = (int16_t)v;
        s[k / 16] += (int16_t)v;
    }
#endif
}

/* The largest |x| of a group of 32, NaN left out. */
static inline float group_amax(const float *x) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    /* max_ps returns its second operand where either is NaN: the running max, never the NaN */
    return _mm512_reduce_max_ps(_mm512_max_ps(a, _mm512_max_ps(b, _mm512_setzero_ps())));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * j)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.0f;
    for (int k = 0; k < 32; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    return amax;
#endif
}

#ifdef SIMD_INT16
/* Nibble rows go through 256-bit vectors `hv` on every class: one row of 16 bytes widens to 16 words (columns
 * 0-7 in the low nibbles, 8-15 in the high ones, a k pair per 32-bit lane) against the row's k pair broadcast
 * from memory. A 512-bit form needs a permute of x per row pair, and on Zen 4 those shuffles were the
 * bottleneck. hdot: acc + the products of word pairs, summed per 32-bit lane (pmaddwd, VNNI's vpdpwssd). */
typedef __m256i hv;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline hv hdot(hv acc, hv w, hv x) { return _mm256_dpwssd_epi32(acc, w, x); }
#elif defined(__AVXVNNI__)
static inline hv hdot(hv acc, hv w, hv x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
#else
static inline hv hdot(hv acc, hv w, hv x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
#endif
static inline hv nib_words(const uint8_t *body, int r) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(body + 16 * r)));
}
/* Row quad i's entry of a 5-bit format's high-bit plane (16 bytes) as 16 words, word j holding nibble byte j's
 * high bits in those rows (qtile.h). One load and widen serves the quad's rows. */
static inline hv plane_words(const uint8_t *body, int i) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(body + 256 + 16 * i)));
}
/* K6 row r's 16 words (qtile.h): its code bytes interleaved with the pair plane's bytes, word j = code byte j |
 * plane byte (8 (r % 2) + j % 8) << 8, the plane in both lanes and the high lane's shifted down a nibble (its
 * words 8-15 read the high nibbles): the pair's two loads and one shift serve both rows. Bits 0-11: code(j/2) +
 * 64 code(8 + j/2); 12-15: another nibble, masked off by the caller. */
static inline hv k6_words(const uint8_t *body, int r) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)(body + 32 * (r / 2)));
    const __m256i pl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(body + 256 + 16 * (r / 2))));
    const __m256i p = _mm256_srlv_epi32(pl, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return r % 2 ? _mm256_unpackhi_epi8(b, p) : _mm256_unpacklo_epi8(b, p);
}
#define HAND(a, b) _mm256_and_si256(a, _mm256_set1_epi16(b))
#if defined(__AVX512VL__) /* bits of a where mask m is set, else of b */
#define HSEL(m, a, b) _mm256_ternarylogic_epi32(_mm256_set1_epi16((short)(m)), a, b, 0xCA)
#else
#define HSEL(m, a, b) _mm256_or_si256(HAND(a, m), _mm256_andnot_si256(_mm256_set1_epi16((short)(m)), b))
#endif
#define HADD16 _mm256_add_epi16
#define HADD _mm256_add_epi32
#define HSUB _mm256_sub_epi32
#define HSRA _mm256_srai_epi32
#define HSRL _mm256_srli_epi16
#define HSLL _mm256_slli_epi16
#define HZERO _mm256_setzero_si256
#define HSET1 _mm256_set1_epi32
#endif

/* Byte rows and table formats' rows go through the widest integer vector `iv`, BV of them a row of 16 columns; QR rows of
 * x a pass over a column block, PH independent accumulators of one row's sums. */
#if defined(__AVX512BW__)
typedef __m512i iv;
#define QR 4
static inline iv dot16(iv acc, iv w, iv x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
/* A byte row's 16 columns (k pairs) as words: one vector. */
static inline void byte_words(const uint8_t *body, int r, iv w[1]) {
    w[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(body + 32 * r)));
}
#define BV 1
/* Row quad t of a table format's body (MX4, IQ4NL, IQ4XS) as words, w[p] row 4 t + p: one lookup of the codes
 * in `tab`, the format's table plus an offset that makes it unsigned (MX4: kvalues + 12, 0..24; IQ4: + 128,
 * 1..241; so that a word needs no sign), vpshufb, 16 entries a 128-bit lane, or with VBMI vpermb over 4 copies
 * of them, which reads 6 bits of an index and so needs no nibble masks: 7 operations a quad instead of 9, 6%
 * faster at one row on Zen 4), then a byte of each word taken by a mask or a shift (the interleaved layout puts
 * rows 4t + p, p = 0..3, in the four byte and nibble positions). The offset comes off through the group's sum
 * of x, as a format's offset does. */
static inline void lut_words(const uint8_t *body, int t, const uint8_t *tab16, iv w[4][1]) {
    const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)tab16));
    const __m512i b = _mm512_loadu_si512(body + 64 * t), low = _mm512_set1_epi16(255);
#if defined(__AVX512VBMI__)
    const __m512i lo = _mm512_permutexvar_epi8(b, tab);
    const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), tab);
#else
    const __m512i m = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(b, m));
    const __m512i hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(b, 4), m));
#endif
    w[0][0] = _mm512_and_si512(lo, low), w[1][0] = _mm512_srli_epi16(lo, 8);
    w[2][0] = _mm512_and_si512(hi, low), w[3][0] = _mm512_srli_epi16(hi, 8);
}
/* The 16 columns' sums from the nibble accumulators (low: columns 0-7, high: 8-15). */
static inline void nib_cols(hv lo, hv hi, vi out[1]) {
    out[0] = (vi)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#define IZERO _mm512_setzero_si512
#define IADD _mm512_add_epi32
#define ISET1 _mm512_set1_epi32
#define PH 4
#elif defined(SIMD_INT16)
typedef __m256i iv;
#define QR 2
static inline iv dot16(iv acc, iv w, iv x) { return hdot(acc, w, x); }
static inline void byte_words(const uint8_t *body, int r, iv w[2]) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(body + 32 * r)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(body + 32 * r + 16)));
}
#define BV 2
static inline void lut_words(const uint8_t *body, int t, const uint8_t *tab16, iv w[4][2]) { /* as AVX-512's */
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab16));
    const __m256i m = _mm256_set1_epi8(15), low = _mm256_set1_epi16(255);
    for (int v = 0; v < 2; v++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(body + 64 * t + 32 * v));
        const __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(b, m));
        const __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(b, 4), m));
        w[0][v] = _mm256_and_si256(lo, low), w[1][v] = _mm256_srli_epi16(lo, 8);
        w[2][v] = _mm256_and_si256(hi, low), w[3][v] = _mm256_srli_epi16(hi, 8);
    }
}
static inline void nib_cols(hv lo, hv hi, vi out[2]) {
    out[0] = (vi)lo;
    out[1] = (vi)hi;
}
#define IZERO _mm256_setzero_si256
#define IADD _mm256_add_epi32
#define ISET1 _mm256_set1_epi32
#define PH 2 /* 16 registers */
#else
#define QR 1
#define PH 2
#endif

/* ---- 8-bit integer activations (the int8 route, qmm_i8.c) -------------------------------------------------
 * One group of 32 inputs rounded with the factor inv to int8 codes (round half to even, NaN to 0, clamped to
 * +-127: llama.cpp's Q8_0 activations), and the sums of each half; vectors where the build has them, with the
 * scalar loop's exact results. */
static inline void round_group8(int8_t *q, int32_t *s, const float *x, float inv) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(inv), lim = _mm512_set1_ps(127.0f);
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), f),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
        const __m512i c = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, lim), -lim));
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtepi32_epi8(c));
        s[h] = _mm512_reduce_add_epi32(c);
    }
#elif defined(__AVX2__)
    const __m256 f = _mm256_set1_ps(inv), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256i c[4];
    for (int j = 0; j < 4; j++) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), f),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
        c[j] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, lim), nlim));
    }
    /* packs work per 128-bit lane: the dwords come out as c0[0:4] c1[0:4] c2[0:4] c3[0:4] c0[4:8] ..., put back */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int h = 0; h < 2; h++) {
        const __m256i t = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        s[h] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
    }
#else
    s[0] = s[1] = 0;
    for (int k = 0; k < 32; k++) {
        float v = nearbyintf(x[k] * inv);
        v = v == v ? (v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v) : 0.0f;
        q[k] = (int8_t)v;
        s[k / 16] += (int8_t)v;
    }
#endif
}

#ifdef SIMD_INT8
/* A chunk of the int8 route's panel is 16 columns x 4 consecutive k as bytes, a column a 32-bit lane: `bv` is
 * the widest integer vector, BCH of them a chunk (1 with AVX-512, 2 with AVX2), each VW columns; QR8 rows of x
 * a pass. With VNNI, bdot: acc + the four products of unsigned weight bytes and signed x bytes, summed per
 * 32-bit lane (vpdpbusd). Without: bmul16, the products summed in pairs to 16 bits, saturating (vpmaddubsw:
 * the weights' codes are kept small enough that it never does, see qmm_i8.c), badd16 to add several chunks'
 * in 16 bits, and bwiden, those summed in pairs into the 32-bit lanes (vpmaddwd against ones). bsign: x
 * negated where w is negative (the signed weights without VNNI: |w| times x with w's sign). bjoin: two passes'
 * sums of codes (qmm_i8.c) as the combined code's, 254 s1 + s2. */
#if defined(__AVX512BW__)
typedef __m512i bv;
#define BCH 1
#define QR8 6
static inline bv bload(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline bv bset1(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#ifdef I8_VNNI
static inline bv bdot(bv acc, bv w, bv x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
static inline bv bmul16(bv w, bv x) { return _mm512_maddubs_epi16(w, x); }
static inline bv badd16(bv a, bv b) { return _mm512_add_epi16(a, b); }
static inline bv bwiden(bv acc, bv s16) { return _mm512_add_epi32(acc, _mm512_madd_epi16(s16, _mm512_set1_epi16(1))); }
#endif
static inline bv bjoin(bv s1, bv s2) { return _mm512_add_epi32(_mm512_mullo_epi32(s1, _mm512_set1_epi32(254)), s2); }
static inline bv babs(bv w) { return _mm512_abs_epi8(w); }
static inline bv bsign(bv x, bv w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
#define BZERO _mm512_setzero_si512
#else
typedef __m256i bv;
#define BCH 2
#define QR8 3
static inline bv bload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline bv bset1(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#ifdef I8_VNNI
static inline bv bdot(bv acc, bv w, bv x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
static inline bv bmul16(bv w, bv x) { return _mm256_maddubs_epi16(w, x); }
static inline bv badd16(bv a, bv b) { return _mm256_add_epi16(a, b); }
static inline bv bwiden(bv acc, bv s16) { return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1))); }
#endif
static inline bv bjoin(bv s1, bv s2) { return _mm256_add_epi32(_mm256_mullo_epi32(s1, _mm256_set1_epi32(254)), s2); }
static inline bv babs(bv w) { return _mm256_abs_epi8(w); }
static inline bv bsign(bv x, bv w) { return _mm256_sign_epi8(x, w); }
#define BZERO _mm256_setzero_si256
#endif
/* Chunk bytes from two tile rows' k pairs: l0 / l1 (rows 2t, 2t + 1) hold columns 0-7 a 16-bit word each, h0 /
 * h1 columns 8-15; interleaving their words puts a column's four k in one 32-bit lane. */
static inline void chunk_from_pairs(uint8_t *p, __m128i l0, __m128i l1, __m128i h0, __m128i h1) {
    _mm_storeu_si128((__m128i *)p, _mm_unpacklo_epi16(l0, l1));
    _mm_storeu_si128((__m128i *)(p + 16), _mm_unpackhi_epi16(l0, l1));
    _mm_storeu_si128((__m128i *)(p + 32), _mm_unpacklo_epi16(h0, h1));
    _mm_storeu_si128((__m128i *)(p + 48), _mm_unpackhi_epi16(h0, h1));
}
#endif
#endif
