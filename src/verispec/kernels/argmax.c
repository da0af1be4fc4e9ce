/* The argmax of each row of fp32 or bf16 logits (verispec/kernels), as torch.argmax defines it.
 *
 * Why: greedy decoding takes the argmax of every verified row, and torch's CPU argmax over
 * Gemma's 262,144-entry vocabulary is a scalar loop: 0.34 ms a row on the 2-core Emerald Rapids
 * Xeon, 3% of an int8 decode step at batch 1 and more with every row a batch verifies. Here a row
 * is two vectorized passes: its maximum (and whether it holds a NaN), then the first index
 * holding it.
 *
 * bf16 rows: a greedy step needs only the argmax of the LM head's bf16 output, and widening it
 * to fp32 is exact, so its argmax is the fp32 logits' one. Reading the bf16 row in place skips
 * writing and re-reading an fp32 copy: at 64 rows of Gemma's vocabulary, 64 MB written and read
 * again on every batched step.
 *
 * Semantics (torch's, checked in tests/test_native_kernels.py): the first index of the largest
 * value; a NaN counts as larger than everything, so a row with a NaN gives its first NaN; -inf
 * rows give 0.
 */
#include <stdint.h>

#define BLOCK 64

/* One row's argmax; LOAD(i) gives entry i as a float. Two vectorized passes: the maximum (and
 * whether the row holds a NaN), then the first block that holds it and its place there. */
#define ROW_ARGMAX(name, T, LOAD)                                                          \
    static long name(const T *x, long V) {                                                 \
        float m = LOAD(0);                                                                 \
        int nan = 0;                                                                       \
        _Pragma("omp simd reduction(max : m) reduction(| : nan)")                          \
        for (long i = 0; i < V; i++) {                                                     \
            float v = LOAD(i);                                                             \
            m = v > m ? v : m;                                                             \
            nan |= v != v;                                                                 \
        }                                                                                  \
        for (long i0 = 0; i0 < V; i0 += BLOCK) {                                           \
            long end = i0 + BLOCK < V ? i0 + BLOCK : V;                                    \
            int hit = 0;                                                                   \
            for (long i = i0; i < end; i++) hit |= nan ? LOAD(i) != LOAD(i) : LOAD(i) == m; \
            if (hit)                                                                       \
                for (long i = i0; i < end; i++)                                            \
                    if (nan ? LOAD(i) != LOAD(i) : LOAD(i) == m) return i;                 \
        }                                                                                  \
        return 0;                                                                          \
    }

static inline float widen_bf16(uint16_t b) {  /* exact: a bf16 is the top half of an fp32 */
    union { uint32_t u; float f; } c = {(uint32_t)b << 16};
    return c.f;
}

#define LOAD_F32(i) x[i]
#define LOAD_BF16(i) widen_bf16(x[i])
ROW_ARGMAX(row_argmax_f32, float, LOAD_F32)
ROW_ARGMAX(row_argmax_bf16, uint16_t, LOAD_BF16)

/* x [R, V] fp32, rows `stride` floats apart -> out [R]. */
void verispec_argmax_f32(const float *x, long R, long V, long stride, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (long r = 0; r < R; r++) out[r] = row_argmax_f32(x + r * stride, V);
}

/* x [R, V] bf16, rows `stride` entries apart -> out [R]. */
void verispec_argmax_bf16(const uint16_t *x, long R, long V, long stride, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (long r = 0; r < R; r++) out[r] = row_argmax_bf16(x + r * stride, V);
}
