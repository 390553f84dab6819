/* Linear layers for the CPU: y = x W^T (+ bias), float32 activations, a float32 or bfloat16 weight.
 *
 * The weight is packed once, at load time, into panels of PANEL output columns. float32:
 * packed[p][k][j] = W[p * PANEL + j][k]; bfloat16: packed[p][k / 2][j][k % 2], the pairs of
 * consecutive input features side by side (the layout of the BF16 dot-product instructions
 * and of AMX's B tiles, linear_bf16.c), K padded to a multiple of BF16_K_ALIGN; zero past the
 * last column and the last input feature. A tile of TILE_ROWS rows of x times one panel keeps
 * its 6 x 2 vector accumulators in registers: each step of k loads the panel's two weight
 * vectors and broadcasts one element of each row. A panel is read front to back, so the weight
 * streams from memory at full bandwidth for a few rows and from cache for the tiles after the
 * first. A bfloat16 weight halves those bytes; here its elements widen to float32 exactly (a
 * shift, or a mask for the second of a pair), so the products are those of the float32 kernel
 * on the widened weight. The threads split the panels. With AVX-512 the tiles are those of
 * linear_tiles16.h instead: up to 12 rows times two panels in 16-lane registers, twice the
 * products an instruction (a 64-row product of [576, 3072], float32: 1.93 -> 1.16 ms, builds run
 * back to back).
 */

#include <stdlib.h>

#include "vec.h"
#include "kernels.h"
#include "linear.h"
#include "linear_layout.h"
#include "linear_path.h"
#include "bf16_kernels.h"

#define TILE_ROWS 6 /* rows of x a tile: 12 accumulators, two weight vectors and a broadcast fill AVX2's 16 registers */

typedef int32_t vi_unaligned __attribute__((vector_size(VL * sizeof(int32_t)), aligned(4)));

/* Columns j .. j + 7 of a bfloat16 panel's pair row (input features k, k + 1), widened:
 * the low half of each 32-bit pair is feature k, the high half feature k + 1. */
static inline void pair_load(const uint16_t *w, vf *even, vf *odd) {
    const vi u = *(const vi_unaligned *)w;
    *even = (vf)(u << 16);
    *odd = (vf)(u & ((vi){0} - 65536)); /* 0xffff0000 */
}

/* A tile's accumulators plus bias into columns 0 .. cols - 1 of its rows of y. */
static inline __attribute__((always_inline)) void store_tile(const vf (*acc)[2], int rows, const float *bias,
                                                             float *y, int64_t ld_y, int64_t cols) {
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

/* Rows 0 .. rows - 1 of x [., K] (leading dimension ld_x) times one panel, plus bias (the
 * panel's PANEL entries), into columns 0 .. cols - 1 of y (leading dimension ld_y). Inlined
 * with constant `bf16` and `rows`. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ld_x, int rows, const void *panel,
                                                       int bf16, int64_t K, const float *bias, float *y,
                                                       int64_t ld_y, int64_t cols) {
    vf acc[TILE_ROWS][2] = {{{0}}};
    if (bf16) {
        const uint16_t *w = panel;
        int64_t k = 0;
        for (; k + 2 <= K; k += 2, w += 2 * PANEL) {
            vf e0, o0, e1, o1;
            pair_load(w, &e0, &o0);
            pair_load(w + 2 * VL, &e1, &o1);
            for (int i = 0; i < rows; ++i) {
                const vf x0 = splat(x[i * ld_x + k]), x1 = splat(x[i * ld_x + k + 1]);
                acc[i][0] += x0 * e0;
                acc[i][1] += x0 * e1;
                acc[i][0] += x1 * o0;
                acc[i][1] += x1 * o1;
            }
        }
        if (k < K) { /* an odd K: the last feature's pairs hold a zero beside it */
            vf e0, o0, e1, o1;
            pair_load(w, &e0, &o0);
            pair_load(w + 2 * VL, &e1, &o1);
            for (int i = 0; i < rows; ++i) {
                const vf x0 = splat(x[i * ld_x + k]);
                acc[i][0] += x0 * e0;
                acc[i][1] += x0 * e1;
            }
        }
    } else {
        const float *w = panel;
        for (int64_t k = 0; k < K; ++k) {
            const vf w0 = load(w + k * PANEL), w1 = load(w + k * PANEL + VL);
            for (int i = 0; i < rows; ++i) {
                const vf xv = splat(x[i * ld_x + k]);
                acc[i][0] += xv * w0;
                acc[i][1] += xv * w1;
            }
        }
    }
    store_tile((const vf (*)[2])acc, rows, bias, y, ld_y, cols);
}

/* Rows 0 .. M - 1 of x times one panel (weights in the float32 or bfloat16 layout) into columns
 * 0 .. cols - 1 of y: whole tiles, then the remainder with its constant row count, so that the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_times_panel(const float *x, int64_t ld_x, int64_t M,
                                                                   const void *panel, int bf16, int64_t K,
                                                                   const float *b, float *y, int64_t ld_y,
                                                                   int64_t cols) {
    int64_t m = 0;
    for (; m + TILE_ROWS <= M; m += TILE_ROWS)
        tile(x + m * ld_x, ld_x, TILE_ROWS, panel, bf16, K, b, y + m * ld_y, ld_y, cols);
    switch (M - m) {
    case 5: tile(x + m * ld_x, ld_x, 5, panel, bf16, K, b, y + m * ld_y, ld_y, cols); break;
    case 4: tile(x + m * ld_x, ld_x, 4, panel, bf16, K, b, y + m * ld_y, ld_y, cols); break;
    case 3: tile(x + m * ld_x, ld_x, 3, panel, bf16, K, b, y + m * ld_y, ld_y, cols); break;
    case 2: tile(x + m * ld_x, ld_x, 2, panel, bf16, K, b, y + m * ld_y, ld_y, cols); break;
    case 1: tile(x + m * ld_x, ld_x, 1, panel, bf16, K, b, y + m * ld_y, ld_y, cols); break;
    }
}

/* Panel p of y = x W^T + b for every row of x [M, K]; y [M, N] row-major (leading dimension ld_y). */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t ld_x, int64_t M,
                                                             const void *packed, int bf16, int64_t N, int64_t K,
                                                             const float *bias, float *y, int64_t ld_y, int64_t p) {
    const int64_t n0 = p * PANEL;
    const void *panel = bf16 ? (const void *)((const uint16_t *)packed + n0 * bf16_padded(K))
                             : (const void *)((const float *)packed + n0 * K);
    float b[PANEL];
    const int64_t cols = panel_bias(bias, N, p, b);
    rows_times_panel(x, ld_x, M, panel, bf16, K, b, y + n0, ld_y, cols);
}

#ifdef __AVX512F__
#include "linear_tiles16.h"
#define BLOCK_TILE_ROWS TILE16_ROWS
#else
#define BLOCK_TILE_ROWS TILE_ROWS
#endif

/* Rows of x a pass over the panels: a block that stays in the per-core L2 (about X_BLOCK_BYTES)
 * while every panel reads it, however many rows a prefill brings. */
#define X_BLOCK_BYTES (256 * 1024)

static inline int64_t block_rows(int64_t K) {
    const int64_t rows = X_BLOCK_BYTES / (K * (int64_t)sizeof(float)) / BLOCK_TILE_ROWS * BLOCK_TILE_ROWS;
    return rows > BLOCK_TILE_ROWS ? rows : BLOCK_TILE_ROWS;
}

#ifdef __AVX512F__
/* Panels 2 pp and 2 pp + 1 (where N has it) of y = x W^T + b for every row of x, on 16-lane tiles. */
static inline __attribute__((always_inline)) void panel_pair_rows(const float *x, int64_t ld_x, int64_t M,
                                                                  const void *packed, int bf16, int64_t N, int64_t K,
                                                                  const float *bias, float *y, int64_t ld_y,
                                                                  int64_t pp) {
    const int64_t p0 = 2 * pp, n0 = p0 * PANEL, panel_elems = (bf16 ? bf16_padded(K) : K) * PANEL;
    const void *w0 = bf16 ? (const void *)((const uint16_t *)packed + p0 * panel_elems)
                          : (const void *)((const float *)packed + p0 * panel_elems);
    const void *w1 = bf16 ? (const void *)((const uint16_t *)w0 + panel_elems)
                          : (const void *)((const float *)w0 + panel_elems);
    float b[2 * PANEL];
    int64_t cols0, cols1;
    const int two = pair_bias(bias, N, p0, b, &cols0, &cols1);
    const int64_t bytes = 2 * panel_elems * (bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float));
    /* the next pair, fetched by the first tile: a decode step's weights come from memory (64 rows,
     * bfloat16: 1.02x; 16 rows 1.19x; one row 1.13x) */
    const char *ahead = n0 + 2 * PANEL < N ? (const char *)w0 + bytes : NULL;
    if (two) /* each call inlined with its constants */
        rows_times_panels16(x, ld_x, M, w0, w1, 1, bf16, K, b, y + n0, ld_y, cols0, cols1, ahead);
    else
        rows_times_panels16(x, ld_x, M, w0, w1, 0, bf16, K, b, y + n0, ld_y, cols0, cols1, ahead);
}
#endif

/* x [M, K] row-major (leading dimension ld_x); packed [ceil(N / PANEL)][K][PANEL]; bias [N] or
 * NULL; y [M, N] row-major (leading dimension ld_y). With AVX-512 the threads split pairs of panels. */
static void linear(const float *x, int64_t ld_x, int64_t M, const void *packed, int bf16, int64_t N, int64_t K,
                   const float *bias, float *y, int64_t ld_y) {
    const int64_t mc = block_rows(K), panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t rows = M - m0 < mc ? M - m0 : mc;
#ifdef __AVX512F__
#pragma omp for schedule(static)
        for (int64_t pp = 0; pp < (panels + 1) / 2; ++pp) {
            if (bf16) /* each call inlined with its constant */
                panel_pair_rows(x + m0 * ld_x, ld_x, rows, packed, 1, N, K, bias, y + m0 * ld_y, ld_y, pp);
            else
                panel_pair_rows(x + m0 * ld_x, ld_x, rows, packed, 0, N, K, bias, y + m0 * ld_y, ld_y, pp);
        }
#else
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            if (bf16) /* each call inlined with its constant */
                panel_rows(x + m0 * ld_x, ld_x, rows, packed, 1, N, K, bias, y + m0 * ld_y, ld_y, p);
            else
                panel_rows(x + m0 * ld_x, ld_x, rows, packed, 0, N, K, bias, y + m0 * ld_y, ld_y, p);
        }
#endif
    }
}

void linear_f32(const float *x, int64_t ld_x, int64_t M, const float *packed, int64_t N, int64_t K,
                const float *bias, float *y, int64_t ld_y) {
    linear(x, ld_x, M, packed, 0, N, K, bias, y, ld_y);
}

void linear_bf16_widened(const float *x, int64_t ld_x, int64_t M, const uint16_t *packed, int64_t N, int64_t K,
                         const float *bias, float *y, int64_t ld_y) {
    linear(x, ld_x, M, packed, 1, N, K, bias, y, ld_y);
}

/* ------------------------------------------------------------------------------ quantized weights
 *
 * Blocks of QBLOCK consecutive input features share a scale d and an offset m per output
 * column: w = d * q + m, with 8-bit codes q (quantization="int8"'s min/max blocks). The panels
 * interleave the PANEL columns of each input feature, as the float layout does, and keep the
 * scales of a block beside it:
 *   codes uint8 [P][K / QBLOCK][QBLOCK][PANEL];
 *   scales float [P][K / QBLOCK][2][PANEL]: d, then m.
 * A weight takes 8 bits and its scales 2 more, against float32's 32: decoding few rows, the step
 * reads that much less memory. (A GGUF file's blocks run in their own layout: linear_ggml.c.)
 *
 * One tile of rows widens each code as it loads it, computing the products of the float32
 * kernel on the dequantized weight. More rows dequantize the panel (a pair of panels with AVX-512)
 * once into a float32 scratch that the float32 tiles then read, so prefill runs at the float32
 * kernel's speed.
 */

#define QBLOCK 32

typedef uint8_t vb __attribute__((vector_size(VL)));

/* The two code vectors (columns 0..7, 8..15) of input feature kk of a block, as float32. */
static inline __attribute__((always_inline)) void q_codes(const uint8_t *codes, int64_t kk, vf *q0, vf *q1) {
    const uint8_t *c = codes + kk * PANEL;
#ifdef __AVX2__ /* a zero-extending load; GCC's lowering of generic 8-byte vectors goes through general registers */
    *q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c)));
    *q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + VL))));
#else
    vb lo, hi;
    memcpy(&lo, c, sizeof lo);
    memcpy(&hi, c + VL, sizeof hi);
    *q0 = __builtin_convertvector(__builtin_convertvector(lo, vi), vf);
    *q1 = __builtin_convertvector(__builtin_convertvector(hi, vi), vf);
#endif
}

#define Q_BLOCK_BYTES (QBLOCK * PANEL) /* codes of one block of a panel */

/* The two weight vectors (columns 0..7, 8..15) of input feature kk of a block. */
static inline __attribute__((always_inline)) void q_load(const uint8_t *codes, int64_t kk, vf d0, vf d1,
                                                         vf m0, vf m1, vf *w0, vf *w1) {
    vf q0, q1;
    q_codes(codes, kk, &q0, &q1);
    *w0 = q0 * d0 + m0;
    *w1 = q1 * d1 + m1;
}

/* One block's share of a row's factored product: acc += d * sum(x q) + m * sum(x), given the
 * block's sums s0 / s1 (columns 0..7, 8..15) of x q, its QBLOCK inputs xk and its scales s (d, then m). */
static inline __attribute__((always_inline)) void q_block_scaled(vf s0, vf s1, const float *xk, const float *s,
                                                                 vf acc[2]) {
    const vf total = splat(hsum(load(xk) + load(xk + VL) + load(xk + 2 * VL) + load(xk + 3 * VL)));
    acc[0] += s0 * load(s) + total * load(s + PANEL);
    acc[1] += s1 * load(s + VL) + total * load(s + PANEL + VL);
}

#define FACTORED_ROWS 3 /* rows whose block sums and totals (4 vectors a row) stay in registers */

/* `rows` (at most FACTORED_ROWS) rows of x times one quantized panel, the block's scale applied once:
 * sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k. Fewer operations a code than dequantizing
 * each weight, which is what bounds a decode step at one row. */
static inline __attribute__((always_inline)) void q_tile_factored(const float *x, int64_t ld_x, int rows,
                                                                  const uint8_t *codes, const float *scales,
                                                                  int64_t K, const float *bias, float *y,
                                                                  int64_t ld_y, int64_t cols) {
    vf acc[FACTORED_ROWS][2] = {{{0}}};
    for (int64_t kb = 0; kb < K / QBLOCK; ++kb) {
        const uint8_t *c = codes + kb * Q_BLOCK_BYTES;
        const float *xk = x + kb * QBLOCK;
        vf sum[FACTORED_ROWS][2] = {{{0}}};
        for (int64_t kk = 0; kk < QBLOCK; ++kk) {
            vf q0, q1;
            q_codes(c, kk, &q0, &q1);
            for (int i = 0; i < rows; ++i) {
                const vf xv = splat(xk[i * ld_x + kk]);
                sum[i][0] += xv * q0;
                sum[i][1] += xv * q1;
            }
        }
        for (int i = 0; i < rows; ++i)
            q_block_scaled(sum[i][0], sum[i][1], xk + i * ld_x, scales + kb * 2 * PANEL, acc[i]);
    }
    store_tile((const vf (*)[2])acc, rows, bias, y, ld_y, cols);
}

/* `rows` (at most TILE_ROWS) rows of x times one quantized panel, codes widened as they load. */
static inline __attribute__((always_inline)) void q_tile(const float *x, int64_t ld_x, int rows, const uint8_t *codes,
                                                         const float *scales, int64_t K, const float *bias,
                                                         float *y, int64_t ld_y, int64_t cols) {
    vf acc[TILE_ROWS][2] = {{{0}}};
    for (int64_t kb = 0; kb < K / QBLOCK; ++kb) {
        const float *s = scales + kb * 2 * PANEL;
        const uint8_t *c = codes + kb * Q_BLOCK_BYTES;
        const vf d0 = load(s), d1 = load(s + VL), m0 = load(s + PANEL), m1 = load(s + PANEL + VL);
        const float *xk = x + kb * QBLOCK;
        for (int64_t kk = 0; kk < QBLOCK; ++kk) {
            vf w0, w1;
            q_load(c, kk, d0, d1, m0, m1, &w0, &w1);
            for (int i = 0; i < rows; ++i) {
                const vf xv = splat(xk[i * ld_x + kk]);
                acc[i][0] += xv * w0;
                acc[i][1] += xv * w1;
            }
        }
    }
    store_tile((const vf (*)[2])acc, rows, bias, y, ld_y, cols);
}

/* A quantized panel as float32 [K][PANEL], the layout the float32 tiles read. */
static inline __attribute__((always_inline)) void q_dequantize(const uint8_t *codes, const float *scales,
                                                               int64_t K, float *out) {
    for (int64_t kb = 0; kb < K / QBLOCK; ++kb) {
        const float *s = scales + kb * 2 * PANEL;
        const uint8_t *c = codes + kb * Q_BLOCK_BYTES;
        const vf d0 = load(s), d1 = load(s + VL), m0 = load(s + PANEL), m1 = load(s + PANEL + VL);
        for (int64_t kk = 0; kk < QBLOCK; ++kk) {
            vf w0, w1;
            q_load(c, kk, d0, d1, m0, m1, &w0, &w1);
            store(out + (kb * QBLOCK + kk) * PANEL, w0);
            store(out + (kb * QBLOCK + kk) * PANEL + VL, w1);
        }
    }
}

#ifdef __AVX512F__
/* q_tile_factored for one row with 16-lane vectors: a feature's 16 columns fill one vector, twice the codes an
 * operation. The products are those of the 8-lane path, summed in another order. */
static inline __attribute__((always_inline)) void q_row_factored16(const float *x, const uint8_t *codes,
                                                                   const float *scales, int64_t K,
                                                                   const float *bias, float *y, int64_t cols) {
    vf acc[1][2] = {{{0}}};
    for (int64_t kb = 0; kb < K / QBLOCK; ++kb) {
        const uint8_t *c = codes + kb * Q_BLOCK_BYTES;
        const float *xk = x + kb * QBLOCK;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t kk = 0; kk < QBLOCK; ++kk)
            sum = _mm512_fmadd_ps(_mm512_set1_ps(xk[kk]),
                                  _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + kk * PANEL)))),
                                  sum);
        q_block_scaled((vf)_mm512_castps512_ps256(sum), (vf)_mm512_extractf32x8_ps(sum, 1), xk,
                       scales + kb * 2 * PANEL, acc[0]);
    }
    store_tile((const vf (*)[2])acc, 1, bias, y, 0, cols);
}
#endif

/* Panel p for rows of x that fit one tile (M <= TILE_ROWS), the codes widened in the tile. */
static inline __attribute__((always_inline)) void q_panel_tile(const float *x, int64_t ld_x, int64_t M,
                                                               const uint8_t *codes, const float *scales,
                                                               int64_t N, int64_t K, const float *bias, float *y,
                                                               int64_t ld_y, int64_t p) {
    float b[PANEL];
    const int64_t cols = panel_bias(bias, N, p, b);
    const uint8_t *c = codes + p * (K / QBLOCK * Q_BLOCK_BYTES);
    const float *s = scales + p * (K / QBLOCK * 2 * PANEL);
    float *yp = y + p * PANEL;
    switch (M) { /* constant row counts, so that the accumulators stay in registers */
    case 6: q_tile(x, ld_x, 6, c, s, K, b, yp, ld_y, cols); break;
    case 5: q_tile(x, ld_x, 5, c, s, K, b, yp, ld_y, cols); break;
    case 4: q_tile(x, ld_x, 4, c, s, K, b, yp, ld_y, cols); break;
    case 3: q_tile_factored(x, ld_x, 3, c, s, K, b, yp, ld_y, cols); break;
    case 2: q_tile_factored(x, ld_x, 2, c, s, K, b, yp, ld_y, cols); break;
#ifdef __AVX512F__
    case 1: q_row_factored16(x, c, s, K, b, yp, cols); break;
#else
    case 1: q_tile_factored(x, ld_x, 1, c, s, K, b, yp, ld_y, cols); break;
#endif
    }
}

#ifdef __AVX512BF16__
#define Q_AHEAD 4096 /* bytes of codes (and of scales) fetched ahead of the dequantization: the stream runs on into the next panel */

/* A quantized panel as bfloat16 pairs [K / 2][PANEL][2] (linear_layout.h's layout), each weight d q + m (one
 * rounding) rounded to nearest even: a pair of input features' 16 columns at a time, two 16-lane vectors
 * of weights converted together and put in place by one permutation. */
static inline __attribute__((always_inline)) void q_dequantize_bf16(const uint8_t *codes, const float *scales,
                                                                    int64_t K, uint16_t *out) {
    /* the converted pair's element i goes to out[2j] (feature kk) or out[2j + 1] (kk + 1) of column j: vector 0
     * is feature kk's columns, vector 1 kk + 1's. */
    static const uint16_t place8[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i place = _mm512_loadu_si512(place8);
    for (int64_t kb = 0; kb < K / QBLOCK; ++kb) {
        const __m512 d = _mm512_loadu_ps(scales + kb * 2 * PANEL), m = _mm512_loadu_ps(scales + kb * 2 * PANEL + PANEL);
        const uint8_t *c = codes + kb * Q_BLOCK_BYTES;
        for (int64_t i = 0; i < Q_BLOCK_BYTES; i += 64) _mm_prefetch((const char *)(c + Q_AHEAD + i), _MM_HINT_T0);
        _mm_prefetch((const char *)(scales + kb * 2 * PANEL) + Q_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)(scales + kb * 2 * PANEL + PANEL) + Q_AHEAD, _MM_HINT_T0);
        for (int64_t kk = 0; kk < QBLOCK; kk += 2) {
            const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + kk * PANEL)));
            const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + (kk + 1) * PANEL)));
            const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), d, m);
            const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), d, m);
            _mm512_storeu_si512(out + (kb * QBLOCK + kk) * PANEL,
                                _mm512_permutexvar_epi16(place, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
        }
    }
}

/* Panels p0 and p0 + 1 (where N has it) dequantized to bfloat16 pairs into w and w + PANEL * K. */
static inline void q_pair_bf16(const uint8_t *codes, const float *scales, int64_t N, int64_t K, int64_t p0,
                               uint16_t *w) {
    const int64_t panel_codes = K / QBLOCK * Q_BLOCK_BYTES, panel_scales = K / QBLOCK * 2 * PANEL;
    for (int64_t p = p0; p < p0 + 2 && p * PANEL < N; ++p)
        q_dequantize_bf16(codes + p * panel_codes, scales + p * panel_scales, K, w + (p - p0) * PANEL * K);
}

/* linear_q with bfloat16 products (`path` PATH_DOT or PATH_AMX): x rounded to bfloat16 once; each pair of
 * panels dequantized to bfloat16 into a thread's scratch and multiplied by VDPBF16PS tiles (dot_rows),
 * or on AMX tiles (amx_pair) for each block of rows that stays in cache. */
static int linear_q_bf16(const float *x, int64_t ld_x, int64_t M, const uint8_t *codes, const float *scales,
                         int64_t N, int64_t K, const float *bias, float *y, int64_t ld_y, int path) {
    const int64_t pairs = ((N + PANEL - 1) / PANEL + 1) / 2;
    const int64_t rows = path == PATH_AMX ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : M;
    uint16_t *xb = aligned_alloc(64, (size_t)(rows * K * sizeof(uint16_t) + 63) / 64 * 64);
    if (xb == NULL) return -3;
    bf16_rows(x, ld_x, M, K, rows, K, xb);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint16_t *w = aligned_alloc(64, 2 * PANEL * K * sizeof(uint16_t));
        failed = w == NULL;
        if (!failed && path == PATH_DOT) {
#pragma omp for schedule(static)
            for (int64_t pp = 0; pp < pairs; ++pp) {
                float b[2 * PANEL];
                int64_t cols0, cols1;
                const int two = pair_bias(bias, N, 2 * pp, b, &cols0, &cols1);
                q_pair_bf16(codes, scales, N, K, 2 * pp, w);
                float *yp = y + 2 * pp * PANEL;
                if (two) /* each call inlined with its constant */
                    dot_rows(xb, K, M, w, w + PANEL * K, 1, b, yp, ld_y, cols0, cols1, NULL);
                else
                    dot_rows(xb, K, M, w, w, 0, b, yp, ld_y, cols0, 0, NULL);
            }
        }
#ifdef HAVE_AMX
        if (!failed && path == PATH_AMX) {
            amx_configure();
            float c[16 * 16] __attribute__((aligned(64)));
            const int64_t mc = amx_block_rows(K);
            for (int64_t m0 = 0; m0 < M; m0 += mc) {
                const int64_t block = M - m0 < mc ? M - m0 : mc;
#pragma omp for schedule(static)
                for (int64_t pp = 0; pp < pairs; ++pp) {
                    q_pair_bf16(codes, scales, N, K, 2 * pp, w);
                    amx_pair(xb + m0 * K, block, K, w, w + PANEL * K, bias, N, 2 * pp * PANEL, y + m0 * ld_y, ld_y, c);
                }
            }
            _tile_release();
        }
#endif
        free(w);
    }
    free(xb);
    return failed ? -3 : 0;
}
#endif

/* y = x W^T + b over a quantized packed weight; K a multiple of QBLOCK. With bf16_products, past
 * TILE_ROWS rows, x and the weights rounded to bfloat16 are multiplied on the bfloat16 path the CPU
 * takes for M rows (linear_bf16_path: AMX tiles, or VDPBF16PS where it out-runs the FMAs). Returns 0,
 * or -3 when a scratch buffer cannot be allocated. */
static int linear_q(const float *x, int64_t ld_x, int64_t M, const uint8_t *codes, const float *scales,
                    int64_t N, int64_t K, const float *bias, float *y, int64_t ld_y, int bf16_products) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#ifdef __AVX512BF16__
    const int path = bf16_products && M > TILE_ROWS ? linear_bf16_path(M) : PATH_WIDENED;
    if (path != PATH_WIDENED) return linear_q_bf16(x, ld_x, M, codes, scales, N, K, bias, y, ld_y, path);
#else
    (void)bf16_products;
#endif
    if (M <= TILE_ROWS) { /* decoding: read each panel once */
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            q_panel_tile(x, ld_x, M, codes, scales, N, K, bias, y, ld_y, p);
        }
        return 0;
    }
    const int64_t mc = block_rows(K), panel_codes = K / QBLOCK * Q_BLOCK_BYTES, panel_scales = K / QBLOCK * 2 * PANEL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scratch = malloc(2 * K * PANEL * sizeof(float));
        failed = scratch == NULL;
        if (!failed) {
#ifdef __AVX512F__ /* pairs of panels on 16-lane tiles */
#pragma omp for schedule(static)
            for (int64_t pp = 0; pp < (panels + 1) / 2; ++pp) {
                const int64_t p0 = 2 * pp;
                float b[2 * PANEL];
                int64_t cols0, cols1;
                const int two = pair_bias(bias, N, p0, b, &cols0, &cols1);
                for (int64_t p = p0; p < p0 + 1 + two; ++p)
                    q_dequantize(codes + p * panel_codes, scales + p * panel_scales, K, scratch + (p - p0) * K * PANEL);
                for (int64_t m0 = 0; m0 < M; m0 += mc) {
                    const int64_t rows = M - m0 < mc ? M - m0 : mc;
                    float *yp = y + m0 * ld_y + p0 * PANEL;
                    if (two)
                        rows_times_panels16(x + m0 * ld_x, ld_x, rows, scratch, scratch + K * PANEL, 1, 0, K, b, yp,
                                            ld_y, cols0, cols1, NULL);
                    else
                        rows_times_panels16(x + m0 * ld_x, ld_x, rows, scratch, scratch, 0, 0, K, b, yp, ld_y, cols0, 0,
                                            NULL);
                }
            }
#else
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) {
                q_dequantize(codes + p * panel_codes, scales + p * panel_scales, K, scratch);
                float b[PANEL];
                const int64_t cols = panel_bias(bias, N, p, b);
                for (int64_t m0 = 0; m0 < M; m0 += mc)
                    rows_times_panel(x + m0 * ld_x, ld_x, M - m0 < mc ? M - m0 : mc, scratch, 0, K, b,
                                     y + m0 * ld_y + p * PANEL, ld_y, cols);
            }
#endif
        }
        free(scratch);
    }
    return failed ? -3 : 0;
}

int linear_q8_f32(const float *x, int64_t ld_x, int64_t M, const uint8_t *codes, const float *scales, int64_t N,
                  int64_t K, const float *bias, float *y, int64_t ld_y, int bf16_products) {
    return linear_q(x, ld_x, M, codes, scales, N, K, bias, y, ld_y, bf16_products);
}
