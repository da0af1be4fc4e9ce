/* RMSNorm of bf16 rows in fp32, rounded to bf16, optionally added to a residual (verispec/kernels).
 *
 * Why: a decode step of Gemma 3 270M runs 109 norms on one row each, and torch's CPU rms_norm is
 * a chain of about ten small operators (casts, pow, mean, add, rsqrt, mul, ...), each a few
 * microseconds of dispatch for a few hundred values. This is one call.
 *
 * Numerics, per row of D values: s = sum of x^2 in fp32 (16 lanes, each adding its values in
 * order, then the lanes in a fixed tree), r = 1 / sqrt(s / D + eps), and
 *   gemma (scale = 1 + w in fp32):  y = bf16(x * r * scale)
 *   llama (scale = w, a bf16 value): y = bf16(bf16(x * r) * scale)   (torch's order of roundings)
 * and with a residual, out = bf16(residual + y). A row's result depends on that row alone.
 *
 * Plain C, vectorized by the compiler for whatever the CPU has: the same bits on any of them (the
 * 16 partial sums are those of 16 vector lanes, added as _mm512_reduce_add_ps adds them).
 *
 * Rows: `groups` groups of `per` rows of D contiguous values; group g starts at x + g * stride
 * (a head-split view of a fused projection's output is such a tensor). Output is dense.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define LANES 16

void verispec_rms_norm_bf16(const uint16_t *x, const float *scale, const uint16_t *residual, uint16_t *y,
                            int groups, int per, long stride, int D, float eps, int gemma, int threads) {
    long rows = (long)groups * per;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * D >= (1 << 16))
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + (r / per) * stride + (r % per) * (long)D;
        uint16_t *yr = y + r * (long)D;
        float acc[LANES] = {0};
        int k = 0;
        for (; k + LANES <= D; k += LANES)
            for (int l = 0; l < LANES; l++) acc[l] = fmaf(from_bf16(xr[k + l]), from_bf16(xr[k + l]), acc[l]);
        for (int l = 0; k + l < D; l++) acc[l] = fmaf(from_bf16(xr[k + l]), from_bf16(xr[k + l]), acc[l]);
        float inv = 1.0f / sqrtf(sum16(acc) / (float)D + eps);
        for (int e = 0; e < D; e++) {
            float v = from_bf16(xr[e]) * inv;
            /* llama rounds x * r to bf16 first, as torch's .type_as does before the weight */
            uint16_t out = to_bf16(gemma ? v * scale[e] : from_bf16(to_bf16(v)) * scale[e]);
            yr[e] = residual ? to_bf16(from_bf16(residual[r * (long)D + e]) + from_bf16(out)) : out;
        }
    }
}
