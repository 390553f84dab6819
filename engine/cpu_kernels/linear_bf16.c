/* Linear layers over a bfloat16 weight at the CPU's bfloat16 speed: y = x W^T (+ bias).
 *
 * Three paths read the same packed weight (linear_layout.h: packed[p][k / 2][j][k % 2], K padded to
 * BF16_K_ALIGN), and linear_bf16 takes the one linear_bf16_path chooses (linear_path.c):
 *   - "widened" (any CPU, linear.c): each weight widens to float32; the products are float32's.
 *   - "avx512-bf16" (AVX512-BF16, where it out-runs "widened": dot_outruns_fma): x is rounded to
 *     bfloat16 (to nearest even, as torch rounds) and each VDPBF16PS adds 16 columns' products of
 *     one pair of input features into float32 accumulators; the pair layout is that
 *     instruction's operand as it stands in memory.
 *   - "amx" (AMX-BF16, from 16 rows): 16 x 16 float32 tiles accumulate TDPBF16PS
 *     products of 16 rows x 32 input features of x by 32 pair rows of a panel, whose 1 KiB
 *     block is a B tile as it lies in memory. Tiles of 32 rows x 2 panels: 4 accumulators and
 *     2 + 2 operand tiles fill the 8 tile registers.
 * The two hardware paths compute in float32 the exact products of bfloat16 values: they differ
 * from "widened" by x's rounding to bfloat16 (a relative 2^-9 at most per element), as any
 * bfloat16 matmul does.
 */

#include <stdlib.h>

#include "bf16_kernels.h"
#include "kernels.h"
#include "linear.h"
#include "linear_layout.h"
#include "linear_path.h"

#ifdef __AVX512BF16__

/* The threads split pairs of panels; a pair's tiles fetch the next pair between them. */
static void linear_dot(const uint16_t *xb, int64_t M, const uint16_t *packed, int64_t N, int64_t Kp,
                       const float *bias, float *y, int64_t ld_y) {
    const int64_t pairs = ((N + PANEL - 1) / PANEL + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t pp = 0; pp < pairs; ++pp) {
        const int64_t p0 = 2 * pp, n0 = p0 * PANEL;
        const uint16_t *w0 = packed + n0 * Kp, *w1 = w0 + PANEL * Kp;
        float b[2 * PANEL];
        int64_t cols0, cols1;
        const int two = pair_bias(bias, N, p0, b, &cols0, &cols1);
        const char *ahead = n0 + 2 * PANEL < N ? (const char *)(w0 + 2 * PANEL * Kp) : NULL;
        if (two) /* each call inlined with its constant */
            dot_rows(xb, Kp, M, w0, w1, 1, b, y + n0, ld_y, cols0, cols1, ahead);
        else
            dot_rows(xb, Kp, M, w0, w1, 0, b, y + n0, ld_y, cols0, cols1, ahead);
    }
}

#endif /* __AVX512BF16__ */

#ifdef HAVE_AMX

/* xb: bfloat16 [M rounded up to AMX_ROWS][Kp]. Blocks of rows that stay in cache (amx_block_rows)
 * pass over every panel in turn; the threads split pairs of panels, each read once a block. */
static void linear_amx(const uint16_t *xb, int64_t M, const uint16_t *packed, int64_t N, int64_t Kp,
                       const float *bias, float *y, int64_t ld_y) {
    const int64_t panels = (N + PANEL - 1) / PANEL, mc = amx_block_rows(Kp);
#pragma omp parallel
    {
        amx_configure();
        float c[16 * 16] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t rows = M - m0 < mc ? M - m0 : mc;
#pragma omp for schedule(static)
            for (int64_t pp = 0; pp < (panels + 1) / 2; ++pp) {
                const int64_t n0 = 2 * pp * PANEL;
                const uint16_t *b0 = packed + n0 * Kp;
                amx_pair(xb + m0 * Kp, rows, Kp, b0, b0 + PANEL * Kp, bias, N, n0, y + m0 * ld_y, ld_y, c);
            }
        }
        _tile_release();
    }
}

#endif /* HAVE_AMX */

/* x [M, K] float32 row-major (leading dimension ld_x); packed as linear_layout.h lays out a bfloat16
 * weight; bias [N] or NULL; y [M, N] (leading dimension ld_y). Returns 0, or -1 when the
 * bfloat16 copy of x could not be allocated. */
int linear_bf16(const float *x, int64_t ld_x, int64_t M, const uint16_t *packed, int64_t N, int64_t K,
                const float *bias, float *y, int64_t ld_y) {
    const int path = linear_bf16_path(M);
    if (path == PATH_WIDENED || M == 0) {
        linear_bf16_widened(x, ld_x, M, packed, N, K, bias, y, ld_y);
        return 0;
    }
#ifdef __AVX512BF16__
    const int64_t Kp = bf16_padded(K), rows = path == PATH_AMX ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : M;
    uint16_t *xb = aligned_alloc(64, (size_t)(rows * Kp * sizeof(uint16_t) + 63) / 64 * 64);
    if (xb == NULL) return -1;
    bf16_rows(x, ld_x, M, K, rows, Kp, xb);
#ifdef HAVE_AMX
    if (path == PATH_AMX)
        linear_amx(xb, M, packed, N, Kp, bias, y, ld_y);
    else
#endif
        linear_dot(xb, M, packed, N, Kp, bias, y, ld_y);
    free(xb);
#endif
    return 0;
}
