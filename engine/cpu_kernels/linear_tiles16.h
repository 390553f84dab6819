/* The float32 tiles of linear.c with AVX-512's 16-lane registers: a panel's row of 16 columns is one
 * register, and a tile is TILE16_ROWS rows of x times two panels, 24 accumulators of AVX-512's 32
 * registers. Each step of k loads the two panels' weight vectors (a bfloat16 pair row widens to two:
 * features k and k + 1) and multiplies each by one broadcast element of every row: two FMAs a
 * broadcast and a weight vector reused by 12 rows, where linear.c's 8-lane tiles of 6 rows issue
 * half-width FMAs. The products are the same float32 products, summed in the same order of k.
 */

#ifndef PAGED_LINEAR_TILES16_H
#define PAGED_LINEAR_TILES16_H

#ifdef __AVX512F__
#include <immintrin.h>

#include "linear_layout.h"

#define TILE16_ROWS 12 /* rows of x a tile: 12 x 2 accumulators, 4 widened weight vectors and 2 broadcasts */

/* `rows` rows of x [., K] (leading dimension ld_x) times the panels w0 and, with `two`, w1 (float32
 * [K][PANEL] or bfloat16 pairs [K / 2][PANEL][2]), plus bias (PANEL entries a panel), into columns
 * 0 .. cols0 - 1 and PANEL .. PANEL + cols1 - 1 of y (leading dimension ld_y). With `ahead` (or
 * NULL), each step of k also fetches into cache the same line of the panels at ahead and ahead + the
 * gap from w0 to w1: the next pair, read by the next tile. Inlined with constant `rows`, `two` and
 * `bf16`. */
static inline __attribute__((always_inline)) void tile16(const float *x, int64_t ld_x, int rows, const void *w0,
                                                         const void *w1, int two, int bf16, int64_t K,
                                                         const float *bias, float *y, int64_t ld_y, int64_t cols0,
                                                         int64_t cols1, const char *ahead) {
    __m512 acc[TILE16_ROWS][2];
    for (int i = 0; i < rows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int64_t gap = (const char *)w1 - (const char *)w0; /* from one panel to the other, and so ahead */
    if (bf16) {
        const uint16_t *a = w0, *b = w1;
        const __m512i high = _mm512_set1_epi32((int)0xffff0000);
        int64_t k = 0;
        for (; k + 2 <= K; k += 2) {
            if (ahead != NULL) { /* the next panels' line of this step, one for each panel */
                _mm_prefetch(ahead + k * PANEL * 2, _MM_HINT_T0);
                _mm_prefetch(ahead + k * PANEL * 2 + gap, _MM_HINT_T0);
            }
            const __m512i u0 = _mm512_loadu_si512(a + k * PANEL);
            const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(u0, 16));
            const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(u0, high));
            __m512 e1 = e0, o1 = o0;
            if (two) {
                const __m512i u1 = _mm512_loadu_si512(b + k * PANEL);
                e1 = _mm512_castsi512_ps(_mm512_slli_epi32(u1, 16));
                o1 = _mm512_castsi512_ps(_mm512_and_si512(u1, high));
            }
            for (int i = 0; i < rows; ++i) {
                const __m512 x0 = _mm512_set1_ps(x[i * ld_x + k]), x1 = _mm512_set1_ps(x[i * ld_x + k + 1]);
                acc[i][0] = _mm512_fmadd_ps(x1, o0, _mm512_fmadd_ps(x0, e0, acc[i][0]));
                if (two) acc[i][1] = _mm512_fmadd_ps(x1, o1, _mm512_fmadd_ps(x0, e1, acc[i][1]));
            }
        }
        if (k < K) { /* an odd K: the last feature's pairs hold a zero beside it */
            const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(a + k * PANEL), 16));
            const __m512 e1 = two ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(b + k * PANEL), 16)) : e0;
            for (int i = 0; i < rows; ++i) {
                const __m512 x0 = _mm512_set1_ps(x[i * ld_x + k]);
                acc[i][0] = _mm512_fmadd_ps(x0, e0, acc[i][0]);
                if (two) acc[i][1] = _mm512_fmadd_ps(x0, e1, acc[i][1]);
            }
        }
    } else {
        const float *a = w0, *b = w1;
        for (int64_t k = 0; k < K; ++k) {
            if (ahead != NULL) {
                _mm_prefetch(ahead + k * PANEL * 4, _MM_HINT_T0);
                _mm_prefetch(ahead + k * PANEL * 4 + gap, _MM_HINT_T0);
            }
            const __m512 v0 = _mm512_loadu_ps(a + k * PANEL), v1 = two ? _mm512_loadu_ps(b + k * PANEL) : v0;
            for (int i = 0; i < rows; ++i) {
                const __m512 xv = _mm512_set1_ps(x[i * ld_x + k]);
                acc[i][0] = _mm512_fmadd_ps(xv, v0, acc[i][0]);
                if (two) acc[i][1] = _mm512_fmadd_ps(xv, v1, acc[i][1]);
            }
        }
    }
    const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + PANEL);
    const __mmask16 m0 = (__mmask16)((1u << cols0) - 1), m1 = (__mmask16)((1u << cols1) - 1);
    for (int i = 0; i < rows; ++i) {
        _mm512_mask_storeu_ps(y + i * ld_y, m0, _mm512_add_ps(acc[i][0], b0));
        if (two) _mm512_mask_storeu_ps(y + i * ld_y + PANEL, m1, _mm512_add_ps(acc[i][1], b1));
    }
}

/* Rows 0 .. M - 1 of x times one or two panels (tile16's arguments; the first tile fetches ahead), in
 * tiles of as equal sizes as TILE16_ROWS allows (64 rows: 4 tiles of 11 and 2 of 10, where 5 of 12
 * would leave one of 4 that loads the weights for few rows), each inlined with its constant row
 * count, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_times_panels16(const float *x, int64_t ld_x, int64_t M,
                                                                      const void *w0, const void *w1, int two,
                                                                      int bf16, int64_t K, const float *bias, float *y,
                                                                      int64_t ld_y, int64_t cols0, int64_t cols1,
                                                                      const char *ahead) {
    const int64_t tiles = (M + TILE16_ROWS - 1) / TILE16_ROWS;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t rows = M / tiles + (t < M % tiles);
        switch (rows) {
#define ROWS(r) \
    case r: tile16(x + m * ld_x, ld_x, r, w0, w1, two, bf16, K, bias, y + m * ld_y, ld_y, cols0, cols1, t ? NULL : ahead); break;
            ROWS(12) ROWS(11) ROWS(10) ROWS(9) ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
#undef ROWS
        }
        m += rows;
    }
}

#endif /* __AVX512F__ */
#endif
