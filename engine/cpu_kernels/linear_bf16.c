/* Linear layers over a bfloat16 weight at the CPU's bfloat16 speed: y = x W^T (+ bias).
 *
 * Three paths read the same packed weight (linear.h: packed[p][k / 2][j][k % 2], K padded to
 * BF16_K_ALIGN), and linear_bf16 takes the fastest one this build and the call allow:
 *   - "widened" (any CPU, linear.c): each weight widens to float32; the products are float32's.
 *   - "avx512-bf16" (AVX512-BF16, where it out-runs "widened": dot_outruns_fma): x is rounded to
 *     bfloat16 (to nearest even, as torch rounds) and each VDPBF16PS adds 16 columns' products of
 *     one pair of input features into float32 accumulators; the pair layout is that
 *     instruction's operand as it stands in memory.
 *   - "amx" (AMX-BF16, from AMX_MIN_ROWS rows): 16 x 16 float32 tiles accumulate TDPBF16PS
 *     products of 16 rows x 32 input features of x by 32 pair rows of a panel, whose 1 KiB
 *     block is a B tile as it lies in memory. Tiles of 32 rows x 2 panels: 4 accumulators and
 *     2 + 2 operand tiles fill the 8 tile registers.
 * The two hardware paths compute in float32 the exact products of bfloat16 values: they differ
 * from "widened" by x's rounding to bfloat16 (a relative 2^-9 at most per element), as any
 * bfloat16 matmul does. linear_bf16_limit caps the path (tests, PAGED_BF16_LINEAR); capped at
 * "avx512-bf16", the dot products run wherever the CPU has them.
 */

#include <stdlib.h>

#include "bf16_kernels.h"
#include "kernels.h"

static int path_limit = PATH_AMX;

/* Caps the paths linear_bf16 may take at `limit` (0 widened, 1 avx512-bf16, 2 amx). */
void linear_bf16_limit(int limit) { path_limit = limit; }

#ifdef __AVX512BF16__
/* Cycles (time-stamp counter) of 2,000 rounds of 12 independent VDPBF16PS (dot) or FMA chains. */
static uint64_t chain_cycles(int dot) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
           a10 = a0, a11 = a0;
    const __m512 w = _mm512_set1_ps(1e-9f);
    const __m512bh h = (__m512bh)_mm512_set1_epi32(0x3a803a80); /* 2^-10 twice: normal values, sums stay small */
    const uint64_t start = __rdtsc();
    for (int i = 0; i < 2000; ++i) {
#define STEP(a) a = dot ? _mm512_dpbf16_ps(a, h, h) : _mm512_fmadd_ps(a, w, w);
        STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5) STEP(a6) STEP(a7) STEP(a8) STEP(a9) STEP(a10) STEP(a11)
#undef STEP
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                         "+v"(a9), "+v"(a10), "+v"(a11));
    }
    return __rdtsc() - start;
}

/* Whether VDPBF16PS multiplies bfloat16 faster than FMAs multiply the widened weights: it does twice an
 * FMA's products, but some CPUs issue it at a quarter of FMA's rate (an Intel Xeon without AMX: 1.26
 * against 5.1 G instructions/s a core), where the widened path is twice as fast. Measured once, the
 * best of three short runs of each; the attention kernel asks too (bf16_kernels.h). */
int dot_outruns_fma(void) {
    static int outruns = -1;
    if (__atomic_load_n(&outruns, __ATOMIC_ACQUIRE) < 0) {
        uint64_t dot = UINT64_MAX, fma = UINT64_MAX;
        for (int round = 0; round < 3; ++round) {
            const uint64_t f = chain_cycles(0), d = chain_cycles(1);
            fma = f < fma ? f : fma;
            dot = d < dot ? d : dot;
        }
        __atomic_store_n(&outruns, dot < 2 * fma * 5 / 6, __ATOMIC_RELEASE); /* products a cycle: 2 / dot > 1.2 / fma */
    }
    return outruns;
}
#endif

/* The path linear_bf16 takes for M rows on this build and CPU: AMX from AMX_MIN_ROWS rows, else the dot
 * products where they out-run the widened path or where the cap names them. */
int linear_bf16_path(int64_t M) {
#ifdef HAVE_AMX
    if (path_limit >= PATH_AMX && M >= AMX_MIN_ROWS && amx_permitted()) return PATH_AMX;
#endif
#ifdef __AVX512BF16__
    if (path_limit == PATH_DOT || (path_limit > PATH_DOT && dot_outruns_fma())) return PATH_DOT;
#endif
    (void)M;
    return PATH_WIDENED;
}

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

/* x [M, K] float32 row-major (leading dimension ld_x); packed as linear.h lays out a bfloat16
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
