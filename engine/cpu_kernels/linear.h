/* The packed weight layouts the linear kernels share (linear.c, linear_bf16.c). */

#ifndef PAGED_LINEAR_H
#define PAGED_LINEAR_H

#include <stdint.h>

#define PANEL 16 /* output columns of a panel */
#define BF16_K_ALIGN 32 /* a bfloat16 panel's input features are padded to a multiple of this: one AMX tile's K */

/* The input features of a bfloat16 panel: K rounded up to BF16_K_ALIGN (the padding is zero). */
static inline int64_t bf16_padded(int64_t K) { return (K + BF16_K_ALIGN - 1) / BF16_K_ALIGN * BF16_K_ALIGN; }

/* What linear_bf16 runs (linear_bf16.c), and from how many rows AMX: below one A tile's rows the
 * dot products are as fast. */
enum { PATH_WIDENED = 0, PATH_DOT = 1, PATH_AMX = 2 };
#define AMX_MIN_ROWS 16

int linear_bf16_path(int64_t M);
void linear_bf16_widened(const float *x, int64_t ld_x, int64_t M, const uint16_t *packed, int64_t N, int64_t K,
                         const float *bias, float *y, int64_t ld_y);

#endif
