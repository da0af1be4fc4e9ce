/* y = x @ W.T (+ b) in bf16 for decode-sized x, on CPUs with AVX512-BF16 (verispec/kernels).
 *
 * Why a kernel of our own: a decode step multiplies a handful of rows by every weight once, so it
 * should run at the speed of reading the weights. oneDNN's bf16 kernels reach about half of that
 * on the 2-core AVX512-BF16 EPYC, and a lone row rounds differently from the same row among others
 * once K > 1024, which invariant mode has to pad around.
 *
 * Layout: W [N, K] is stored as groups of 64 rows, [ceil(N / 64), K / 2, 64, 2]: for one pair
 * of input columns (k, k + 1), the 64 rows' two weights lie next to each other, so one 64-byte
 * load holds 16 rows' pairs and `vdpbf16ps` adds x[k] w[n, k] + x[k + 1] w[n, k + 1] into 16
 * fp32 lanes, one per output row. A group's weights are one contiguous stream.
 *
 * Numerics: output (m, n) is one fp32 lane that adds the K / 2 pair products in order of k, plus
 * the bias, and is rounded to bf16 (nearest even). Nothing about that depends on M, on which
 * rows share a tile, or on the thread count, so a row's result is the same bits in any call:
 * batch invariance by construction, not by measurement.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BLOCKS 4              /* 16-row blocks per group */
#define GROUP (16 * BLOCKS)   /* weight rows per group */
#define TILE 4                /* input rows per pass over a group (16 accumulators) */

/* MT (1 to TILE) input rows from m0 against one group of GROUP weight rows starting at n0. */
static inline __attribute__((always_inline)) void group_rows(
        const uint16_t *x, const uint16_t *wg, const float *bias, uint16_t *y,
        int m0, const int MT, int n0, int N, int K) {
    __m512 acc[TILE][BLOCKS];
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < BLOCKS; t++) acc[i][t] = _mm512_setzero_ps();
    for (int j = 0; j < K / 2; j++) {
        __m512i xj[TILE];
        for (int i = 0; i < MT; i++) {  /* x[m, 2j], x[m, 2j + 1] broadcast to every lane */
            int32_t pair;
            memcpy(&pair, x + (size_t)(m0 + i) * K + 2 * j, sizeof pair);
            xj[i] = _mm512_set1_epi32(pair);
        }
        const uint16_t *wj = wg + (size_t)j * GROUP * 2;
        for (int t = 0; t < BLOCKS; t++) {
            __m512i w = _mm512_loadu_si512((const void *)(wj + t * 32));
            for (int i = 0; i < MT; i++)
                acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)xj[i], (__m512bh)w);
        }
    }
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < BLOCKS; t++) {
            int n = n0 + 16 * t;
            if (n >= N) break;
            __mmask16 live = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
            __m512 s = acc[i][t];
            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(live, bias + n));
            _mm256_mask_storeu_epi16((void *)(y + (size_t)(m0 + i) * N + n), live, (__m256i)_mm512_cvtneps_pbh(s));
        }
}

/* x [M, K] bf16 (K even), wp packed as above, bias [N] fp32 or NULL, y [M, N] bf16. */
void verispec_bf16_gemm(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y,
                        int M, int N, int K, int threads) {
    int groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        const uint16_t *wg = wp + (size_t)g * (K / 2) * GROUP * 2;
        int m0 = 0;
        for (; m0 + TILE <= M; m0 += TILE) group_rows(x, wg, bias, y, m0, TILE, g * GROUP, N, K);
        switch (M - m0) {  /* constant tile heights, so each is unrolled */
            case 3: group_rows(x, wg, bias, y, m0, 3, g * GROUP, N, K); break;
            case 2: group_rows(x, wg, bias, y, m0, 2, g * GROUP, N, K); break;
            case 1: group_rows(x, wg, bias, y, m0, 1, g * GROUP, N, K); break;
        }
    }
}
