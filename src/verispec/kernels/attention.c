/* Attention of bf16 queries over a bf16 KV cache, each query row on its own (verispec/kernels).
 *
 * Why: speculative output equals plain output only if a token's attention has the same bits in a
 * one-token decode step, in a verify window of k + 1 tokens, beside other requests, and over a
 * key range rounded up to a bucket. torch's bf16 batched matmuls give a row other bits with the
 * row count and the inner length on CPUs without bf16 arithmetic (an Ice Lake Xeon: 2 rows against
 * 16 at 1,024 keys, 1,024 keys against 1,536 with the extra weights zero). Here a row's result is
 * computed from that row's query, its unmasked keys and values and nothing else, in a fixed order.
 *
 * Numerics, for one query row q (fp32 copy of bf16) and its unmasked keys l, in increasing l:
 *   s_l = bf16(q . K_l) * scale      (the dot in 16 fp32 lanes, then a fixed tree; as a bf16 GEMM
 *                                     rounds its output)
 *   s_l = tanh(s_l / cap) * cap      when soft-capped
 *   w_l = bf16(exp(s_l - max) / sum) (fp32 softmax over the unmasked keys only)
 *   o   = bf16(sum_l w_l V_l)         (fp32, keys in order)
 * A key masked for a row is never used for it, so padding (and whatever the cache holds there)
 * cannot change the row. A row with no unmasked key gets zeros. AVX512, AVX2 or plain C, with the
 * same bits on each.
 *
 * Shapes: q [B, h, T, hd] dense; K, V [S, kvh, Lk, hd] with the given strides (elements; a row's hd
 * values dense), batch entry b reading entry slot[b] (slot NULL: entry b), so a decode batch reads
 * its requests' cache slots in place instead of gathering them first; mask [B, T, Lk] bytes with
 * strides (mb, mt) and dense keys; out [B, h, T, hd] dense. The h / kvh query heads of KV head j are j * g ... j * g + g - 1.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define LANES 16
#define TILE 4  /* query rows sharing each key's pass (each key and value row is loaded once for them) */

/* Both instruction sets keep 16 fp32 partial sums (lane l adds dims d = l mod 16 in order) and add
 * them in the same tree as sum16, so the bits are the same on either and in the plain C below. */
#if defined(__AVX512F__)
typedef __m512 acc16;
static inline acc16 acc_zero(void) { return _mm512_setzero_ps(); }
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline acc16 acc_fma(acc16 a, const float *q, const uint16_t *k) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(q), widen16(k), a);
}
static inline float acc_sum(acc16 a) { return _mm512_reduce_add_ps(a); }
static inline void axpy16(float *o, float w, const uint16_t *v) {
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(w), widen16(v), _mm512_loadu_ps(o)));
}
#define VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 lo, hi; } acc16;
static inline acc16 acc_zero(void) { acc16 a = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return a; }
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline acc16 acc_fma(acc16 a, const float *q, const uint16_t *k) {
    a.lo = _mm256_fmadd_ps(_mm256_loadu_ps(q), widen8(k), a.lo);
    a.hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), widen8(k + 8), a.hi);
    return a;
}
static inline float acc_sum(acc16 a) {
    float t[16];
    _mm256_storeu_ps(t, a.lo);
    _mm256_storeu_ps(t + 8, a.hi);
    return sum16(t);
}
static inline void axpy16(float *o, float w, const uint16_t *v) {
    __m256 ws = _mm256_set1_ps(w);
    _mm256_storeu_ps(o, _mm256_fmadd_ps(ws, widen8(v), _mm256_loadu_ps(o)));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(ws, widen8(v + 8), _mm256_loadu_ps(o + 8)));
}
#define VECTOR 1
#endif

/* q_r . k for R rows of qf (fp32, hd each) against one key row k. */
static inline void dots(const float *qf, int R, const uint16_t *k, int hd, float *out) {
#ifdef VECTOR
    if (hd % LANES == 0) {
        acc16 acc[TILE];
        for (int r = 0; r < R; r++) acc[r] = acc_zero();
        for (int d = 0; d < hd; d += LANES)
            for (int r = 0; r < R; r++) acc[r] = acc_fma(acc[r], qf + r * hd + d, k + d);
        for (int r = 0; r < R; r++) out[r] = acc_sum(acc[r]);
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        float acc[LANES] = {0};
        for (int d = 0; d < hd; d++) acc[d % LANES] = fmaf(qf[r * hd + d], from_bf16(k[d]), acc[d % LANES]);
        out[r] = sum16(acc);
    }
}

/* o_r += w_r v for the R rows whose key is visible (w_r of the others is not a number to use). */
static inline void axpys(float *o, const float *w, const uint8_t *live, int R, const uint16_t *v, int hd) {
#ifdef VECTOR
    if (hd % LANES == 0) {
        for (int d = 0; d < hd; d += LANES)
            for (int r = 0; r < R; r++)
                if (live[r]) axpy16(o + r * hd + d, w[r], v + d);
        return;
    }
#endif
    for (int r = 0; r < R; r++)
        if (live[r])
            for (int d = 0; d < hd; d++) o[r * hd + d] = fmaf(w[r], from_bf16(v[d]), o[r * hd + d]);
}

void verispec_attention_bf16(const uint16_t *q, const uint16_t *K, const uint16_t *V, const uint8_t *mask,
                             const int64_t *slot, uint16_t *out, int B, int h, int kvh, int T, int Lk, int hd,
                             long kb, long kh, long kl, long vb, long vh, long vl, long mb, long mt,
                             float scale, float softcap, int threads) {
    int g = h / kvh, rows = g * T;  /* query rows per KV head: (head in group, position) */
    int tile = (long)B * kvh * rows >= (long)threads * TILE ? TILE : 1;  /* enough items for every thread */
    int tiles = (rows + tile - 1) / tile;
    long items = (long)B * kvh * tiles;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long it = 0; it < items; it++) {
        int b = (int)(it / ((long)kvh * tiles)), j = (int)(it / tiles % kvh), r0 = (int)(it % tiles) * tile;
        int R = rows - r0 < tile ? rows - r0 : tile;
        long e = slot ? (long)slot[b] : b;  /* the K/V entry (cache slot) of batch entry b */
        const uint16_t *Kj = K + e * kb + j * kh, *Vj = V + e * vb + j * vh;
        float *buf = (float *)malloc(sizeof(float) * (size_t)R * (Lk + 2 * hd));
        if (!buf) abort();
        float *s = buf, *qf = buf + (size_t)R * Lk, *o = qf + (size_t)R * hd;  /* [R, Lk], [R, hd], [R, hd] */
        const uint8_t *m[TILE];
        const uint16_t *qr[TILE];
        uint16_t *outr[TILE];
        for (int r = 0; r < R; r++) {
            int head = j * g + (r0 + r) / T, t = (r0 + r) % T;
            qr[r] = q + (((size_t)b * h + head) * T + t) * hd;
            outr[r] = out + (((size_t)b * h + head) * T + t) * hd;
            m[r] = mask + b * mb + t * mt;
            for (int d = 0; d < hd; d++) qf[r * hd + d] = from_bf16(qr[r][d]), o[r * hd + d] = 0.0f;
        }
        for (int l = 0; l < Lk; l++) {  /* scores of the rows that see key l */
            uint8_t live[TILE], any = 0;
            for (int r = 0; r < R; r++) any |= live[r] = m[r][l];
            if (!any) continue;
            float x[TILE];
            dots(qf, R, Kj + l * kl, hd, x);
            for (int r = 0; r < R; r++)
                if (live[r]) {
                    float v = from_bf16(to_bf16(x[r])) * scale;
                    s[r * Lk + l] = softcap > 0.0f ? tanhf(v / softcap) * softcap : v;
                }
        }
        for (int r = 0; r < R; r++) {
            float mx = -INFINITY, sum = 0.0f;
            for (int l = 0; l < Lk; l++)
                if (m[r][l] && s[r * Lk + l] > mx) mx = s[r * Lk + l];
            for (int l = 0; l < Lk; l++)
                if (m[r][l]) sum += (s[r * Lk + l] = expf(s[r * Lk + l] - mx));
            for (int l = 0; l < Lk; l++)
                if (m[r][l]) s[r * Lk + l] = from_bf16(to_bf16(s[r * Lk + l] / sum));
        }
        for (int l = 0; l < Lk; l++) {  /* weighted values, keys in order */
            uint8_t live[TILE], any = 0;
            float w[TILE];
            for (int r = 0; r < R; r++) any |= live[r] = m[r][l], w[r] = live[r] ? s[r * Lk + l] : 0.0f;
            if (any) axpys(o, w, live, R, Vj + l * vl, hd);
        }
        for (int r = 0; r < R; r++)
            for (int d = 0; d < hd; d++) outr[r][d] = to_bf16(o[r * hd + d]);
        free(buf);
    }
}
