/* The packed weight layouts the linear kernels share (linear.c, linear_bf16.c, linear_int8.c and their tiles). */

#ifndef PAGED_LINEAR_LAYOUT_H
#define PAGED_LINEAR_LAYOUT_H

#include <stdint.h>
#include <string.h>

#define PANEL 16 /* output columns of a panel */
#define BF16_K_ALIGN 32 /* a bfloat16 panel's input features are padded to a multiple of this: one AMX tile's K */

/* The input features of a bfloat16 panel: K rounded up to BF16_K_ALIGN (the padding is zero). */
static inline int64_t bf16_padded(int64_t K) { return (K + BF16_K_ALIGN - 1) / BF16_K_ALIGN * BF16_K_ALIGN; }

/* The bias entries of panel p (zero past N, or all zero without a bias), and the panel's width. */
static inline int64_t panel_bias(const float *bias, int64_t N, int64_t p, float b[PANEL]) {
    const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
    memset(b, 0, PANEL * sizeof(float));
    if (bias != NULL) memcpy(b, bias + n0, cols * sizeof(float));
    return cols;
}

/* The bias entries of panels p0 and p0 + 1 into b (2 PANEL entries, zero past N) and their widths;
 * returns whether N has the second panel. */
static inline int pair_bias(const float *bias, int64_t N, int64_t p0, float b[2 * PANEL], int64_t *cols0,
                            int64_t *cols1) {
    const int two = (p0 + 1) * PANEL < N;
    *cols0 = panel_bias(bias, N, p0, b);
    *cols1 = two ? panel_bias(bias, N, p0 + 1, b + PANEL) : 0;
    if (!two) memset(b + PANEL, 0, PANEL * sizeof(float));
    return two;
}

#endif
