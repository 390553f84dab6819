/* Linear layers of a few rows for the CPU: y = x W^T (+ bias), float32 activations, and a
 * float32 or bfloat16 weight.
 *
 * With one to a few rows a matmul is bound by reading the weight from memory: each weight
 * element is used once per row. BLAS libraries pack the weight into their tile layout on
 * every call and reach about half of the memory bandwidth at these sizes; streaming the
 * weight's rows as they lie, four at a time across the threads, reaches nearly all of it.
 * A bfloat16 weight halves those bytes; its elements widen to float32 exactly (a shift), so
 * the products are those of the float32 kernel on the widened weight.
 */

#include "vec.h"

#define W_ROWS 4 /* weight rows a step: four dot products per row of x, summed with hsum4 */
#define X_ROWS 3 /* rows of x a step: each weight vector is loaded (and widened) once for all three */

/* Weight element i, and the eight from i on, as float32, for either weight dtype; `bf16` is a
 * constant in each caller, so the branches fold away. */
static inline float w_at(const void *w, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

static inline vf w_load(const void *w, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)w + i) : load((const float *)w + i);
}

/* Rows n0 .. n0 + W_ROWS - 1 of y = x W^T + b for rows m .. m + xr - 1 of x. x [M, K] row-major
 * (leading dimension ld_x), weight [N, K] row-major, bias [N] or NULL; y [N, M] row-major, i.e.
 * the [M, N] result in the column-major layout of the CPU linear layer's small batches.
 * Inlined with constant `bf16` and `xr`, so that the accumulators live in registers. */
static inline __attribute__((always_inline)) void skinny_tile(const float *x, int64_t ld_x, int64_t M,
                                                              const void *weight, int bf16, int64_t K,
                                                              const float *bias, float *y, int64_t n0, int64_t m,
                                                              int xr) {
    vf acc[X_ROWS][W_ROWS] = {{{0}}};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf w[W_ROWS];
        for (int r = 0; r < W_ROWS; ++r) w[r] = w_load(weight, (n0 + r) * K + k, bf16);
        for (int i = 0; i < xr; ++i) {
            const vf xv = load(x + (m + i) * ld_x + k);
            for (int r = 0; r < W_ROWS; ++r) acc[i][r] += xv * w[r];
        }
    }
    for (int i = 0; i < xr; ++i) {
        const float *restrict xm = x + (m + i) * ld_x;
        float s[W_ROWS];
        hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], s);
        for (int64_t kk = k; kk < K; ++kk)
            for (int r = 0; r < W_ROWS; ++r) s[r] += xm[kk] * w_at(weight, (n0 + r) * K + kk, bf16);
        for (int r = 0; r < W_ROWS; ++r) y[(n0 + r) * M + m + i] = s[r] + (bias != NULL ? bias[n0 + r] : 0.0f);
    }
}

/* Rows n0 .. n0 + W_ROWS - 1 (fewer at the end) of y, for every row of x. */
static inline __attribute__((always_inline)) void skinny_rows(const float *x, int64_t ld_x, int64_t M,
                                                              const void *weight, int bf16, int64_t N, int64_t K,
                                                              const float *bias, float *y, int64_t n0) {
    if (N - n0 < W_ROWS) { /* the last few rows of the weight */
        for (int64_t n = n0; n < N; ++n)
            for (int64_t m = 0; m < M; ++m) {
                float s = bias != NULL ? bias[n] : 0.0f;
                for (int64_t k = 0; k < K; ++k) s += x[m * ld_x + k] * w_at(weight, n * K + k, bf16);
                y[n * M + m] = s;
            }
        return;
    }
    int64_t m = 0; /* after the first rows of x, the four weight rows come from cache */
    for (; m + X_ROWS <= M; m += X_ROWS) skinny_tile(x, ld_x, M, weight, bf16, K, bias, y, n0, m, X_ROWS);
    if (M - m == 2) skinny_tile(x, ld_x, M, weight, bf16, K, bias, y, n0, m, 2);
    if (M - m == 1) skinny_tile(x, ld_x, M, weight, bf16, K, bias, y, n0, m, 1);
}

void skinny_linear_f32(const float *x, int64_t ld_x, int64_t M, const float *weight, int64_t N, int64_t K,
                       const float *bias, float *y) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += W_ROWS) skinny_rows(x, ld_x, M, weight, 0, N, K, bias, y, n0);
}

void skinny_linear_bf16(const float *x, int64_t ld_x, int64_t M, const uint16_t *weight, int64_t N, int64_t K,
                        const float *bias, float *y) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += W_ROWS) skinny_rows(x, ld_x, M, weight, 1, N, K, bias, y, n0);
}
