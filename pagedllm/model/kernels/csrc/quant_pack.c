/*
 * Packing a quantized weight's plain form (quant.py's QuantParts: codes [N, K] and per-row scales) into the
 * kernels' tiles (the layout is in qtile.h's header comment).
 *
 * Why C: packing is pure byte shuffling, once per weight at load, but numpy does it as a chain of whole-array
 * temporaries (codes widened to int16, then the high-bit planes to uint64: 8 bytes a weight), which took ~25 s
 * and ~4.5 GB at the peak for a Llama-3.2-1B-shaped Q4_0 file. Here every output byte is written once, straight
 * from the plain form, and nothing but the tiles is allocated. The bytes are the ones quant.py's reference
 * layout gives (tests/test_quant_pack.py compares them), so the kernels see no difference.
 */
#include <stdint.h>
#include <string.h>

#include "qtile.h"
#include "quant_pack.h"

/* The format predicates are qtile.h's, the kernels' own; the codes are stored plus offset(fmt) except the table
 * formats' (their 4-bit codes as they are: the offset is the dot route's table, not the tiles'). */
static int code_offset(int fmt) { return lut(fmt) ? 0 : offset(fmt); }

/* 16 per-row values (column block cb, entry j of `width` per row) side by side; 0 past the last row. */
static void columns16(uint8_t *out, const uint8_t *a, int esize, int64_t n, int64_t width, int64_t cb, int64_t j) {
    for (int c = 0; c < 16; c++) {
        int64_t row = cb * 16 + c;
        if (row < n)
            memcpy(out + c * esize, a + (row * width + j) * esize, esize);
        else
            memset(out + c * esize, 0, esize);
    }
}

/* The body of tile g of column block cb: the codes of k = 32 g .. 32 g + 31 of its 16 columns. */
static uint8_t *body(uint8_t *o, const uint8_t *codes, int fmt, int64_t n, int64_t k, int64_t cb, int64_t g) {
    int es = dense16(fmt) ? 2 : 1;
    uint8_t u[16][32]; /* [column][k - 32 g], with the format's offset (unsigned) */
    if (!nibbles(fmt)) { /* k pair r of column c: one 2- (or 4-) byte unit, at unit 16 r + c */
        for (int c = 0; c < 16; c++) {
            int64_t row = cb * 16 + c;
            const uint8_t *src = codes + (row * k + g * 32) * es;
            for (int r = 0; r < 16; r++) {
                if (es == 1) {
                    uint16_t v = 0;
                    if (row < n) memcpy(&v, src + 2 * r, 2);
                    memcpy(o + 2 * (16 * r + c), &v, 2);
                } else {
                    uint32_t v = 0;
                    if (row < n) memcpy(&v, src + 4 * r, 4);
                    memcpy(o + 4 * (16 * r + c), &v, 4);
                }
            }
        }
        return o + 512 * es;
    }
    int off = code_offset(fmt);
    for (int c = 0; c < 16; c++) {
        int64_t row = cb * 16 + c;
        const int8_t *src = (const int8_t *)codes + row * k + g * 32;
        for (int e = 0; e < 32; e++) u[c][e] = (uint8_t)((row < n ? src[e] : 0) + off);
    }
    if (lut(fmt)) { /* per row quad 64 bytes; byte 2 w + p: row 4 q + p low, 4 q + p + 2 high, word w */
        for (int q = 0; q < 4; q++)
            for (int w = 0; w < 32; w++)
                for (int p = 0; p < 2; p++) {
                    const int c = w / 2, e = 2 * (4 * q + p) + w % 2; /* column and k of the low nibble */
                    *o++ = (uint8_t)((u[c][e] & 15) | (u[c][e + 4] & 15) << 4);
                }
        return o;
    }
    if (fmt == QFMT_K6) { /* per row pair t 32 code bytes (row 2t + s: bytes 0-7 at 8 s, 8-15 at 16 + 8 s) */
        for (int r = 0; r < 16; r++)
            for (int j = 0; j < 16; j++) {
                const int e = 2 * r + j % 2, lo = u[j / 2][e], hi = u[8 + j / 2][e]; /* k of byte j in row r */
                o[32 * (r / 2) + 8 * (r % 2) + j + 8 * (j >= 8)] = (uint8_t)(lo | (hi & 3) << 6);
                uint8_t *top = o + 256 + 16 * (r / 2) + 8 * (r % 2) + j % 8; /* byte j's top bits: nibble j / 8 */
                *top = (uint8_t)((j < 8 ? 0 : *top) | (hi >> 2) << 4 * (j / 8));
            }
        return o + 384;
    }
    for (int r = 0; r < 16; r++)
        for (int b = 0; b < 16; b++)
            o[r * 16 + b] = (u[b / 2][2 * r + b % 2] & 15) | (uint8_t)((u[8 + b / 2][2 * r + b % 2] & 15) << 4);
    o += 256;
    int bits = plane(fmt);
    if (!bits) return o;
    for (int t = 0; t < 16; t += 4) /* Q5, Q5M, K5M: per row quad 16 bytes; byte j: row t + p low at p, high 4 + p */
        for (int j = 0; j < 16; j++, o++) {
            *o = 0;
            for (int p = 0; p < 4; p++) {
                const int e = 2 * (t + p) + j % 2; /* k of byte j in row t + p */
                *o |= (uint8_t)((u[j / 2][e] >> 4) << p | (u[8 + j / 2][e] >> 4) << (4 + p));
            }
        }
    return o;
}

/* One column block: per tile its scales and body; the K formats behind a head per super-block of 8 tiles. */
typedef struct {
    const uint8_t *codes, *d, *m, *s, *mi; /* codes [n, k] (int8 / uint8, or 16-bit values); d, m float16 */
    int64_t n, k;
    int fmt;
} Plain;

static void pack_block(uint8_t *o, const Plain *a, int64_t cb) {
    int fmt = a->fmt, per = halves(fmt);
    int64_t G = a->k / 32, sub = G * per; /* integer scale sets a row (K formats) */
    for (int64_t g = 0; g < G; g++) {
        if (kfmt(fmt)) {
            if (g % 8 == 0) {
                columns16(o, a->d, 2, a->n, G / 8, cb, g / 8), o += 32;
                if (has_min(fmt)) columns16(o, a->m, 2, a->n, G / 8, cb, g / 8), o += 32;
            }
            for (int p = 0; p < per; p++) columns16(o, a->s, 1, a->n, sub, cb, g * per + p), o += 16;
            if (has_min(fmt))
                for (int p = 0; p < per; p++) columns16(o, a->mi, 1, a->n, sub, cb, g * per + p), o += 16;
        } else if (fmt == QFMT_MX4) {
            columns16(o, a->d, 1, a->n, G, cb, g), o += 16; /* the E8M0 bytes */
        } else if (!dense16(fmt)) {
            columns16(o, a->d, 2, a->n, G, cb, g), o += 32;
            if (has_min(fmt)) columns16(o, a->m, 2, a->n, G, cb, g), o += 32;
        }
        o = body(o, a->codes, fmt, a->n, a->k, cb, g);
    }
}

/* Weight [n, k] of format `fmt` into `out`, ceil(n / 16) column blocks of `col_bytes` (the caller's count,
 * checked against qcol_bytes); the scales each row has in the plain form: d (and m) float16 [n, k / 32] (MX4:
 * d the E8M0 bytes, uint8 [n, k / 32]), or for the K formats D (and M) [n, k / 256] with s int8 (and mi uint8)
 * [n, k / 32 * sets]. 0, or -2 (bad sizes, a part the format needs missing). */
int qpack_tiles(uint8_t *out, const void *codes, const void *d, const void *m, const void *s, const void *mi,
                int64_t n, int64_t k, int fmt, int64_t col_bytes, int threads) {
    if (n <= 0 || k <= 0 || k % 32 || !codes || !out || fmt < 0 || fmt > QFMT_LAST || fmt == QFMT_MIXED) return -2;
    int64_t cb_bytes = qcol_bytes(fmt, (int)(k / 32));
    if (cb_bytes <= 0 || cb_bytes != col_bytes) return -2;
    if ((!dense16(fmt) && !d) || (has_min(fmt) && !m) || (kfmt(fmt) && (!s || (has_min(fmt) && !mi))))
        return -2;
    Plain a = {codes, d, m, s, mi, n, k, fmt};
    int64_t nb = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t cb = 0; cb < nb; cb++) pack_block(out + cb * cb_bytes, &a, cb);
    return 0;
}

/* ---- GGUF blocks -> the plain form's codes ----------------------------------------------------------------
 * The integer codes of one GGML block row, in the order gguf-py's dequantizer gives the weights
 * (gguf_quants.py's readers take the scales; this is their heavy part: a byte per weight). Only shuffles and
 * bit masks, no arithmetic on values: the codes are exactly the file's. */
static void codes_q4(int8_t *q, const uint8_t *b, int nb, int bytes, int off, int shift) { /* Q4_1 0..15, Q4_0 */
    for (int i = 0; i < nb; i++, b += bytes, q += 32)
        for (int j = 0; j < 16; j++) q[j] = (int8_t)((b[off + j] & 15) - shift), q[16 + j] = (int8_t)((b[off + j] >> 4) - shift);
}
static void codes_q5(int8_t *q, const uint8_t *b, int nb, int bytes, int off, int shift) { /* Q5_0, Q5_1 */
    for (int i = 0; i < nb; i++, b += bytes, q += 32) {
        uint32_t qh = (uint32_t)b[off] | (uint32_t)b[off + 1] << 8 | (uint32_t)b[off + 2] << 16
                    | (uint32_t)b[off + 3] << 24;
        for (int j = 0; j < 32; j++) {
            int nib = j < 16 ? b[off + 4 + j] & 15 : b[off + 4 + j - 16] >> 4;
            q[j] = (int8_t)((nib | ((qh >> j) & 1) << 4) - shift);
        }
    }
}
static void codes_k4(int8_t *q, const uint8_t *b, int nb, int bytes, int qs, int qh) { /* Q4_K (qh < 0), Q5_K */
    for (int i = 0; i < nb; i++, b += bytes, q += 256)
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 32; j++) {
                uint8_t v = b[qs + c * 32 + j];
                int lo = 64 * c + j, hi = lo + 32;
                q[lo] = v & 15, q[hi] = v >> 4;
                if (qh >= 0)
                    q[lo] |= ((b[qh + j] >> (2 * c)) & 1) << 4, q[hi] |= ((b[qh + j] >> (2 * c + 1)) & 1) << 4;
            }
}
static void codes_k6(int8_t *q, const uint8_t *b, int nb, int bytes) { /* Q6_K: ql[128], qh[64]; -32..31 */
    for (int i = 0; i < nb; i++, b += bytes, q += 256)
        for (int h = 0; h < 2; h++) { /* weight 128 h + 32 t + j: ql's nibble t / 2 of byte 64 h + 32 (t % 2) + j */
            int8_t *o = q + 128 * h;
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 32; j++)
                    o[32 * t + j] =
                        (int8_t)((((ql[32 * (t % 2) + j] >> (4 * (t / 2))) & 15) | ((qh[j] >> (2 * t)) & 3) << 4) - 32);
        }
}

/* Codes [n, k] of `n` rows of GGML type `ggml_type` stored back to back (`raw`, as in the file); 0, or -2 for
 * bad sizes or a type this does not read (the caller's numpy readers take those). */
int gguf_codes(int8_t *codes, const uint8_t *raw, int64_t n, int64_t k, int ggml_type, int threads) {
    int block = (ggml_type >= 12 && ggml_type <= 14) || ggml_type == 23 ? 256 : 32;
    int bytes = ggml_type == 2 ? 18 : ggml_type == 3 ? 20 : ggml_type == 6 ? 22 : ggml_type == 7 ? 24
              : ggml_type == 8 ? 34 : ggml_type == 12 ? 144 : ggml_type == 13 ? 176 : ggml_type == 14 ? 210
              : ggml_type == 39 ? 17 : ggml_type == 20 ? 18 : ggml_type == 23 ? 136 : 0;
    if (!bytes || n <= 0 || k <= 0 || k % block || !codes || !raw) return -2;
    int nb = (int)(k / block);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t r = 0; r < n; r++) {
        int8_t *q = codes + r * k;
        const uint8_t *b = raw + r * nb * (int64_t)bytes;
        switch (ggml_type) {
        case 2: codes_q4(q, b, nb, bytes, 2, 8); break; /* Q4_0: q - 8 (the q4_0 format's codes) */
        case 3: codes_q4(q, b, nb, bytes, 4, 0); break;
        case 39: codes_q4(q, b, nb, bytes, 1, 0); break; /* MXFP4: the E2M1 nibbles 0..15 after the E8M0 byte */
        case 20: codes_q4(q, b, nb, bytes, 2, 0); break; /* IQ4_NL: table indices 0..15 after the float16 d */
        case 23: /* IQ4_XS: 8 sub-blocks of 16 nibble bytes after d, scales_h and scales_l (8 bytes) */
            for (int i = 0; i < nb; i++) codes_q4(q + 256 * i, b + (int64_t)i * bytes + 8, 8, 16, 0, 0);
            break;
        case 6: codes_q5(q, b, nb, bytes, 2, 16); break;
        case 7: codes_q5(q, b, nb, bytes, 4, 0); break;
        case 8:
            for (int i = 0; i < nb; i++) memcpy(q + 32 * i, b + (int64_t)i * bytes + 2, 32);
            break;
        case 12: codes_k4(q, b, nb, bytes, 16, -1); break;
        case 13: codes_k4(q, b, nb, bytes, 48, 16); break;
        default: codes_k6(q, b, nb, bytes); break;
        }
    }
    return 0;
}
