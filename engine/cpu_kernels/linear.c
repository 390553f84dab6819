/* Linear layers of a few rows for the CPU, float32: y = x W^T (+ bias).
 *
 * With one to a few rows a matmul is bound by reading the weight from memory: each weight
 * element is used once per row. BLAS libraries pack the weight into their tile layout on
 * every call and reach about half of the memory bandwidth at these sizes; streaming the
 * weight's rows as they lie, four at a time across the threads, reaches nearly all of it.
 */

#include "vec.h"

#define W_ROWS 4 /* weight rows a step: four dot products per row of x, summed with hsum4 */

/* x [M, K] row-major (leading dimension ld_x), weight [N, K] row-major, bias [N] or NULL;
 * y [N, M] row-major, i.e. the [M, N] result in the column-major layout of the CPU linear
 * layer's small batches. */
void skinny_linear_f32(const float *x, int64_t ld_x, int64_t M, const float *weight, int64_t N, int64_t K,
                       const float *bias, float *y) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += W_ROWS) {
        const int64_t rows = N - n0 < W_ROWS ? N - n0 : W_ROWS;
        if (rows < W_ROWS) { /* the last few rows of the weight */
            for (int64_t n = n0; n < N; ++n)
                for (int64_t m = 0; m < M; ++m) {
                    float s = bias != NULL ? bias[n] : 0.0f;
                    for (int64_t k = 0; k < K; ++k) s += x[m * ld_x + k] * weight[n * K + k];
                    y[n * M + m] = s;
                }
            continue;
        }
        const float *restrict w0 = weight + n0 * K, *restrict w1 = w0 + K;
        const float *restrict w2 = w1 + K, *restrict w3 = w2 + K;
        for (int64_t m = 0; m < M; ++m) { /* after the first row of x, the four weight rows come from cache */
            const float *restrict xm = x + m * ld_x;
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int64_t k = 0;
            for (; k + VL <= K; k += VL) {
                const vf xv = load(xm + k);
                a0 += xv * load(w0 + k);
                a1 += xv * load(w1 + k);
                a2 += xv * load(w2 + k);
                a3 += xv * load(w3 + k);
            }
            float s[W_ROWS];
            hsum4(a0, a1, a2, a3, s);
            for (; k < K; ++k) {
                s[0] += xm[k] * w0[k];
                s[1] += xm[k] * w1[k];
                s[2] += xm[k] * w2[k];
                s[3] += xm[k] * w3[k];
            }
            for (int r = 0; r < W_ROWS; ++r) y[(n0 + r) * M + m] = s[r] + (bias != NULL ? bias[n0 + r] : 0.0f);
        }
    }
}
