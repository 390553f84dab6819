/* Which path a bfloat16 linear takes (linear_path.c): linear_bf16 over a bfloat16 weight, and the bfloat16
 * products of a quantized weight (linear.c), ask the one choice. */

#ifndef PAGED_LINEAR_PATH_H
#define PAGED_LINEAR_PATH_H

#include <stdint.h>

enum { PATH_WIDENED = 0, PATH_DOT = 1, PATH_AMX = 2 };

/* The path for M rows on this build and CPU, under the cap linear_bf16_limit set. */
int linear_bf16_path(int64_t M);

#endif
