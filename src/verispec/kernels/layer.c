/* A decoder layer at inference in two native calls, around the attention (verispec/kernels).
 *
 * Why: at batch 1 a layer of Gemma 3 270M reads 11 MB of weights, about 0.3 ms of memory time
 * in int8, yet its forward in Python cost about 0.2 ms more than its kernels: some thirty torch
 * operators and ctypes calls (views, splits, casts, the KV writes, the activation, the product)
 * each a few microseconds of dispatch for a few thousand values. Here the layer is
 *
 *   layer_pre:  norm -> qkv matmul -> q/k norms -> RoPE -> write k, v into the KV cache -> q
 *   (attention: kernels/attention.c, called from Python, which also routes token trees)
 *   layer_post: o matmul -> norms and residuals -> gate/up matmul -> act(g) * u -> down matmul
 *
 * built from the same kernels the Python path calls (rms_norm.c, rope.c, bf16_gemm.c,
 * int8_gemm.c, int4_gemm.c) in the same order, so every tensor has the bits it had there. Two
 * pieces are this file's own: the activation (silu or tanh-GELU, written x / (1 + e^-z) with
 * z = x or 2 sqrt(2/pi) (x + 0.044715 x^3), rounded to bf16, then times u, rounded again), and
 * the bias of a quantized projection (added to the rounded product in bf16, as torch adds).
 * Every value of a row depends on that row alone, so the layer is batch-invariant as its kernels are.
 *
 * Rows are the forward's entries, e = b * T + t: x [E, H] dense, cos / sin [B, T, hd] through
 * their strides, q out [B, h, T, hd] dense (what attention reads), the attention's output o
 * [B, h, T, hd] through its strides, and the layer's output [E, H].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

void verispec_bf16_gemm(const uint16_t *x, const uint16_t *wp, const float *bias, uint16_t *y,
                        int M, int N, int K, int threads);
void verispec_int8_gemm(const uint16_t *x, const int8_t *qp, const uint16_t *scale, uint16_t *y,
                        int M, int N, int K, int threads);
void verispec_int4_gemm(const uint16_t *x, const uint8_t *qp, const uint16_t *scale, const uint16_t *zero,
                        uint16_t *y, int M, int N, int K, int threads);
void verispec_rms_norm_bf16(const uint16_t *x, const float *scale, const uint16_t *residual, uint16_t *y,
                            int groups, int per, long stride, int D, float eps, int gemma, int threads);
void verispec_rope_bf16(const uint16_t *x, long xb, long xt, long xh, const uint16_t *cos, const uint16_t *sin,
                        long cb, long ct, uint16_t *out, int B, int T, int H, int hd);

enum { KIND_BF16 = 0, KIND_INT8 = 1, KIND_INT4 = 2 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* One projection's weights, as models/prepack.py (bf16) and models/quant.py (int8, int4) pack them. */
typedef struct {
    int kind, N, K;
    const void *w;              /* the packed weights */
    const uint16_t *scale;      /* int8: [N] bf16; int4: the packed group scales */
    const uint16_t *zero;       /* int4: the packed group zeros */
    const float *bias_f32;      /* bf16 kernel: added in fp32 before the rounding, or NULL */
    const uint16_t *bias_bf16;  /* int8 / int4: added to the rounded product in bf16, or NULL */
} vs_linear;

/* Everything of one layer that does not change between calls (mirrored by kernels/__init__.py). */
typedef struct {
    int H, heads, kv_heads, head_dim, inter;
    int gemma;                  /* Gemma's (1 + w) norms, four of them; else Llama's two */
    int act;                    /* ACT_SILU or ACT_GELU_TANH */
    float eps;
    const float *in_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm;  /* fp32 scales; pre_ff/post_ff Gemma's */
    const float *q_norm, *k_norm;  /* per-head q / k norms, or NULL */
    vs_linear qkv, o, gate_up, down;
} vs_layer;

static void *checked_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) abort();
    return p;
}

static void linear(const vs_linear *l, const uint16_t *x, uint16_t *y, int M, int threads) {
    if (l->kind == KIND_BF16) {
        verispec_bf16_gemm(x, (const uint16_t *)l->w, l->bias_f32, y, M, l->N, l->K, threads);
        return;
    }
    if (l->kind == KIND_INT8)
        verispec_int8_gemm(x, (const int8_t *)l->w, l->scale, y, M, l->N, l->K, threads);
    else
        verispec_int4_gemm(x, (const uint8_t *)l->w, l->scale, l->zero, y, M, l->N, l->K, threads);
    if (l->bias_bf16)
        for (long e = 0; e < (long)M * l->N; e++) y[e] = to_bf16(from_bf16(y[e]) + from_bf16(l->bias_bf16[e % l->N]));
}

/* e^x for the activation, within a few float ulps: Cody-Waite reduction by ln 2 and Cephes' degree-6
 * polynomial, in plain C the compiler vectorizes (libm's expf is a call per value). Past -87 it
 * stays at e^-87, so act(x) there is x / 6e37, not x e^x: negligible either way (tested). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* m[e, i] = bf16(bf16(act(g)) * u) for gu [E, 2 * I] = [g | u] (the fused gate/up product). */
void verispec_act_mul_bf16(const uint16_t *gu, uint16_t *m, long E, int I, int act) {
    for (long e = 0; e < E; e++) {
        const uint16_t *g = gu + e * 2 * I, *u = g + I;
        uint16_t *out = m + e * I;
        #pragma omp simd
        for (int i = 0; i < I; i++) {
            float x = from_bf16(g[i]);
            float z = act == ACT_GELU_TANH ? 1.5957691216057308f * fmaf(0.044715f * x, x * x, x) : x;
            float a = from_bf16(to_bf16(x / (1.0f + exp_approx(-z))));
            out[i] = to_bf16(a * from_bf16(u[i]));
        }
    }
}

/* x [E, H] -> q [B, heads, T, hd] (rotated), and each entry's rotated key and its value written at
 * cache row `row[e]` of slot `slot[e]` (caches [S, kv_heads, L, hd] with strides cs, ch, cr). */
void verispec_layer_pre(const vs_layer *L, const uint16_t *x, int B, int T,
                        const uint16_t *cos, const uint16_t *sin, long cb, long ct,
                        uint16_t *k_cache, uint16_t *v_cache, long cs, long ch, long cr,
                        const int64_t *slot, const int64_t *row, uint16_t *q, int threads) {
    const long E = (long)B * T;
    const int hd = L->head_dim, h = L->heads, kvh = L->kv_heads, H = L->H;
    const int nq = h * hd, nk = kvh * hd, N = nq + 2 * nk;
    uint16_t *xn = checked_malloc(sizeof(uint16_t) * E * H);
    uint16_t *y = checked_malloc(sizeof(uint16_t) * E * N);
    uint16_t *kr = checked_malloc(sizeof(uint16_t) * E * nk);  /* [B, kvh, T, hd] */
    verispec_rms_norm_bf16(x, L->in_norm, NULL, xn, (int)E, 1, H, H, L->eps, L->gemma, threads);
    linear(&L->qkv, xn, y, (int)E, threads);
    if (L->q_norm) {  /* per head, then RoPE from the dense normed heads */
        uint16_t *qn = checked_malloc(sizeof(uint16_t) * E * nq), *kn = checked_malloc(sizeof(uint16_t) * E * nk);
        verispec_rms_norm_bf16(y, L->q_norm, NULL, qn, (int)E, h, N, hd, L->eps, L->gemma, threads);
        verispec_rms_norm_bf16(y + nq, L->k_norm, NULL, kn, (int)E, kvh, N, hd, L->eps, L->gemma, threads);
        verispec_rope_bf16(qn, (long)T * nq, nq, hd, cos, sin, cb, ct, q, B, T, h, hd);
        verispec_rope_bf16(kn, (long)T * nk, nk, hd, cos, sin, cb, ct, kr, B, T, kvh, hd);
        free(qn);
        free(kn);
    } else {  /* RoPE straight from the projection's head split */
        verispec_rope_bf16(y, (long)T * N, N, hd, cos, sin, cb, ct, q, B, T, h, hd);
        verispec_rope_bf16(y + nq, (long)T * N, N, hd, cos, sin, cb, ct, kr, B, T, kvh, hd);
    }
    for (long e = 0; e < E; e++) {
        long b = e / T, t = e % T;
        for (int j = 0; j < kvh; j++) {
            long at = slot[e] * cs + j * ch + row[e] * cr;
            memcpy(k_cache + at, kr + ((b * kvh + j) * T + t) * hd, sizeof(uint16_t) * hd);
            memcpy(v_cache + at, y + e * N + nq + nk + (long)j * hd, sizeof(uint16_t) * hd);
        }
    }
    free(xn);
    free(y);
    free(kr);
}

/* The rest of the layer: o [B, heads, T, hd] (attention's output, through its strides ob, oh, ostride_t;
 * each head's hd values dense), x [E, H] the layer's input -> out [E, H]. */
void verispec_layer_post(const vs_layer *L, const uint16_t *o, long ob, long oh, long ostride_t, const uint16_t *x,
                         uint16_t *out, int B, int T, int threads) {
    const long E = (long)B * T;
    const int hd = L->head_dim, h = L->heads, H = L->H, I = L->inter;
    uint16_t *oflat = checked_malloc(sizeof(uint16_t) * E * h * hd);  /* [E, heads * hd] */
    uint16_t *a = checked_malloc(sizeof(uint16_t) * E * H), *x1 = checked_malloc(sizeof(uint16_t) * E * H);
    uint16_t *n2 = checked_malloc(sizeof(uint16_t) * E * H), *d = checked_malloc(sizeof(uint16_t) * E * H);
    uint16_t *gu = checked_malloc(sizeof(uint16_t) * E * 2 * I), *m = checked_malloc(sizeof(uint16_t) * E * I);
    for (long e = 0; e < E; e++)
        for (int j = 0; j < h; j++)
            memcpy(oflat + (e * h + j) * hd, o + (e / T) * ob + j * oh + (e % T) * ostride_t, sizeof(uint16_t) * hd);
    linear(&L->o, oflat, a, (int)E, threads);
    if (L->gemma) {
        verispec_rms_norm_bf16(a, L->post_attn_norm, x, x1, (int)E, 1, H, H, L->eps, 1, threads);
        verispec_rms_norm_bf16(x1, L->pre_ff_norm, NULL, n2, (int)E, 1, H, H, L->eps, 1, threads);
    } else {
        for (long e = 0; e < E * H; e++) x1[e] = to_bf16(from_bf16(x[e]) + from_bf16(a[e]));
        verispec_rms_norm_bf16(x1, L->post_attn_norm, NULL, n2, (int)E, 1, H, H, L->eps, 0, threads);
    }
    linear(&L->gate_up, n2, gu, (int)E, threads);
    verispec_act_mul_bf16(gu, m, E, I, L->act);
    linear(&L->down, m, d, (int)E, threads);
    if (L->gemma)
        verispec_rms_norm_bf16(d, L->post_ff_norm, x1, out, (int)E, 1, H, H, L->eps, 1, threads);
    else
        for (long e = 0; e < E * H; e++) out[e] = to_bf16(from_bf16(x1[e]) + from_bf16(d[e]));
    free(oflat);
    free(a);
    free(x1);
    free(n2);
    free(d);
    free(gu);
    free(m);
}
