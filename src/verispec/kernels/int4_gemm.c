/* y = x @ W.T in bf16 for decode-sized x and int4 weights W (verispec/kernels).
 *
 * Why: weight-only int4 reads a quarter of bf16's weight bytes, but torch's CPU kernel for it
 * (`_weight_int4pack_mm_for_cpu`) decoded Gemma 3 270M at 18 tok/s on the 2-core Ice Lake Xeon,
 * under the native int8 kernel's 29. Here each group of 64 output rows is one contiguous stream of
 * nibbles and one of scales, read once per call for every input row.
 *
 * Weights: w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g], q in 0..15, g = k / 32 (the group's scale
 * and zero in bf16, as models/quant.py fits them).
 *
 * Layout: Q [N, K] is stored as groups of 64 rows, [ceil(N / 64), K, 32] bytes: for input column
 * k, byte j of the group holds row j in its low nibble and row j + 32 in its high nibble, so one
 * 16-byte (AVX512) or 8-byte (AVX2) load gives 16 or 8 rows' codes. Scales and zeros are
 * [ceil(N / 64), K / 32, 64] bf16: the 64 rows of a group and an input group side by side.
 *
 * Numerics, output (m, n), per input group g in order: a = the sum over its 32 columns, in order,
 * of x[m, k] * q[n, k] in one fp32 lane (each product exact: an 8-bit mantissa times 4 bits),
 * sx = the sum of those x[m, k] in fp32 in order; then
 *     acc = fma(a, s, fma(sx, fma(-8, s, z), acc))
 * (x . ((q - 8) s + z) over the group, rearranged so that the codes need no offset), and the end
 * result is rounded to bf16 (nearest even). Nothing depends on M, on the tile a row shares, or on
 * the thread count: a row's result is the same bits in any call, on AVX512 and on AVX2.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define GROUP 64   /* output rows per packed group */
#define QGROUP 32  /* input columns per scale and zero */
#define PREFETCH_AHEAD 2048

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LANES 16
#define WIDE_BLOCKS 4  /* up to 2 rows: the whole group per pass */
#define WIDE_TILE 2
#define TALL_BLOCKS 1  /* 3 rows or more: one 16-row block per pass, 8 rows (16 of 32 registers hold sums) */
#define TALL_TILE 8
typedef __m512 vf;
static inline vf load_nibbles(const uint8_t *p, int high) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (high) v = _mm512_srli_epi32(v, 4);
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
}
static inline vf load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#define FMADD _mm512_fmadd_ps
#define SPLAT _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define STOREF _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define WIDE_BLOCKS 4  /* 1 row: half a group per pass */
#define WIDE_TILE 1
#define TALL_BLOCKS 1  /* 2 rows or more: one 8-row block per pass, 4 rows (8 of 16 registers hold sums) */
#define TALL_TILE 4
typedef __m256 vf;
static inline vf load_nibbles(const uint8_t *p, int high) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (high) v = _mm256_srli_epi32(v, 4);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
}
static inline vf load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define FMADD _mm256_fmadd_ps
#define SPLAT _mm256_set1_ps
#define ZERO _mm256_setzero_ps
#define STOREF _mm256_storeu_ps
#else
#error "verispec kernels need AVX2 and FMA"
#endif

#define BLOCKS (GROUP / LANES)

/* MT rows of xf (fp32) from m0 against blocks b0 .. b0 + PB of one row group: qg its codes
 * [K, 32], sg / zg its scales and zeros [K / 32, 64]. MT and PB are constants at every call (the
 * loops unroll, the sums stay in registers). A pass unpacks its blocks' nibbles once for all its
 * rows, so a verify step's 6 rows take one pass per block instead of three passes of 2 rows. */
static inline __attribute__((always_inline)) void group_rows(
        const float *xf, const float *sx, const uint8_t *qg, const uint16_t *sg, const uint16_t *zg,
        uint16_t *y, int m0, const int MT, const int PB, int n0, int b0, int N, int K) {
    const int G = K / QGROUP;
    vf acc[8][4], part[8][4];  /* at most: the unused ones are never touched */
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PB; t++) acc[i][t] = ZERO();
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < MT; i++)
            for (int t = 0; t < PB; t++) part[i][t] = ZERO();
        for (int k = g * QGROUP; k < (g + 1) * QGROUP; k++) {
            const uint8_t *qk = qg + (size_t)k * (GROUP / 2);
            _mm_prefetch((const char *)qk + PREFETCH_AHEAD, _MM_HINT_T0);
            for (int t = 0; t < PB; t++) {
                int row = (b0 + t) * LANES;  /* within the group; a block lies in one half */
                vf w = load_nibbles(qk + row % (GROUP / 2), row >= GROUP / 2);
                for (int i = 0; i < MT; i++)
                    part[i][t] = FMADD(w, SPLAT(xf[(size_t)(m0 + i) * K + k]), part[i][t]);
            }
        }
        for (int t = 0; t < PB; t++) {
            int row = (b0 + t) * LANES;
            vf s = load_bf16(sg + (size_t)g * GROUP + row), z = load_bf16(zg + (size_t)g * GROUP + row);
            vf offset = FMADD(SPLAT(-8.0f), s, z);  /* z - 8 s */
            for (int i = 0; i < MT; i++)
                acc[i][t] = FMADD(part[i][t], s, FMADD(SPLAT(sx[(size_t)(m0 + i) * G + g]), offset, acc[i][t]));
        }
    }
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PB; t++) {
            int n = n0 + (b0 + t) * LANES;
            if (n >= N) break;
            float v[LANES];
            STOREF(v, acc[i][t]);
            uint16_t *out = y + (size_t)(m0 + i) * N + n;
            for (int l = 0; l < LANES && n + l < N; l++) out[l] = to_bf16(v[l]);
        }
}

/* All M rows against one row group, TILE rows and PB blocks a pass (both constants). */
static inline __attribute__((always_inline)) void group_all_rows(
        const float *xf, const float *sx, const uint8_t *qg, const uint16_t *sg, const uint16_t *zg,
        uint16_t *y, int M, const int TILE, const int PB, int n0, int N, int K) {
    for (int b0 = 0; b0 < BLOCKS; b0 += PB) {
        if (n0 + b0 * LANES >= N) break;
        int m0 = 0;
        for (; m0 + TILE <= M; m0 += TILE) group_rows(xf, sx, qg, sg, zg, y, m0, TILE, PB, n0, b0, N, K);
        switch (M - m0) {  /* constant tile heights, so each is unrolled */
            case 7: if (TILE > 7) group_rows(xf, sx, qg, sg, zg, y, m0, 7, PB, n0, b0, N, K); break;
            case 6: if (TILE > 6) group_rows(xf, sx, qg, sg, zg, y, m0, 6, PB, n0, b0, N, K); break;
            case 5: if (TILE > 5) group_rows(xf, sx, qg, sg, zg, y, m0, 5, PB, n0, b0, N, K); break;
            case 4: if (TILE > 4) group_rows(xf, sx, qg, sg, zg, y, m0, 4, PB, n0, b0, N, K); break;
            case 3: if (TILE > 3) group_rows(xf, sx, qg, sg, zg, y, m0, 3, PB, n0, b0, N, K); break;
            case 2: if (TILE > 2) group_rows(xf, sx, qg, sg, zg, y, m0, 2, PB, n0, b0, N, K); break;
            case 1: if (TILE > 1) group_rows(xf, sx, qg, sg, zg, y, m0, 1, PB, n0, b0, N, K); break;
        }
    }
}

/* x [M, K] bf16 (K a multiple of 32), qp / scale / zero packed as above, y [M, N] bf16. */
void verispec_int4_gemm(const uint16_t *x, const uint8_t *qp, const uint16_t *scale, const uint16_t *zero,
                        uint16_t *y, int M, int N, int K, int threads) {
    const int G = K / QGROUP;
    float *xf = (float *)malloc((size_t)M * K * sizeof(float));
    float *sx = (float *)malloc((size_t)M * G * sizeof(float));
    if (!xf || !sx) abort();
    for (size_t e = 0; e < (size_t)M * K; e++) xf[e] = from_bf16(x[e]);
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.0f;
            for (int k = g * QGROUP; k < (g + 1) * QGROUP; k++) s += xf[(size_t)m * K + k];
            sx[(size_t)m * G + g] = s;
        }
    int groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int grp = 0; grp < groups; grp++) {
        const uint8_t *qg = qp + (size_t)grp * K * (GROUP / 2);
        const uint16_t *sg = scale + (size_t)grp * G * GROUP, *zg = zero + (size_t)grp * G * GROUP;
        if (M <= WIDE_TILE)
            group_all_rows(xf, sx, qg, sg, zg, y, M, WIDE_TILE, WIDE_BLOCKS, grp * GROUP, N, K);
        else
            group_all_rows(xf, sx, qg, sg, zg, y, M, TALL_TILE, TALL_BLOCKS, grp * GROUP, N, K);
    }
    free(xf);
    free(sx);
}
