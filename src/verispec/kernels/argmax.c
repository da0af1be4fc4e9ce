/* The argmax of each row of fp32 logits (verispec/kernels), as torch.argmax defines it.
 *
 * Why: greedy decoding takes the argmax of every verified row, and torch's CPU argmax over
 * Gemma's 262,144-entry vocabulary is a scalar loop: 0.34 ms a row on the 2-core Emerald Rapids
 * Xeon, 3% of an int8 decode step at batch 1 and more with every row a batch verifies. Here a row
 * is two vectorized passes: its maximum (and whether it holds a NaN), then the first index
 * holding it.
 *
 * Semantics (torch's, checked in tests/test_native_kernels.py): the first index of the largest
 * value; a NaN counts as larger than everything, so a row with a NaN gives its first NaN; -inf
 * rows give 0.
 */
#include <stdint.h>

#define BLOCK 64

static long row_argmax(const float *x, long V) {
    float m = x[0];
    int nan = 0;
    #pragma omp simd reduction(max : m) reduction(| : nan)
    for (long i = 0; i < V; i++) {
        float v = x[i];
        m = v > m ? v : m;
        nan |= v != v;
    }
    for (long i0 = 0; i0 < V; i0 += BLOCK) {  /* the first block that holds it, then its place there */
        long end = i0 + BLOCK < V ? i0 + BLOCK : V;
        int hit = 0;
        for (long i = i0; i < end; i++) hit |= nan ? x[i] != x[i] : x[i] == m;
        if (hit)
            for (long i = i0; i < end; i++)
                if (nan ? x[i] != x[i] : x[i] == m) return i;
    }
    return 0;
}

/* x [R, V] fp32, rows `stride` floats apart -> out [R]. */
void verispec_argmax_f32(const float *x, long R, long V, long stride, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (long r = 0; r < R; r++) out[r] = row_argmax(x + r * stride, V);
}
