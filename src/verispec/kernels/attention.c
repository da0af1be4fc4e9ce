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
 * Masked keys are never read, so padding (and whatever the cache holds there) cannot change a row.
 * A row with no unmasked key gets zeros. Plain C, vectorized by the compiler: the same bits on
 * every instruction set.
 *
 * Shapes: q [B, h, T, hd] dense; K, V [B, kvh, Lk, hd] with the given strides (elements; a row's hd
 * values dense); mask [B, T, Lk] bytes with strides (mb, mt) and dense keys; out [B, h, T, hd]
 * dense. The h / kvh query heads of KV head j are j * g ... j * g + g - 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define LANES 16
#define TILE 4  /* query rows sharing each key's pass (the key and value rows stay in L1) */

static inline float dot(const float *q, const uint16_t *k, int hd) {
    float acc[LANES] = {0};
    int d = 0;
    for (; d + LANES <= hd; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(q[d + l], from_bf16(k[d + l]), acc[l]);
    for (int l = 0; d + l < hd; l++) acc[l] = fmaf(q[d + l], from_bf16(k[d + l]), acc[l]);
    return sum16(acc);
}

static inline void axpy(float *o, float w, const uint16_t *v, int hd) {
    for (int d = 0; d < hd; d++) o[d] = fmaf(w, from_bf16(v[d]), o[d]);
}

void verispec_attention_bf16(const uint16_t *q, const uint16_t *K, const uint16_t *V, const uint8_t *mask,
                             uint16_t *out, int B, int h, int kvh, int T, int Lk, int hd,
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
        const uint16_t *Kj = K + b * kb + j * kh, *Vj = V + b * vb + j * vh;
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
        for (int l = 0; l < Lk; l++)
            for (int r = 0; r < R; r++)
                if (m[r][l]) {
                    float x = from_bf16(to_bf16(dot(qf + r * hd, Kj + l * kl, hd))) * scale;
                    s[r * Lk + l] = softcap > 0.0f ? tanhf(x / softcap) * softcap : x;
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
        for (int l = 0; l < Lk; l++)
            for (int r = 0; r < R; r++)
                if (m[r][l]) axpy(o + r * hd, s[r * Lk + l], Vj + l * vl, hd);
        for (int r = 0; r < R; r++)
            for (int d = 0; d < hd; d++) outr[r][d] = to_bf16(o[r * hd + d]);
        free(buf);
    }
}
