/* bf16 <-> fp32 for the plain-C kernels (verispec/kernels). A bf16 is the top half of an fp32, so
 * widening is exact; narrowing rounds to nearest even and turns NaN into 0x7fc0, as torch does. */
#ifndef VERISPEC_BF16_H
#define VERISPEC_BF16_H
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return f != f ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The sum of 16 partial sums, added as _mm512_reduce_add_ps adds 16 lanes (halves, then halves). */
static inline float sum16(float *acc) {
    for (int half = 8; half > 0; half /= 2)
        for (int l = 0; l < half; l++) acc[l] += acc[l + half];
    return acc[0];
}
#endif
