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
#define WIDE_BLOCKS 4  /* up to 4 rows: the whole group per pass */
#define WIDE_TILE 4
#define TALL_BLOCKS 2  /* 5 rows or more: half a group per pass, 8 rows (16 accumulators of 32 registers) */
#define TALL_TILE 8
typedef __m512 vf;
#define LOAD_Q(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define FMADD _mm512_fmadd_ps
#define SPLAT _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define STOREF _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define WIDE_BLOCKS 4  /* half a group per pass */
#define WIDE_TILE 2
#define TALL_BLOCKS 2  /* 3 rows or more: a quarter of a group, 4 rows (8 accumulators of 16 registers) */
#define TALL_TILE 4
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

/* MT rows of xf (fp32) from m0 against blocks b0 .. b0 + PB of one group (MT and PB constants at
 * every call, so the loops unroll and the accumulators stay in registers). A pass widens its
 * blocks' codes once for all its rows: the more rows a pass takes, the less widening per row
 * (a 6-row verify step took two passes of 4 + 2 rows and ran the LM head at half the speed of
 * one row; its FMAs alone fit in one pass of 8 rows over half a group). */
static inline __attribute__((always_inline)) void group_rows(
        const float *xf, const int8_t *qg, const uint16_t *scale, uint16_t *y,
        int m0, const int MT, const int PB, int n0, int b0, int N, int K) {
    vf acc[8][4];  /* at most: the unused ones are never touched (MT, PB are constants) */
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PB; t++) acc[i][t] = ZERO();
    for (int k = 0; k < K; k++) {
        const int8_t *qk = qg + (size_t)k * GROUP + b0 * LANES;
        _mm_prefetch((const char *)qk + PREFETCH_AHEAD, _MM_HINT_T0);
        for (int t = 0; t < PB; t++) {
            vf w = LOAD_Q(qk + t * LANES);
            for (int i = 0; i < MT; i++)
                acc[i][t] = FMADD(w, SPLAT(xf[(size_t)(m0 + i) * K + k]), acc[i][t]);
        }
    }
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PB; t++) {
            int n = n0 + (b0 + t) * LANES;
            if (n >= N) break;
            float v[LANES];
            STOREF(v, acc[i][t]);
            uint16_t *out = y + (size_t)(m0 + i) * N + n;
            for (int l = 0; l < LANES && n + l < N; l++) out[l] = to_bf16(v[l] * from_bf16(scale[n + l]));
        }
}

/* All M rows against one group, TILE rows and PB blocks a pass (both constants). */
static inline __attribute__((always_inline)) void group_all_rows(
        const float *xf, const int8_t *qg, const uint16_t *scale, uint16_t *y,
        int M, const int TILE, const int PB, int n0, int N, int K) {
    for (int b0 = 0; b0 < BLOCKS; b0 += PB) {
        if (n0 + b0 * LANES >= N) break;
        int m0 = 0;
        for (; m0 + TILE <= M; m0 += TILE) group_rows(xf, qg, scale, y, m0, TILE, PB, n0, b0, N, K);
        switch (M - m0) {  /* constant tile heights, so each is unrolled */
            case 7: if (TILE > 7) group_rows(xf, qg, scale, y, m0, 7, PB, n0, b0, N, K); break;
            case 6: if (TILE > 6) group_rows(xf, qg, scale, y, m0, 6, PB, n0, b0, N, K); break;
            case 5: if (TILE > 5) group_rows(xf, qg, scale, y, m0, 5, PB, n0, b0, N, K); break;
            case 4: if (TILE > 4) group_rows(xf, qg, scale, y, m0, 4, PB, n0, b0, N, K); break;
            case 3: if (TILE > 3) group_rows(xf, qg, scale, y, m0, 3, PB, n0, b0, N, K); break;
            case 2: if (TILE > 2) group_rows(xf, qg, scale, y, m0, 2, PB, n0, b0, N, K); break;
            case 1: group_rows(xf, qg, scale, y, m0, 1, PB, n0, b0, N, K); break;
        }
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
        if (M <= WIDE_TILE)
            group_all_rows(xf, qg, scale, y, M, WIDE_TILE, WIDE_BLOCKS, g * GROUP, N, K);
        else
            group_all_rows(xf, qg, scale, y, M, TALL_TILE, TALL_BLOCKS, g * GROUP, N, K);
    }
    free(xf);
}
