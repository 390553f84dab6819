/* The bfloat16 hardware pieces of the linear kernels (linear_bf16.c, and quantized weights in
 * linear.c): x rounded to bfloat16 and VDPBF16PS tiles (AVX512-BF16), and AMX-BF16 tiles.
 *
 * Every tile register is 16 rows x 64 bytes: an A tile 16 rows x 32 bfloat16 of x, a B tile
 * 16 pairs of input features x 16 columns (linear_layout.h's bfloat16 panel layout, as it lies in
 * memory), a C tile 16 x 16 float32. A block is 32 rows x 2 panels: 4 accumulators and 2 + 2
 * operand tiles fill the 8 registers. Linux hands a process the tile state only on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM), which amx_permitted makes once.
 */

#ifndef PAGED_BF16_KERNELS_H
#define PAGED_BF16_KERNELS_H

#include "linear_layout.h"
#include "vec.h"

#define AMX_ROWS 32 /* rows of x an AMX block: two A tiles; x's bfloat16 copy is padded to a multiple */

#ifdef __AVX512BF16__
#include <immintrin.h>

int dot_outruns_fma(void); /* linear_path.c: whether VDPBF16PS out-runs FMAs on the widened values here */

/* Words 0 .. 15 of a and b interleaved (a in the low halves): pairs of elements 0 .. 15; `from` 16 for 16 .. 31. */
static inline __m512i interleave_words(__m512i a, __m512i b, int from) {
    static const uint16_t order[2][32] = {
        {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
        {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
         24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63},
    };
    return _mm512_permutex2var_epi16(a, _mm512_loadu_si512(order[from / 16]), b);
}

/* Columns 0 .. cols - 1 plus bias of one row of y. */
static inline void bf16_store_row(__m512 acc, const float *bias, float *y, int64_t cols) {
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1), _mm512_add_ps(acc, _mm512_loadu_ps(bias)));
}

/* Rows of x [M, K] as bfloat16 [rows_padded][Kp] (to nearest even), zero past K and past row M. */
static inline void bf16_rows(const float *x, int64_t ld_x, int64_t M, int64_t K, int64_t rows_padded,
                             int64_t Kp, uint16_t *xb) {
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

#define DOT_ROWS 12 /* rows of x a dot-product tile: 12 x 2 accumulators of 16 columns */

/* `rows` rows of xb (bfloat16 [., Kp]) times the panels w0 and, with `two`, w1 (bfloat16 pairs
 * [Kp / 2][PANEL][2]), plus bias (PANEL entries a panel), into columns 0 .. cols0 - 1 and
 * PANEL .. PANEL + cols1 - 1 of y: each broadcast pair of x feeds both panels' VDPBF16PS, each
 * weight vector 12 rows. With `ahead` (or NULL), the tile also fetches part `part` of `parts` of the
 * next pair of panels (each step's line of a panel at ahead and ahead + the gap from w0 to w1),
 * one line of each every `parts` steps: a pair's tiles spread the next pair's stream from memory
 * over their work rather than the first tile asking for all of it at once. Inlined with constant
 * `rows` and `two`. */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t *xb, int64_t Kp, int rows,
                                                           const uint16_t *w0, const uint16_t *w1, int two,
                                                           const float *bias, float *y, int64_t ld_y, int64_t cols0,
                                                           int64_t cols1, const char *ahead, int64_t part,
                                                           int64_t parts) {
    __m512 acc[DOT_ROWS][2];
    for (int i = 0; i < rows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint32_t *pairs = (const uint32_t *)xb;
    const int64_t gap = (const char *)w1 - (const char *)w0, line = 2 * PANEL * 2; /* a step's bytes of a panel */
    const char *fetch = ahead != NULL ? ahead + part * (Kp / 2) / parts * line : NULL;
    const char *fetch_end = ahead != NULL ? ahead + (part + 1) * (Kp / 2) / parts * line : NULL;
    for (int64_t k2 = 0, wait = 0; k2 < Kp / 2; ++k2) {
        if (fetch < fetch_end && wait-- == 0) {
            _mm_prefetch(fetch, _MM_HINT_T0);
            _mm_prefetch(fetch + gap, _MM_HINT_T0);
            fetch += line;
            wait = parts - 1;
        }
        const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + k2 * 2 * PANEL);
        const __m512bh b = two ? (__m512bh)_mm512_loadu_si512(w1 + k2 * 2 * PANEL) : a;
        for (int i = 0; i < rows; ++i) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pairs[i * Kp / 2 + k2]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, a);
            if (two) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, b);
        }
    }
    for (int i = 0; i < rows; ++i) {
        bf16_store_row(acc[i][0], bias, y + i * ld_y, cols0);
        if (two) bf16_store_row(acc[i][1], bias + PANEL, y + i * ld_y + PANEL, cols1);
    }
}

/* Rows 0 .. M - 1 of xb times a pair of panels (dot_tile's arguments; its tiles share the fetch ahead), in
 * tiles of as equal sizes as DOT_ROWS allows, each inlined with its constant row count. */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *xb, int64_t Kp, int64_t M,
                                                           const uint16_t *w0, const uint16_t *w1, int two,
                                                           const float *bias, float *y, int64_t ld_y, int64_t cols0,
                                                           int64_t cols1, const char *ahead) {
    const int64_t tiles = (M + DOT_ROWS - 1) / DOT_ROWS;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t rows = M / tiles + (t < M % tiles);
        switch (rows) {
#define ROWS(r) \
    case r: dot_tile(xb + m * Kp, Kp, r, w0, w1, two, bias, y + m * ld_y, ld_y, cols0, cols1, ahead, t, tiles); break;
            ROWS(12) ROWS(11) ROWS(10) ROWS(9) ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
#undef ROWS
        }
        m += rows;
    }
}

#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_X_BYTES (256 * 1024) /* bfloat16 rows of x a pass over the panels: they stay in the per-core L2 */

/* Rows of x (a multiple of AMX_ROWS) a pass over every panel reads from cache, however many a prefill brings. */
static inline int64_t amx_block_rows(int64_t Kp) {
    const int64_t rows = AMX_X_BYTES / (Kp * (int64_t)sizeof(uint16_t)) / AMX_ROWS * AMX_ROWS;
    return rows > AMX_ROWS ? rows : AMX_ROWS;
}

static inline int amx_permitted(void) {
    static int permitted = -1;
    if (__atomic_load_n(&permitted, __ATOMIC_ACQUIRE) < 0)
        __atomic_store_n(&permitted, syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0,
                         __ATOMIC_RELEASE);
    return permitted;
}

struct amx_tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Each thread that runs amx_pair configures its tiles first (and releases them after). */
static inline void amx_configure(void) {
    struct amx_tile_config config = {.palette_id = 1};
    for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* The columns of the panel pair at output column n0 of N: returns the first panel's, and sets cols1 to
 * the second's (0 without one). */
static inline int64_t amx_pair_cols(int64_t N, int64_t n0, int64_t *cols1) {
    const int64_t rest = N - n0 - PANEL;
    *cols1 = rest < 0 ? 0 : rest < PANEL ? rest : PANEL;
    return N - n0 < PANEL ? N - n0 : PANEL;
}

static inline void amx_store(const float *tile, int64_t rows, const float *bias, float *y, int64_t ld_y,
                             int64_t cols) {
    for (int64_t i = 0; i < rows; ++i) bf16_store_row(_mm512_loadu_ps(tile + 16 * i), bias, y + i * ld_y, cols);
}

/* C tile t (an immediate) of `rows` rows and `cols` columns plus bias (PANEL entries) into y: stored
 * straight from the tile when it is whole and the layer has no bias, else through the 1 KiB scratch
 * c, read back at once (a 64-row 576 x 3072 product without bias: 145 -> 138 us straight). */
#define AMX_OUT(t, rows, cols, biased, bias, yp, ld_y, c)                       \
    do {                                                                        \
        if ((rows) == 16 && (cols) == PANEL && !(biased)) {                     \
            _tile_stored(t, yp, (ld_y) * (int64_t)sizeof(float));               \
        } else {                                                                \
            _tile_stored(t, c, 64);                                             \
            amx_store(c, rows, bias, yp, ld_y, cols);                           \
        }                                                                       \
    } while (0)

/* All M rows of xb (bf16_rows's, rows padded to AMX_ROWS) times the panels b0 and b1 (each
 * [Kp / 2][PANEL][2] bfloat16; b1 unread without a second panel) at output columns n0 .. of N, plus
 * their entries of bias (N, or NULL), into y[:, n0 ..]. c: a 1 KiB scratch. */
static inline void amx_pair(const uint16_t *xb, int64_t M, int64_t Kp, const uint16_t *b0, const uint16_t *b1,
                            const float *bias, int64_t N, int64_t n0, float *y, int64_t ld_y, float *c) {
    int64_t cols1;
    const int64_t cols0 = amx_pair_cols(N, n0, &cols1), stride = Kp * sizeof(uint16_t);
    float bias0[PANEL] = {0}, bias1[PANEL] = {0};
    if (bias != NULL) {
        memcpy(bias0, bias + n0, cols0 * sizeof(float));
        memcpy(bias1, bias + n0 + PANEL, cols1 * sizeof(float));
    }
    const int biased = bias != NULL;
    y += n0;
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
            if (cols1 > 0) {
                _tile_loadd(7, b1 + k * PANEL, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        const int64_t rows0 = M - m0 < 16 ? M - m0 : 16, rows1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
        float *y0 = y + m0 * ld_y;
        AMX_OUT(0, rows0, cols0, biased, bias0, y0, ld_y, c);
        if (rows1 > 0) AMX_OUT(2, rows1, cols0, biased, bias0, y0 + 16 * ld_y, ld_y, c);
        if (cols1 > 0) {
            AMX_OUT(1, rows0, cols1, biased, bias1, y0 + PANEL, ld_y, c);
            if (rows1 > 0) AMX_OUT(3, rows1, cols1, biased, bias1, y0 + 16 * ld_y + PANEL, ld_y, c);
        }
    }
}

#endif /* HAVE_AMX */
#endif
