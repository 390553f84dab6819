/* Linear layers for the CPU: y = x W^T (+ bias), float32 activations, a float32 or bfloat16 weight.
 *
 * The weight is packed once, at load time, into panels of PANEL output columns:
 * packed[p][k][j] = W[p * PANEL + j][k], zero past the last column. A tile of TILE_ROWS rows
 * of x times one panel keeps its 6 x 2 vector accumulators in registers: each step of k loads
 * the panel's two weight vectors and broadcasts one element of each row. A panel is read
 * front to back, so the weight streams from memory at full bandwidth for a few rows and from
 * cache for the tiles after the first. A bfloat16 weight halves those bytes; its elements widen
 * to float32 exactly (a shift), so the products are those of the float32 kernel on the widened
 * weight. The threads split the panels.
 */

#include "vec.h"

#define PANEL 16 /* output columns of a panel: two vectors */
#define TILE_ROWS 6 /* rows of x a tile: 12 accumulators, two weight vectors and a broadcast fill AVX2's 16 registers */

/* Eight packed weight elements from index i, as float32, for either weight dtype; `bf16` is a
 * constant in each caller, so the branch folds away. */
static inline vf w_load(const void *w, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)w + i) : load((const float *)w + i);
}

/* Rows 0 .. rows - 1 of x [., K] (leading dimension ld_x) times one panel, plus bias (the
 * panel's PANEL entries), into columns 0 .. cols - 1 of y (leading dimension ld_y). Inlined
 * with constant `bf16` and `rows`. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ld_x, int rows, const void *panel,
                                                       int bf16, int64_t K, const float *bias, float *y,
                                                       int64_t ld_y, int64_t cols) {
    vf acc[TILE_ROWS][2] = {{{0}}};
    for (int64_t k = 0; k < K; ++k) {
        const vf w0 = w_load(panel, k * PANEL, bf16), w1 = w_load(panel, k * PANEL + VL, bf16);
        for (int i = 0; i < rows; ++i) {
            const vf xv = splat(x[i * ld_x + k]);
            acc[i][0] += xv * w0;
            acc[i][1] += xv * w1;
        }
    }
    const vf b0 = load(bias), b1 = load(bias + VL);
    for (int i = 0; i < rows; ++i) {
        if (cols == PANEL) {
            store(y + i * ld_y, acc[i][0] + b0);
            store(y + i * ld_y + VL, acc[i][1] + b1);
        } else { /* the last panel's columns past N are padding */
            float out[PANEL];
            store(out, acc[i][0] + b0);
            store(out + VL, acc[i][1] + b1);
            memcpy(y + i * ld_y, out, cols * sizeof(float));
        }
    }
}

/* Panel p of y = x W^T + b for every row of x [M, K]; y [M, N] row-major (leading dimension ld_y). */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t ld_x, int64_t M,
                                                             const void *packed, int bf16, int64_t N, int64_t K,
                                                             const float *bias, float *y, int64_t ld_y, int64_t p) {
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    const void *panel = bf16 ? (const void *)((const uint16_t *)packed + n0 * K) : (const void *)((const float *)packed + n0 * K);
    float b[PANEL] = {0};
    if (bias != NULL) memcpy(b, bias + n0, cols * sizeof(float));
    int64_t m = 0;
    for (; m + TILE_ROWS <= M; m += TILE_ROWS)
        tile(x + m * ld_x, ld_x, TILE_ROWS, panel, bf16, K, b, y + m * ld_y + n0, ld_y, cols);
    switch (M - m) { /* constant row counts, so that the accumulators stay in registers */
    case 5: tile(x + m * ld_x, ld_x, 5, panel, bf16, K, b, y + m * ld_y + n0, ld_y, cols); break;
    case 4: tile(x + m * ld_x, ld_x, 4, panel, bf16, K, b, y + m * ld_y + n0, ld_y, cols); break;
    case 3: tile(x + m * ld_x, ld_x, 3, panel, bf16, K, b, y + m * ld_y + n0, ld_y, cols); break;
    case 2: tile(x + m * ld_x, ld_x, 2, panel, bf16, K, b, y + m * ld_y + n0, ld_y, cols); break;
    case 1: tile(x + m * ld_x, ld_x, 1, panel, bf16, K, b, y + m * ld_y + n0, ld_y, cols); break;
    }
}

/* Rows of x a pass over the panels: a block that stays in the per-core L2 (about X_BLOCK_BYTES)
 * while every panel reads it, however many rows a prefill brings. */
#define X_BLOCK_BYTES (256 * 1024)

static inline int64_t block_rows(int64_t K) {
    const int64_t rows = X_BLOCK_BYTES / (K * (int64_t)sizeof(float)) / TILE_ROWS * TILE_ROWS;
    return rows > TILE_ROWS ? rows : TILE_ROWS;
}

/* x [M, K] row-major (leading dimension ld_x); packed [ceil(N / PANEL)][K][PANEL]; bias [N] or
 * NULL; y [M, N] row-major (leading dimension ld_y). */
static void linear(const float *x, int64_t ld_x, int64_t M, const void *packed, int bf16, int64_t N, int64_t K,
                   const float *bias, float *y, int64_t ld_y) {
    const int64_t mc = block_rows(K);
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t rows = M - m0 < mc ? M - m0 : mc;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (N + PANEL - 1) / PANEL; ++p) {
            if (bf16) /* each call inlined with its constant */
                panel_rows(x + m0 * ld_x, ld_x, rows, packed, 1, N, K, bias, y + m0 * ld_y, ld_y, p);
            else
                panel_rows(x + m0 * ld_x, ld_x, rows, packed, 0, N, K, bias, y + m0 * ld_y, ld_y, p);
        }
    }
}

void linear_f32(const float *x, int64_t ld_x, int64_t M, const float *packed, int64_t N, int64_t K,
                const float *bias, float *y, int64_t ld_y) {
    linear(x, ld_x, M, packed, 0, N, K, bias, y, ld_y);
}

void linear_bf16(const float *x, int64_t ld_x, int64_t M, const uint16_t *packed, int64_t N, int64_t K,
                 const float *bias, float *y, int64_t ld_y) {
    linear(x, ld_x, M, packed, 1, N, K, bias, y, ld_y);
}
