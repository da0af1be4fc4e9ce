/* y = x @ W.T (+ b) in bf16 for decode-sized x, on x86-64 CPUs with AVX2 or better (verispec/kernels).
 *
 * Why a kernel of our own: a decode step multiplies a handful of rows by every weight once, so it
 * should run at the speed of reading the weights. oneDNN's bf16 kernels reach about half of that
 * on the 2-core AVX512-BF16 EPYC, and a lone row rounds differently from the same row among others
 * once K > 1024, which invariant mode has to pad around. Where the CPU has no bf16 arithmetic,
 * torch's bf16 matmuls are slower still (2+ rows cost several times one row).
 *
 * Layout: W [N, K] is stored as groups of 64 rows, [ceil(N / 64), K / 2, 64, 2]: for one pair
 * of input columns (k, k + 1), the 64 rows' two weights lie next to each other, so one vector
 * load holds 16 (8 for AVX2) rows' pairs. A group's weights are one contiguous stream.
 *
 * One source, three instruction sets, chosen when compiled with -march=native:
 * - AVX512-BF16: `vdpbf16ps` adds x[k] w[n, k] + x[k + 1] w[n, k + 1] into 16 fp32 lanes, one
 *   per output row;
 * - AVX512 (BW) and AVX2 + FMA: a bf16 is the top half of an fp32, so the pair's two weights are
 *   one shift and one mask away from two fp32 vectors, and two fused multiply-adds take the
 *   pair (x is widened to fp32 once per call).
 *
 * Numerics: output (m, n) is one fp32 lane that adds the pair products in order of k, plus the
 * bias, and is rounded to bf16 (nearest even). Nothing about that depends on M, on which rows
 * share a tile, or on the thread count, so a row's result is the same bits in any call: batch
 * invariance by construction, not by measurement. (The instruction sets round the products
 * differently, so bits differ between CPUs, never between calls on one.)
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"

#define GROUP 64  /* weight rows per packed group */
/* Bytes ahead of the column pair in use that each pass asks the memory system for. Without it the
 * hardware prefetcher alone kept the LM head's stream at 16-17 GB/s on the 2-core Ice Lake Xeon
 * (20-21 with it) and at 20 GB/s on the 2-core Emerald Rapids Xeon (30 with it; 1,024 and 2,048
 * bytes gave 24 and 26.5, 8,192 no more than 4,096). */
#define PREFETCH_AHEAD 4096

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISA "avx512-bf16"
#define BLOCKS 4              /* 16-row blocks per group */
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
        for (int b = 0; b < GROUP * 4; b += 64)  /* the 4 lines of the pair PREFETCH_AHEAD bytes ahead */
            _mm_prefetch((const char *)wj + PREFETCH_AHEAD + b, _MM_HINT_T0);
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

#ifdef VERISPEC_AMX
/* AMX: `tdpbf16ps` multiplies a tile of up to 16 input rows by 32 input columns against a tile of
 * 32 columns (16 pairs) by 16 output rows in one instruction, so a step of 16 requests costs about
 * what one costs: the weights' reads, not the products, set the time (`vdpbf16ps` takes 4 input
 * rows a pass, and a 16-row LM head ran at a third of the speed of one row). The weight tiles are
 * read straight from the packed layout: 16 column pairs of one 16-row block lie 256 bytes apart.
 *
 * Numerics: output (m, n) is one fp32 accumulator that each instruction adds 16 column pairs'
 * exact products to (the hardware's fixed order and rounding), 32 columns at a time in order of
 * k, then the bias, rounded to bf16. It depends on row m and column n alone, never on the row
 * count or the tile a row shares: batch-invariant, as the other paths. Every call on a machine
 * takes this path when its K is a multiple of 32 (decided by the weight's shape, never by M), so
 * a row has the same bits in any call; the bits differ from the `vdpbf16ps` path's. */
/* Rows m0 .. m0 + MT (MT <= 16, the tiles configured for it) against one group. */
static void amx_group_rows(const uint16_t *x, const uint16_t *wg, const float *bias, uint16_t *y,
                           int m0, int MT, int n0, int N, int K) {
    float acc[16 * GROUP];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += AMX_K) {
        const uint16_t *wk = wg + (size_t)(k / 2) * GROUP * 2;  /* 16 pairs x 64 rows x 2 = 4 KB */
        for (int b = 0; b < GROUP * 2 * AMX_K; b += 64)
            _mm_prefetch((const char *)wk + PREFETCH_AHEAD + b, _MM_HINT_T0);
        _tile_loadd(4, x + (size_t)m0 * K + k, K * 2);
        _tile_loadd(5, wk, GROUP * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, wk + 32, GROUP * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, wk + 64, GROUP * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, wk + 96, GROUP * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, acc, GROUP * 4);
    _tile_stored(1, acc + 16, GROUP * 4);
    _tile_stored(2, acc + 32, GROUP * 4);
    _tile_stored(3, acc + 48, GROUP * 4);
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < GROUP && n0 + j < N; j++) {
            float v = acc[i * GROUP + j] + (bias ? bias[n0 + j] : 0.0f);
            y[(size_t)(m0 + i) * N + n0 + j] = to_bf16(v);
        }
}

static void amx_gemm(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y, int M, int N, int K,
                     int threads) {
    int groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel num_threads(threads)
    {
        int configured = 0;  /* the tile configuration is each thread's own */
        #pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const uint16_t *wg = wp + (size_t)g * (K / 2) * GROUP * 2;
            for (int m0 = 0; m0 < M; m0 += 16) {
                int MT = M - m0 < 16 ? M - m0 : 16;
                if (MT != configured) {
                    verispec_amx_configure(MT);
                    configured = MT;
                }
                amx_group_rows(x, wg, bias, y, m0, MT, g * GROUP, N, K);
            }
        }
        if (configured) _tile_release();
    }
}
#endif

/* x [M, K] bf16 (K even), wp packed as above, bias [N] fp32 or NULL, y [M, N] bf16. */
void verispec_bf16_gemm(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y,
                        int M, int N, int K, int threads) {
#ifdef VERISPEC_AMX
    if (K % AMX_K == 0 && verispec_amx_enabled()) {
        amx_gemm(x, wp, bias, y, M, N, K, threads);
        return;
    }
#endif
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

#else  /* fp32 fused multiply-adds on widened bf16 */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISA "avx512"
#define LANES 16
#define PASS_BLOCKS 4  /* LANES-row blocks of a group per pass: the whole group */
#define TILE 4         /* input rows per pass (16 accumulators of 32 registers) */
typedef __m512 vf;
typedef __m512i vi;
#define LOAD_W(p) _mm512_loadu_si512((const void *)(p))
#define LOW_HALF(w) _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
#define HIGH_HALF(w) _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)))
#define FMADD _mm512_fmadd_ps
#define SPLAT _mm512_set1_ps
#define ZERO _mm512_setzero_ps

/* n live lanes of fp32 s (+ bias), rounded to bf16 (nearest even, NaN to 0x7fc0), stored at out. */
static inline void store_bf16(uint16_t *out, vf s, const float *bias, int live_n) {
    __mmask16 live = live_n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << live_n) - 1);
    if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(live, bias));
    __m512i u = _mm512_castps_si512(s);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16((void *)out, live, _mm512_cvtepi32_epi16(r));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
#define LANES 8
#define PASS_BLOCKS 4  /* half a group per pass: 16 registers hold 8 accumulators + operands */
#define TILE 2
typedef __m256 vf;
typedef __m256i vi;
#define LOAD_W(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOW_HALF(w) _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
#define HIGH_HALF(w) _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)))
#define FMADD _mm256_fmadd_ps
#define SPLAT _mm256_set1_ps
#define ZERO _mm256_setzero_ps

static inline void store_bf16(uint16_t *out, vf s, const float *bias, int live_n) {
    float v[8];
    _mm256_storeu_ps(v, s);
    for (int l = 0; l < live_n && l < 8; l++) out[l] = to_bf16(bias ? v[l] + bias[l] : v[l]);
}

#else
#error "verispec kernels need AVX2 and FMA"
#endif

#define BLOCKS (GROUP / LANES)
#define PASS_BYTES (PASS_BLOCKS * LANES * 4)  /* weight bytes a pass reads per column pair */

/* MT (1 to TILE) rows of xf (fp32) from m0 against blocks b0 .. b0 + PASS_BLOCKS of one group. */
static inline __attribute__((always_inline)) void group_rows(
        const float *xf, const uint16_t *wg, const float *bias, uint16_t *y,
        int m0, const int MT, int n0, int b0, int N, int K) {
    vf acc[TILE][PASS_BLOCKS];
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PASS_BLOCKS; t++) acc[i][t] = ZERO();
    for (int j = 0; j < K / 2; j++) {
        const uint16_t *wj = wg + ((size_t)j * GROUP + (size_t)b0 * LANES) * 2;
        for (int b = 0; b < PASS_BYTES; b += 64)
            _mm_prefetch((const char *)wj + PREFETCH_AHEAD + b, _MM_HINT_T0);
        for (int t = 0; t < PASS_BLOCKS; t++) {
            vi w = LOAD_W(wj + t * LANES * 2);
            vf even = LOW_HALF(w), odd = HIGH_HALF(w);  /* w[n, 2j], w[n, 2j + 1] for LANES rows n */
            for (int i = 0; i < MT; i++) {
                const float *xr = xf + (size_t)(m0 + i) * K + 2 * j;
                acc[i][t] = FMADD(odd, SPLAT(xr[1]), FMADD(even, SPLAT(xr[0]), acc[i][t]));
            }
        }
    }
    for (int i = 0; i < MT; i++)
        for (int t = 0; t < PASS_BLOCKS; t++) {
            int n = n0 + (b0 + t) * LANES;
            if (n >= N) break;
            store_bf16(y + (size_t)(m0 + i) * N + n, acc[i][t], bias ? bias + n : NULL, N - n);
        }
}

void verispec_bf16_gemm(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y,
                        int M, int N, int K, int threads) {
    float *xf = (float *)malloc((size_t)M * K * sizeof(float));
    if (!xf) abort();
    for (size_t e = 0; e < (size_t)M * K; e++) {  /* bf16 -> fp32 is exact: the top 16 bits */
        uint32_t u = (uint32_t)x[e] << 16;
        memcpy(xf + e, &u, sizeof u);
    }
    int groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int g = 0; g < groups; g++) {
        const uint16_t *wg = wp + (size_t)g * (K / 2) * GROUP * 2;
        for (int b0 = 0; b0 < BLOCKS; b0 += PASS_BLOCKS) {
            if (g * GROUP + b0 * LANES >= N) break;
            int m0 = 0;
            for (; m0 + TILE <= M; m0 += TILE) group_rows(xf, wg, bias, y, m0, TILE, g * GROUP, b0, N, K);
            switch (M - m0) {  /* constant tile heights, so each is unrolled */
#if TILE > 3
                case 3: group_rows(xf, wg, bias, y, m0, 3, g * GROUP, b0, N, K); break;
#endif
#if TILE > 2
                case 2: group_rows(xf, wg, bias, y, m0, 2, g * GROUP, b0, N, K); break;
#endif
                case 1: group_rows(xf, wg, bias, y, m0, 1, g * GROUP, b0, N, K); break;
            }
        }
    }
    free(xf);
}
#endif

/* Which the library was built for ("avx512-bf16", "avx512" or "avx2"), "amx-bf16" where it also
 * runs AMX (a shape whose K is a multiple of 32 then takes it). */
const char *verispec_kernel_isa(void) {
#ifdef VERISPEC_AMX
    if (verispec_amx_enabled()) return "amx-bf16";
#endif
    return ISA;
}
