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
 * Rows: `groups` groups of `per` rows of D contiguous values; group g starts at x + g * stride
 * (a head-split view of a fused projection's output is such a tensor). Output is dense.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __mmask16 lanes(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

void verispec_rms_norm_bf16(const uint16_t *x, const float *scale, const uint16_t *residual, uint16_t *y,
                            int groups, int per, long stride, int D, float eps, int gemma, int threads) {
    long rows = (long)groups * per;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * D >= (1 << 16))
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + (r / per) * stride + (r % per) * (long)D;
        __m512 acc = _mm512_setzero_ps();
        for (int k = 0; k < D; k += 16) {
            __m512 v = load_bf16(xr + k, lanes(D - k));
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)D + eps);
        __m512 vinv = _mm512_set1_ps(inv);
        for (int k = 0; k < D; k += 16) {
            __mmask16 m = lanes(D - k);
            __m512 v = _mm512_mul_ps(load_bf16(xr + k, m), vinv);
            __m512 s = _mm512_maskz_loadu_ps(m, scale + k);
            if (gemma) {
                v = _mm512_mul_ps(v, s);
            } else {  /* round x * r to bf16 first, as torch's .type_as does before the weight */
                __m256bh t = _mm512_cvtneps_pbh(v);
                v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)t), 16)), s);
            }
            __m256bh out = _mm512_cvtneps_pbh(v);
            if (residual) {
                __m512 o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)out), 16));
                out = _mm512_cvtneps_pbh(_mm512_add_ps(load_bf16(residual + r * (long)D + k, m), o));
            }
            _mm256_mask_storeu_epi16((void *)(y + r * (long)D + k), m, (__m256i)out);
        }
    }
}
