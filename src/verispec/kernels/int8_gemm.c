/* y = (x @ Q.T) * scale in bf16 for decode-sized x and int8 weights Q (verispec/kernels).
 *
 * Why: weight-only int8 halves the bytes a decode step reads, but torch's CPU kernel for it
 * (`_weight_int8pack_mm`) ran at about a third of the machine's read bandwidth on the 2-core Ice
 * Lake Xeon (int8 decoding was slower than bf16 on verispec's bf16 kernel). Here each group of 64
 * output rows is one contiguous stream of int8, read once per call for every input row.
 *
 * Layout: Q [N, K] is stored as groups of 64 rows, [ceil(N / 64), K, 64]: for one input column k
 * the 64 rows' weights lie next to each other (one cache line), so one load takes 16 (AVX512) or
 * 8 (AVX2) rows' weights, widened to fp32 (exact: |q| <= 127).
 *
 * Numerics: output (m, n) is one fp32 lane that adds x[m, k] * q[n, k] in order of k (each
 * product exact in fp32: an 8-bit bf16 mantissa times 7 bits), then times scale[n] (fp32 of the
 * bf16 scale), rounded to bf16 (nearest even). Nothing depends on M, on the tile a row shares, or
 * on the thread count: a row's result is the same bits in any call, and the same on AVX512 and
 * AVX2 (the same fused multiply-adds in the same order, lane by lane).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define GROUP 64
#define PREFETCH_AHEAD 4096

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LANES 16
#define PASS_BLOCKS 4  /* the whole group per pass */
#define TILE 4
typedef __m512 vf;
#define LOAD_Q(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define FMADD _mm512_fmadd_ps
#define SPLAT _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define STOREF _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define PASS_BLOCKS 4  /* half a group per pass */
#define TILE 2
typedef __m256 vf;
#define LOAD_Q(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define FMADD _mm256_fmadd_ps
#define SPLAT _mm256_set1_ps
#define ZERO _mm256_setzero_ps
#define STOREF _mm256_storeu_ps
#else
#error "verispec kernels need AVX2 and FMA"
#endif

#define BLOCKS (GROUP / LANES)

/* MT (1 to TILE) rows of xf (fp32) from m0 against blocks b0 .. b0 + PASS_BLOCKS of one group. */
static inline __attribute__((always_inline)) void group_rows(
        const float *xf, const int8_t *qg, const uint16_t *scale, uint16_t *y,
        int m0, const int MT, int n0, int b0, int N, int K) {
    vf acc[TILE][PASS_BLOCKS];
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PASS_BLOCKS; t++) acc[i][t] = ZERO();
    for (int k = 0; k < K; k++) {
        const int8_t *qk = qg + (size_t)k * GROUP + b0 * LANES;
        _mm_prefetch((const char *)qk + PREFETCH_AHEAD, _MM_HINT_T0);
        for (int t = 0; t < PASS_BLOCKS; t++) {
            vf w = LOAD_Q(qk + t * LANES);
            for (int i = 0; i < MT; i++)
                acc[i][t] = FMADD(w, SPLAT(xf[(size_t)(m0 + i) * K + k]), acc[i][t]);
        }
    }
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PASS_BLOCKS; t++) {
            int n = n0 + (b0 + t) * LANES;
            if (n >= N) break;
            float v[LANES];
            STOREF(v, acc[i][t]);
            uint16_t *out = y + (size_t)(m0 + i) * N + n;
            for (int l = 0; l < LANES && n + l < N; l++) out[l] = to_bf16(v[l] * from_bf16(scale[n + l]));
        }
}

/* x [M, K] bf16, qp packed as above, scale [N] bf16, y [M, N] bf16. */
void verispec_int8_gemm(const uint16_t *x, const int8_t *qp, const uint16_t *scale, uint16_t *y,
                        int M, int N, int K, int threads) {
    float *xf = (float *)malloc((size_t)M * K * sizeof(float));
    if (!xf) abort();
    for (size_t e = 0; e < (size_t)M * K; e++) xf[e] = from_bf16(x[e]);
    int groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        const int8_t *qg = qp + (size_t)g * K * GROUP;
        for (int b0 = 0; b0 < BLOCKS; b0 += PASS_BLOCKS) {
            if (g * GROUP + b0 * LANES >= N) break;
            int m0 = 0;
            for (; m0 + TILE <= M; m0 += TILE) group_rows(xf, qg, scale, y, m0, TILE, g * GROUP, b0, N, K);
            switch (M - m0) {  /* constant tile heights, so each is unrolled */
#if TILE > 3
                case 3: group_rows(xf, qg, scale, y, m0, 3, g * GROUP, b0, N, K); break;
#endif
#if TILE > 2
                case 2: group_rows(xf, qg, scale, y, m0, 2, g * GROUP, b0, N, K); break;
#endif
                case 1: group_rows(xf, qg, scale, y, m0, 1, g * GROUP, b0, N, K); break;
            }
        }
    }
    free(xf);
}
