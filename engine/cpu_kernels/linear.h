/* What linear.c lends the other linear kernels: the float32 kernel over a bfloat16 weight widened. */

#ifndef PAGED_LINEAR_H
#define PAGED_LINEAR_H

#include <stdint.h>

/* The bfloat16 weight widened to float32 (any CPU): linear_bf16 (linear_bf16.c) runs it where the CPU has no
 * bfloat16 arithmetic, or where it is the path chosen. */
void linear_bf16_widened(const float *x, int64_t ld_x, int64_t M, const uint16_t *packed, int64_t N, int64_t K,
                         const float *bias, float *y, int64_t ld_y);

#endif
