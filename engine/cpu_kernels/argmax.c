/* Greedy sampling's argmax over a step's logits, float32: each row's index of its first largest
 * value, NaN counting as the largest (as torch.argmax has it). One pass finds the row's maximum
 * (and whether it holds a NaN), a second the first index holding it, which stops there and reads
 * what the first pass just brought into cache. Threads split the rows.
 */

#include <math.h>

#include "vec.h"

/* The first index of row x[0 .. n - 1] holding its largest value, or its first NaN. */
static int64_t row_argmax(const float *x, int64_t n) {
    float best = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 vbest = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vbest = _mm512_max_ps(vbest, v);
    }
    best = _mm512_reduce_max_ps(vbest);
    nan = unordered != 0;
#endif
    for (; i < n; ++i) {
        nan |= isnan(x[i]);
        best = x[i] > best ? x[i] : best;
    }
    i = 0;
#ifdef __AVX512F__
    const __m512 vb = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, vb, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (nan ? isnan(x[i]) : x[i] == best) return i;
    return 0; /* not reached: the row holds its maximum */
}

/* out[r] = the argmax of row r of x [rows, n] (leading dimension ld), n >= 1. */
void argmax_rows_f32(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * ld, n);
}
