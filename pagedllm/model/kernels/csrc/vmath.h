/* Vector math on simd.h's vf for the kernels' activations (model_step.c, moe.c): libm's scalar expf per element
 * would cost more than the matmul's share of an MLP row. */
#ifndef PAGEDLLM_VMATH_H
#define PAGEDLLM_VMATH_H
#include "simd.h"

/* e^x for VW floats (Cephes' expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp), clamped to
 * float's range (e^-88 ~ 0, e^88 ~ 1.6e38) instead of overflowing. */
static inline vf vexp(vf x) {
    const vf hi = x * 0 + 88.3762626647949f, lo = x * 0 - 87.3365447504019f;
    vi over = x > hi, under = x < lo; /* lanes of -1 where true: C has no vector ?: */
    x = (vf)(((vi)hi & over) | ((vi)x & ~over));
    x = (vf)(((vi)lo & under) | ((vi)x & ~under));
    const vf t = x * 1.44269504088896341f + 12582912.0f; /* round(x / ln 2) in the low mantissa bits */
    const vi bits = (vi)t;
    const vf n = t - 12582912.0f;
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    const vf z = x * x;
    vf y = 1.9875691500E-4f * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    return y * (vf)((bits - 0x4B400000 + 127) << 23);
}

/* Lane-wise clamps by masks; a NaN in `a` stays NaN, as in torch's clamp. */
static inline vf vmin(vf a, vf b) {
    const vi gt = a > b;
    return (vf)(((vi)b & gt) | ((vi)a & ~gt));
}
static inline vf vmax(vf a, vf b) {
    const vi lt = a < b;
    return (vf)(((vi)b & lt) | ((vi)a & ~lt));
}
#endif
