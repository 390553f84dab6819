/* Linear layers with int8 products (quantization="w8a8"): y = x W^T (+ bias) for a weight in
 * symmetric 8-bit blocks (w = d q, q in -127..127, a block being QBLOCK input features of one
 * output column) and activations quantized as they come: each row's blocks of QBLOCK features
 * as symmetric int8, x ~ s xq with s = max |x| / 127 and xq = round(x / s) in -127..127.
 *
 * A block's share of y[r][n] is then d s sum(q xq). The sums are int32 and exact, so the
 * products run in 8 bits: 64 a VPDPBUSD (AVX512-VNNI) against 16 an FMA, each block scaling its
 * sum in float once. VPDPBUSD multiplies unsigned bytes by signed ones, so the codes are stored
 * as q + 128 and each sum starts from -128 sum(xq), which the row's quantization computes once
 * per block: sum(q xq) = sum((q + 128) xq) - 128 sum(xq), in int32. The weight is packed for that
 * instruction:
 *   codes uint8 [P][K / QBLOCK][QBLOCK / 4][PANEL][4]: q + 128 of four consecutive input features
 *         of a column in its 32-bit lane;
 *   scales float [P][K / QBLOCK][PANEL]: d.
 * A tile is up to W8A8_TILE_ROWS rows times a pair of panels: 12 int32 sums and 12 float
 * accumulators in registers. Threads split the pairs of panels.
 *
 * Without AVX512-VNNI (or capped by linear_int8_limit) the same sums and the same float steps,
 * in the same order, run as plain C: both paths give the same bits.
 */

#include <stdlib.h>

#include "vec.h"
#include "kernels.h"
#include "linear_layout.h"

#define QBLOCK 32
#define GROUPS (QBLOCK / 4) /* 4-feature groups of a block: one VPDPBUSD each */
#define W8A8_TILE_ROWS 6

enum { INT8_GENERIC = 0, INT8_VNNI = 1 };
static int int8_limit = INT8_VNNI;

/* Caps the path linear_w8a8_f32 may take at `limit` (0 generic, 1 avx512-vnni). */
void linear_int8_limit(int limit) { int8_limit = limit; }

/* What linear_w8a8_f32 runs on this CPU: INT8_VNNI or INT8_GENERIC. */
int linear_int8_path(void) {
#ifdef __AVX512VNNI__
    if (int8_limit >= INT8_VNNI) return INT8_VNNI;
#endif
    return INT8_GENERIC;
}

#ifdef __AVX512F__
/* One stage of the Walsh-Hadamard transform within 16 lanes: lane i pairs with lane i ^ s; the lower
 * of a pair takes the sum, the upper the difference (lower - upper). */
static inline __m512 hadamard_stage(__m512 x, int s) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 y = _mm512_permutexvar_ps(_mm512_xor_si512(lanes, _mm512_set1_epi32(s)), x);
    const __mmask16 upper = _mm512_test_epi32_mask(lanes, _mm512_set1_epi32(s));
    return _mm512_mask_sub_ps(_mm512_add_ps(x, y), upper, y, x);
}
#endif

/* One row's block of x (QBLOCK floats), rotated by the block's Walsh-Hadamard transform (unnormalized:
 * the packed weight carries its 1 / QBLOCK), as int8 codes q; returns their sum, *scale = s. The
 * rotation spreads an outlier feature over its block, so the other features keep their precision. */
static inline int quantize_block(const float *x, int8_t *q, float *scale) {
#ifdef __AVX512F__ /* 16 lanes, the same sums as the loops below; rounds to nearest even, as lrintf does */
    __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const __m512 sum16 = _mm512_add_ps(x0, x1);
    x1 = _mm512_sub_ps(x0, x1);
    x0 = sum16;
    for (int s = 8; s >= 1; s /= 2) {
        x0 = hadamard_stage(x0, s);
        x1 = hadamard_stage(x1, s);
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv)), v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(v0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(v1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
#else
    float h[QBLOCK];
    memcpy(h, x, sizeof h);
    for (int s = QBLOCK / 2; s >= 1; s /= 2)
        for (int i = 0; i < QBLOCK; ++i)
            if (!(i & s)) {
                const float a = h[i], b = h[i + s];
                h[i] = a + b;
                h[i + s] = a - b;
            }
    float amax = 0.0f;
    for (int i = 0; i < QBLOCK; ++i) amax = fmaxf(amax, fabsf(h[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = amax / 127.0f;
    int sum = 0;
    for (int i = 0; i < QBLOCK; ++i) {
        const long v = lrintf(h[i] * inv);
        q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        sum += q[i];
    }
    return sum;
#endif
}

/* x [M, K] (leading dimension ld_x) quantized by blocks: xq [M][K], scale [M][K / QBLOCK] = s and
 * start [M][K / QBLOCK] = -128 sum(xq), where a block's int32 sum starts. */
static void quantize_rows(const float *x, int64_t ld_x, int64_t M, int64_t K, int8_t *xq, float *scale,
                          int32_t *start) {
    const int64_t nb = K / QBLOCK;
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_MIN)
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            float s;
            const int sum = quantize_block(x + r * ld_x + b * QBLOCK, xq + r * K + b * QBLOCK, &s);
            scale[r * nb + b] = s;
            start[r * nb + b] = -128 * sum;
        }
}

/* The pair of panels p0, p0 + 1 (or p0 alone) that a tile computes. */
typedef struct {
    const uint8_t *codes[2];
    const float *scales[2];
    float bias[2 * PANEL];
    int64_t cols[2]; /* columns of y each panel fills: PANEL, fewer at the end, 0 for a missing second panel */
} pair_t;

static void pair_of(const uint8_t *codes, const float *scales, const float *bias, int64_t N, int64_t K, int64_t p0,
                    pair_t *pair) {
    const int64_t nb = K / QBLOCK;
    const int two = pair_bias(bias, N, p0, pair->bias, &pair->cols[0], &pair->cols[1]);
    for (int h = 0; h < 2; ++h) {
        const int64_t p = h && two ? p0 + 1 : p0; /* a missing second panel repeats the first, unstored */
        pair->codes[h] = codes + p * nb * QBLOCK * PANEL;
        pair->scales[h] = scales + p * nb * PANEL;
    }
}

typedef void tile_fn(const int8_t *xq, const float *scale, const int32_t *start, int rows, int64_t K,
                     const pair_t *pair, float *y, int64_t ld_y);

/* Rows 0 .. rows - 1 of the quantized x (xq [., K], scale and start [., K / QBLOCK]) times a pair of
 * panels, plus bias, into y (leading dimension ld_y). */
static void tile_generic(const int8_t *xq, const float *scale, const int32_t *start, int rows, int64_t K,
                         const pair_t *pair, float *y, int64_t ld_y) {
    const int64_t nb = K / QBLOCK;
    float acc[W8A8_TILE_ROWS][2 * PANEL] = {{0}};
    for (int64_t b = 0; b < nb; ++b)
        for (int i = 0; i < rows; ++i) {
            const int8_t *xb = xq + i * K + b * QBLOCK;
            const float s = scale[i * nb + b];
            for (int h = 0; h < 2; ++h) {
                const uint8_t *c = pair->codes[h] + b * QBLOCK * PANEL;
                const float *d = pair->scales[h] + b * PANEL;
                int32_t sum[PANEL];
                for (int j = 0; j < PANEL; ++j) sum[j] = start[i * nb + b];
                for (int g = 0; g < GROUPS; ++g)
                    for (int j = 0; j < PANEL; ++j)
                        for (int u = 0; u < 4; ++u) sum[j] += c[(g * PANEL + j) * 4 + u] * xb[4 * g + u];
                for (int j = 0; j < PANEL; ++j) acc[i][h * PANEL + j] = fmaf((float)sum[j], d[j] * s, acc[i][h * PANEL + j]);
            }
        }
    for (int i = 0; i < rows; ++i)
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < pair->cols[h]; ++j)
                y[i * ld_y + h * PANEL + j] = acc[i][h * PANEL + j] + pair->bias[h * PANEL + j];
}

#ifdef __AVX512VNNI__
/* tile_generic's sums and steps on AVX512-VNNI; inlined with a constant `rows`. */
static inline __attribute__((always_inline)) void tile_vnni(const int8_t *xq, const float *scale,
                                                            const int32_t *start, int rows, int64_t K,
                                                            const pair_t *pair, float *y, int64_t ld_y) {
    const int64_t nb = K / QBLOCK;
    __m512 acc[W8A8_TILE_ROWS][2];
    for (int i = 0; i < rows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *c0 = pair->codes[0] + b * QBLOCK * PANEL, *c1 = pair->codes[1] + b * QBLOCK * PANEL;
        __m512i sum[W8A8_TILE_ROWS][2];
        for (int i = 0; i < rows; ++i) sum[i][0] = sum[i][1] = _mm512_set1_epi32(start[i * nb + b]);
        for (int g = 0; g < GROUPS; ++g) {
            const __m512i w0 = _mm512_loadu_si512(c0 + g * 4 * PANEL), w1 = _mm512_loadu_si512(c1 + g * 4 * PANEL);
            for (int i = 0; i < rows; ++i) {
                int32_t four;
                memcpy(&four, xq + i * K + b * QBLOCK + 4 * g, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                sum[i][0] = _mm512_dpbusd_epi32(sum[i][0], w0, xb);
                sum[i][1] = _mm512_dpbusd_epi32(sum[i][1], w1, xb);
            }
        }
        const __m512 d0 = _mm512_loadu_ps(pair->scales[0] + b * PANEL), d1 = _mm512_loadu_ps(pair->scales[1] + b * PANEL);
        for (int i = 0; i < rows; ++i) {
            const __m512 s = _mm512_set1_ps(scale[i * nb + b]);
            acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][0]), _mm512_mul_ps(d0, s), acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][1]), _mm512_mul_ps(d1, s), acc[i][1]);
        }
    }
    const __m512 b0 = _mm512_loadu_ps(pair->bias), b1 = _mm512_loadu_ps(pair->bias + PANEL);
    const __mmask16 k0 = (__mmask16)((1u << pair->cols[0]) - 1), k1 = (__mmask16)((1u << pair->cols[1]) - 1);
    for (int i = 0; i < rows; ++i) {
        _mm512_mask_storeu_ps(y + i * ld_y, k0, _mm512_add_ps(acc[i][0], b0));
        _mm512_mask_storeu_ps(y + i * ld_y + PANEL, k1, _mm512_add_ps(acc[i][1], b1));
    }
}

static void tile_vnni_rows(const int8_t *xq, const float *scale, const int32_t *start, int rows, int64_t K,
                           const pair_t *pair, float *y, int64_t ld_y) {
    switch (rows) { /* each inlined with its constant */
    case 1: tile_vnni(xq, scale, start, 1, K, pair, y, ld_y); break;
    case 2: tile_vnni(xq, scale, start, 2, K, pair, y, ld_y); break;
    case 3: tile_vnni(xq, scale, start, 3, K, pair, y, ld_y); break;
    case 4: tile_vnni(xq, scale, start, 4, K, pair, y, ld_y); break;
    case 5: tile_vnni(xq, scale, start, 5, K, pair, y, ld_y); break;
    default: tile_vnni(xq, scale, start, W8A8_TILE_ROWS, K, pair, y, ld_y); break;
    }
}
#endif

/* y = x W^T + b, x quantized to int8 blocks; K a multiple of QBLOCK. Returns 0, or -3 when the
 * quantized x cannot be allocated. */
int linear_w8a8_f32(const float *x, int64_t ld_x, int64_t M, const uint8_t *codes, const float *scales, int64_t N,
                    int64_t K, const float *bias, float *y, int64_t ld_y) {
    if (M == 0) return 0;
    const int64_t nb = K / QBLOCK, pairs = ((N + PANEL - 1) / PANEL + 1) / 2;
    int8_t *xq = malloc(M * K);
    float *scale = malloc(2 * M * nb * sizeof(float)); /* scale [M][nb], then start [M][nb] (int32) */
    if (xq == NULL || scale == NULL) {
        free(xq);
        free(scale);
        return -3;
    }
    int32_t *start = (int32_t *)(scale + M * nb);
    quantize_rows(x, ld_x, M, K, xq, scale, start);
    /* rows in tiles of equal size: 64 rows are 9 tiles of 6 and 2 of 5 */
    const int64_t tiles = (M + W8A8_TILE_ROWS - 1) / W8A8_TILE_ROWS, small = M / tiles, larger = M % tiles;
    tile_fn *tile = tile_generic;
#ifdef __AVX512VNNI__
    if (linear_int8_path() == INT8_VNNI) tile = tile_vnni_rows;
#endif
#pragma omp parallel for schedule(static) if (M * N * K >= (int64_t)PARALLEL_MIN * 64)
    for (int64_t pp = 0; pp < pairs; ++pp) {
        pair_t pair;
        pair_of(codes, scales, bias, N, K, 2 * pp, &pair);
        float *yp = y + 2 * pp * PANEL;
        for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
            const int rows = (int)(small + (t < larger));
            tile(xq + m0 * K, scale + m0 * nb, start + m0 * nb, rows, K, &pair, yp + m0 * ld_y, ld_y);
            m0 += rows;
        }
    }
    free(xq);
    free(scale);
    return 0;
}
