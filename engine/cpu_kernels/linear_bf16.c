/* Linear layers over a bfloat16 weight at the CPU's bfloat16 speed: y = x W^T (+ bias).
 *
 * Three paths read the same packed weight (linear.h: packed[p][k / 2][j][k % 2], K padded to
 * BF16_K_ALIGN), and linear_bf16 takes the fastest one this build and the call allow:
 *   - "widened" (any CPU, linear.c): each weight widens to float32; the products are float32's.
 *   - "avx512-bf16" (AVX512-BF16): x is rounded to bfloat16 (to nearest even, as torch rounds)
 *     and each VDPBF16PS adds 16 columns' products of one pair of input features into float32
 *     accumulators; the pair layout is that instruction's operand as it stands in memory.
 *   - "amx" (AMX-BF16, from AMX_MIN_ROWS rows): 16 x 16 float32 tiles accumulate TDPBF16PS
 *     products of 16 rows x 32 input features of x by 32 pair rows of a panel, whose 1 KiB
 *     block is a B tile as it lies in memory. Tiles of 32 rows x 2 panels: 4 accumulators and
 *     2 + 2 operand tiles fill the 8 tile registers.
 * The two hardware paths compute in float32 the exact products of bfloat16 values: they differ
 * from "widened" by x's rounding to bfloat16 (a relative 2^-9 at most per element), as any
 * bfloat16 matmul does. linear_bf16_limit caps the path (tests, PAGED_BF16_LINEAR).
 */

#include <stdlib.h>

#include "vec.h"
#include "linear.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { PATH_WIDENED = 0, PATH_DOT = 1, PATH_AMX = 2 };
#define AMX_MIN_ROWS 16 /* below one A tile's rows the dot products are as fast */

static int path_limit = PATH_AMX;

/* Caps the paths linear_bf16 may take at `limit` (0 widened, 1 avx512-bf16, 2 amx). */
void linear_bf16_limit(int limit) { path_limit = limit; }

#ifdef HAVE_AMX
/* Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (__atomic_load_n(&permitted, __ATOMIC_ACQUIRE) < 0)
        __atomic_store_n(&permitted, syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0,
                         __ATOMIC_RELEASE);
    return permitted;
}
#endif

/* The path linear_bf16 takes for M rows on this build and CPU. */
int linear_bf16_path(int64_t M) {
#ifdef HAVE_AMX
    if (path_limit >= PATH_AMX && M >= AMX_MIN_ROWS && amx_permitted()) return PATH_AMX;
#endif
#ifdef __AVX512BF16__
    if (path_limit >= PATH_DOT) return PATH_DOT;
#endif
    (void)M;
    return PATH_WIDENED;
}

#ifdef __AVX512BF16__

#define DOT_ROWS 12 /* rows of x a dot-product tile: 12 accumulators of 16 columns */

/* Rows of x [M, K] as bfloat16 [rows_padded][Kp], zero past K and past row M. */
static void to_bf16(const float *x, int64_t ld_x, int64_t M, int64_t K, int64_t rows_padded, int64_t Kp,
                    uint16_t *xb) {
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_MIN)
    for (int64_t m = 0; m < rows_padded; ++m) {
        uint16_t *row = xb + m * Kp;
        int64_t k = 0;
        if (m < M) {
            const float *src = x + m * ld_x;
            for (; k + 16 <= K; k += 16)
                _mm256_storeu_si256((__m256i *)(row + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
            for (; k < K; ++k) row[k] = f32_to_bf16(src[k]);
        }
        memset(row + k, 0, (Kp - k) * sizeof(uint16_t));
    }
}

/* One panel's columns 0 .. cols - 1 plus bias for one row of y. */
static inline void store_row(__m512 acc, const float *bias, float *y, int64_t cols) {
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1), _mm512_add_ps(acc, _mm512_loadu_ps(bias)));
}

/* Rows 0 .. rows - 1 of xb (bfloat16 [., Kp]) times one panel; inlined with a constant `rows`. */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t *xb, int64_t Kp, int rows,
                                                           const uint16_t *panel, const float *bias, float *y,
                                                           int64_t ld_y, int64_t cols) {
    __m512 acc[DOT_ROWS];
    for (int i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
    const uint32_t *pairs = (const uint32_t *)xb;
    for (int64_t k2 = 0; k2 < Kp / 2; ++k2) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * PANEL);
        for (int i = 0; i < rows; ++i)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)pairs[i * Kp / 2 + k2]), w);
    }
    for (int i = 0; i < rows; ++i) store_row(acc[i], bias, y + i * ld_y, cols);
}

static void linear_dot(const uint16_t *xb, int64_t M, const uint16_t *packed, int64_t N, int64_t Kp,
                       const float *bias, float *y, int64_t ld_y) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (N + PANEL - 1) / PANEL; ++p) {
        const int64_t n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        float b[PANEL] = {0};
        if (bias != NULL) memcpy(b, bias + n0, cols * sizeof(float));
        const uint16_t *panel = packed + n0 * Kp;
        int64_t m = 0;
        for (; m + DOT_ROWS <= M; m += DOT_ROWS)
            dot_tile(xb + m * Kp, Kp, DOT_ROWS, panel, b, y + m * ld_y + n0, ld_y, cols);
        switch (M - m) { /* the remainder with its constant row count, so the accumulators stay in registers */
#define REST(r) \
    case r: dot_tile(xb + m * Kp, Kp, r, panel, b, y + m * ld_y + n0, ld_y, cols); break;
            REST(11) REST(10) REST(9) REST(8) REST(7) REST(6) REST(5) REST(4) REST(3) REST(2) REST(1)
#undef REST
        }
    }
}

#endif /* __AVX512BF16__ */

#ifdef HAVE_AMX

#define AMX_ROWS 32 /* rows of x a tile block: two A tiles */

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile register 16 rows x 64 bytes: A (16 x 32 bfloat16), B (16 pairs x 16 columns), C (16 x 16 float32). */
static void amx_configure(void) {
    struct tile_config config = {.palette_id = 1};
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* Rows 0 .. rows - 1 of a stored 16 x 16 tile, plus bias, into columns 0 .. cols - 1 of y. */
static void amx_store(const float *tile, int64_t rows, const float *bias, float *y, int64_t ld_y, int64_t cols) {
    for (int64_t i = 0; i < rows; ++i) store_row(_mm512_loadu_ps(tile + 16 * i), bias, y + i * ld_y, cols);
}

/* xb: bfloat16 [M rounded up to AMX_ROWS][Kp]. The threads split pairs of panels; each reads its
 * panels once from memory and every row block of x from its cache. */
static void linear_amx(const uint16_t *xb, int64_t M, const uint16_t *packed, int64_t N, int64_t Kp,
                       const float *bias, float *y, int64_t ld_y) {
    const int64_t panels = (N + PANEL - 1) / PANEL, stride = Kp * sizeof(uint16_t);
#pragma omp parallel
    {
        amx_configure();
        float c[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t pp = 0; pp < (panels + 1) / 2; ++pp) {
            const int64_t p0 = 2 * pp, two = p0 + 1 < panels;
            const uint16_t *b0 = packed + p0 * PANEL * Kp, *b1 = b0 + PANEL * Kp;
            float bias0[PANEL] = {0}, bias1[PANEL] = {0};
            const int64_t cols0 = N - p0 * PANEL < PANEL ? N - p0 * PANEL : PANEL;
            const int64_t cols1 = two ? (N - (p0 + 1) * PANEL < PANEL ? N - (p0 + 1) * PANEL : PANEL) : 0;
            if (bias != NULL) {
                memcpy(bias0, bias + p0 * PANEL, cols0 * sizeof(float));
                memcpy(bias1, bias + (p0 + 1) * PANEL, cols1 * sizeof(float));
            }
            for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                const uint16_t *a = xb + m0 * Kp;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t k = 0; k < Kp; k += BF16_K_ALIGN) {
                    _tile_loadd(4, a + k, stride);
                    _tile_loadd(5, a + 16 * Kp + k, stride);
                    _tile_loadd(6, b0 + k * PANEL, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) {
                        _tile_loadd(7, b1 + k * PANEL, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                const int64_t rows0 = M - m0 < 16 ? M - m0 : 16, rows1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
                float *y0 = y + m0 * ld_y + p0 * PANEL;
                _tile_stored(0, c, 64);
                amx_store(c, rows0, bias0, y0, ld_y, cols0);
                if (rows1 > 0) {
                    _tile_stored(2, c, 64);
                    amx_store(c, rows1, bias0, y0 + 16 * ld_y, ld_y, cols0);
                }
                if (two) {
                    _tile_stored(1, c, 64);
                    amx_store(c, rows0, bias1, y0 + PANEL, ld_y, cols1);
                    if (rows1 > 0) {
                        _tile_stored(3, c, 64);
                        amx_store(c, rows1, bias1, y0 + 16 * ld_y + PANEL, ld_y, cols1);
                    }
                }
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
    const int64_t Kp = bf16_padded(K), rows = path == PATH_AMX ? (M + 31) / 32 * 32 : M;
    uint16_t *xb = aligned_alloc(64, (size_t)(rows * Kp * sizeof(uint16_t) + 63) / 64 * 64);
    if (xb == NULL) return -1;
    to_bf16(x, ld_x, M, K, rows, Kp, xb);
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
