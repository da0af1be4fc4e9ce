/* Rotary position embedding of bf16 query or key heads, written transposed (verispec/kernels).
 *
 * Why: `layers.rotate` is seven small operators (two slices, a negation, a concatenation, two
 * products and a sum) for q and again for k in every layer, and q is then copied to a dense
 * [B, h, T, hd]; at decode each moves a few kilobytes, so dispatch is what they cost. This is one
 * call per tensor.
 *
 * Numerics: torch's, in bf16 (each operator rounds its fp32 result to bf16, nearest even):
 *   out[d] = bf16(bf16(x[d] * cos[d]) + bf16(rot[d] * sin[d])),
 *   rot[d] = -x[d + hd/2] for d < hd/2, x[d - hd/2] otherwise.
 *
 * Shapes: x [B, T, H, hd] through its strides (elements; a head's hd values dense), cos and sin
 * [B, T, hd] through theirs (hd dense), out [B, H, T, hd] dense.
 */
#include <stdint.h>

#include "bf16.h"

void verispec_rope_bf16(const uint16_t *x, long xb, long xt, long xh, const uint16_t *cos, const uint16_t *sin,
                        long cb, long ct, uint16_t *out, int B, int T, int H, int hd) {
    int half = hd / 2;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const uint16_t *xr = x + b * xb + t * xt + h * xh;
                const uint16_t *c = cos + b * cb + t * ct, *s = sin + b * cb + t * ct;
                uint16_t *o = out + (((long)b * H + h) * T + t) * hd;
                for (int d = 0; d < hd; d++) {
                    float rot = d < half ? -from_bf16(xr[d + half]) : from_bf16(xr[d - half]);
                    float a = from_bf16(to_bf16(from_bf16(xr[d]) * from_bf16(c[d])));
                    o[d] = to_bf16(a + from_bf16(to_bf16(rot * from_bf16(s[d]))));
                }
            }
}
