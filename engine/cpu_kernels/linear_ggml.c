/* Linear layers over weights in GGUF's own types: y = x W^T (+ bias), float32 x and y, W's rows as the
 * file stores them (ggml_blocks.h), in one or more parts of consecutive output columns (a fused
 * projection whose shards differ in type, e.g. a Q4_K_M file's Q4_K query and Q6_K value rows).
 *
 * As llama.cpp multiplies them: each row of x is quantized once per call into int8 blocks of the kind
 * the weight's type pairs with (act_q8 for the legacy types, act_q8_K for the K-quants; the float types
 * take x as it is), and a block's products are integer sums scaled in float once. A row's quantization
 * depends on that row alone and every output is computed by the same steps whatever the number of rows,
 * so a request's results do not depend on what it is batched with.
 *
 * Threads split a row's blocks to quantize it, then the output columns in groups of GROUP_COLS; a group's
 * weight rows stay in cache while every tile of up to GGML_TILE_ROWS rows of x passes over them, the weight
 * codes of a block unpacked once a tile. On AVX512-VNNI, Q4_0, Q4_K and Q6_K weights are repacked at load
 * into groups of 16 rows (ggml_x16.h, ggml_x16_pack) that give 16 columns a dot product (ggml_avx512.h); the
 * other paths unpack an x16 row back to the file's layout before their dot product. From GGML_TILE_ROWS rows,
 * Q4_K and Q6_K groups go in pairs whose scales (and Q6_K's codes) a thread unpacks once a call, every row then
 * passing over them (ggml_unpacked.h), with the same bits.
 */

#include <stdlib.h>

#include "ggml_blocks.h"
#include "ggml_generic.h"
#include "ggml_avx2.h"
#include "ggml_avx512.h"
#include "ggml_unpacked.h"
#include "ggml_x16.h"
#include "kernels.h"

#ifndef GGML_TILE_ROWS
#define GGML_TILE_ROWS 4
#endif
#define GROUP_COLS X16

enum { GGML_PATH_GENERIC = 0, GGML_PATH_AVX2 = 1, GGML_PATH_AVX512 = 2 };
static int ggml_limit = GGML_PATH_AVX512;

/* Caps the path linear_ggml_f32 may take at `limit` (0 generic, 1 avx2, 2 avx512-vnni). */
void ggml_linear_limit(int limit) { ggml_limit = limit; }

/* Rows of x from which the AVX512-VNNI path multiplies x16 Q4_K and Q6_K weights in pairs of groups unpacked once
 * a call (ggml_unpacked.h) rather than a group a tile of GGML_TILE_ROWS (ggml_avx512.h); both give the same bits.
 * From a tile's rows the pairs were faster for both types (at one row the group tiles are: Q6_K's by 1.8x). */
static int64_t unpacked_min_rows = GGML_TILE_ROWS;

/* Sets the rows from which linear_ggml_f32 multiplies x16 K-quants in unpacked pairs of groups (tests compare). */
void ggml_unpacked_rows(int64_t rows) { unpacked_min_rows = rows; }

/* What linear_ggml_f32 runs on this CPU: GGML_PATH_AVX512 (AVX2 for the types without x16 kernels),
 * GGML_PATH_AVX2 or GGML_PATH_GENERIC. */
int ggml_linear_path(void) {
#if defined(GGML_AVX512) && defined(GGML_AVX2)
    if (ggml_limit >= GGML_PATH_AVX512) return GGML_PATH_AVX512;
#endif
#ifdef GGML_AVX2
    if (ggml_limit >= GGML_PATH_AVX2) return GGML_PATH_AVX2;
#endif
    return GGML_PATH_GENERIC;
}

/* Bytes of a row of K features of `type`, or 0 where the type is not served (or K does not fit its blocks). */
int64_t ggml_type_row_bytes(int32_t type, int64_t K) { return ggml_row_bytes(type, K); }

/* The x16 type that a weight of `rows` rows of `type` is repacked into on this path (ggml_x16_pack), or -1 where
 * it stays in the file's layout: the path has no 16-row kernels, the type no x16 layout, or rows is not a
 * multiple of 16. */
int ggml_x16_type_for(int32_t type, int64_t rows) {
    if (ggml_linear_path() < GGML_PATH_AVX512 || rows % X16) return -1;
    return ggml_x16_type(type);
}

/* `rows` rows of K features of `type` (a multiple of 16, a type with an x16 layout) repacked into dst (as many
 * bytes). Returns 0, or -1 where the type or rows do not fit. */
int ggml_x16_pack(int32_t type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst) {
    const int64_t row_bytes = ggml_row_bytes(type, K);
    if (ggml_x16_type(type) < 0 || rows % X16 || row_bytes == 0) return -1;
#pragma omp parallel for schedule(static) if (rows * K > PARALLEL_MIN)
    for (int64_t g = 0; g < rows / X16; ++g) x16_pack_group(type, src + g * X16 * row_bytes, K, dst + g * X16 * row_bytes);
    return 0;
}

/* ------------------------------------------------------------------------- activation quantization */

/* 16 floats rounded to int32, to nearest, ties to even: nearbyintf's result in the default rounding mode (which
 * the vector conversions use too). */
static inline vi16 round16(vf16 v) {
#if defined(__AVX512F__)
    return (vi16)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX2__)
    __m256 half[2];
    __m256i r[2];
    memcpy(half, &v, sizeof v);
    r[0] = _mm256_cvtps_epi32(half[0]), r[1] = _mm256_cvtps_epi32(half[1]);
    vi16 out;
    memcpy(&out, r, sizeof out);
    return out;
#else
    vi16 out;
    for (int l = 0; l < 16; ++l) out[l] = (int32_t)nearbyintf(v[l]);
    return out;
#endif
}

/* n values (a multiple of 16) as int8 q = round(x / d), d = max |x| / 127 (ties to even); sums[j] = the sum of
 * q[16 j .. 16 j + 15]. Returns d. Sixteen lanes at a time: a maximum is exact in any order, and a NaN never wins
 * it (as with fmaxf). */
static inline float quantize_int8(const float *x, int n, int8_t *q, int32_t *sums) {
    const vi16 magnitude = (vi16){0} + 0x7fffffff;
    vf16 m = (vf16){0};
    for (int i = 0; i < n; i += 16) {
        vf16 v;
        memcpy(&v, x + i, sizeof v);
        const vf16 a = (vf16)((vi16)v & magnitude);
        const vi16 larger = a > m;
        m = (vf16)(((vi16)a & larger) | ((vi16)m & ~larger));
    }
    float amax = 0.0f;
    for (int l = 0; l < 16; ++l) amax = m[l] > amax ? m[l] : amax;
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i += 16) {
        vf16 v;
        memcpy(&v, x + i, sizeof v);
        const vi16 r = round16(v * id);
        int32_t sum = 0;
        for (int l = 0; l < 16; ++l) q[i + l] = (int8_t)r[l], sum += r[l];
        sums[i / 16] = sum;
    }
    return d;
}

static void quantize_block_q8(const float *x, act_q8 *out) {
    int32_t sums[QK / 16];
    out->d = quantize_int8(x, QK, out->qs, sums);
    out->s = out->d * (float)(sums[0] + sums[1]);
    out->start = -128 * (sums[0] + sums[1]);
}

static void quantize_block_q8_K(const float *x, act_q8_K *b) {
    int32_t sums[QK_K / 16];
    b->d = quantize_int8(x, QK_K, b->qs, sums);
    for (int s = 0; s < QK_K / 16; ++s) b->bsums[s] = (int16_t)sums[s];
    for (int s = 0; s < QK_K / 32; ++s) b->dsums[s] = b->d * (float)(sums[2 * s] + sums[2 * s + 1]);
    memset(b->pad, 0, sizeof b->pad);
}

/* ------------------------------------------------------------------------------------- the tiles */

typedef struct {
    const float *x;
    int64_t ld_x;
    const act_q8 *q8;     /* [M][K / QK] */
    const act_q8_K *q8_K; /* [M][K / QK_K] */
    int64_t K;
} activations;

/* Weight row w of `type` times rows m0 .. m0 + R - 1 of the activations, into out[0 .. R - 1]. */
static void tile_generic(int type, const uint8_t *w, const activations *a, int64_t m0, int R, float *out) {
    const int64_t K = a->K;
    for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        switch (ggml_act(type)) {
        case ACT_FLOAT: out[r] = dot_float_generic(type, w, a->x + m * a->ld_x, K); break;
        case ACT_Q8: out[r] = dot_q8_generic(type, w, a->q8 + m * (K / QK), K); break;
        default: out[r] = dot_q8_K_generic(type, w, a->q8_K + m * (K / QK_K), K); break;
        }
    }
}

#ifdef GGML_AVX2
/* tile_generic's results on AVX2, each (type, R) inlined with its constants. */
static inline __attribute__((always_inline)) void tile_avx2_rows(int type, const uint8_t *w, const activations *a,
                                                                 int64_t m0, int R, float *out) {
    const int64_t K = a->K;
    switch (type) {
    case GGML_F32: case GGML_F16: case GGML_BF16:
        for (int r = 0; r < R; r += FLOAT_TILE_ROWS) {
            const float *x = a->x + (m0 + r) * a->ld_x;
            if (R - r >= FLOAT_TILE_ROWS) tile_float_avx2(type, w, x, a->ld_x, FLOAT_TILE_ROWS, K, out + r);
            else tile_float_avx2(type, w, x, a->ld_x, 1, K, out + r);
        }
        return;
    case GGML_Q4_K: tile_k4_avx2(0, w, a->q8_K + m0 * (K / QK_K), K / QK_K, R, K, out); return;
    case GGML_Q5_K: tile_k4_avx2(1, w, a->q8_K + m0 * (K / QK_K), K / QK_K, R, K, out); return;
    case GGML_Q6_K: tile_q6_K_avx2(w, a->q8_K + m0 * (K / QK_K), K / QK_K, R, K, out); return;
    default: tile_q8_avx2(type, w, a->q8 + m0 * (K / QK), K / QK, R, K, out); return;
    }
}

#define TYPE_CASE(T)                                                            \
    case T:                                                                     \
        switch (R) {                                                            \
        case 1: tile_avx2_rows(T, w, a, m0, 1, out); return;                    \
        case 2: tile_avx2_rows(T, w, a, m0, 2, out); return;                    \
        case 3: tile_avx2_rows(T, w, a, m0, 3, out); return;                    \
        default: tile_avx2_rows(T, w, a, m0, GGML_TILE_ROWS, out); return;      \
        }

static void tile_avx2(int type, const uint8_t *w, const activations *a, int64_t m0, int R, float *out) {
    switch (type) {
        TYPE_CASE(GGML_F32)
        TYPE_CASE(GGML_F16)
        TYPE_CASE(GGML_BF16)
        TYPE_CASE(GGML_Q8_0)
        TYPE_CASE(GGML_Q4_0)
        TYPE_CASE(GGML_Q4_1)
        TYPE_CASE(GGML_Q5_0)
        TYPE_CASE(GGML_Q5_1)
        TYPE_CASE(GGML_Q4_K)
        TYPE_CASE(GGML_Q5_K)
        TYPE_CASE(GGML_Q6_K)
    }
}
#undef TYPE_CASE
#endif

#ifdef GGML_AVX512
/* A group of 16 rows of an x16 type times rows m0 .. m0 + R - 1 of the activations, into out[R][16]. */
static void tile_x16(int type, const uint8_t *w, const activations *a, int64_t m0, int R, float *out) {
    const int64_t K = a->K;
#define ROWS_CASE(KERNEL, ACT, BLOCK)                                                    \
    switch (R) {                                                                         \
    case 1: KERNEL(w, a->ACT + m0 * (K / BLOCK), K / BLOCK, 1, K, out); return;          \
    case 2: KERNEL(w, a->ACT + m0 * (K / BLOCK), K / BLOCK, 2, K, out); return;          \
    case 3: KERNEL(w, a->ACT + m0 * (K / BLOCK), K / BLOCK, 3, K, out); return;          \
    default: KERNEL(w, a->ACT + m0 * (K / BLOCK), K / BLOCK, GGML_TILE_ROWS, K, out); return; \
    }
    switch (type) {
    case GGML_X16 + GGML_Q4_0: ROWS_CASE(tile_q4_0_x16, q8, QK)
    case GGML_X16 + GGML_Q8_0: ROWS_CASE(tile_q8_0_x16, q8, QK)
    case GGML_X16 + GGML_Q4_K: ROWS_CASE(tile_q4_K_x16, q8_K, QK_K)
    case GGML_X16 + GGML_Q6_K: ROWS_CASE(tile_q6_K_x16, q8_K, QK_K)
    default: return; /* Q5_K has no group tile: its groups go in pairs at every row count */
    }
#undef ROWS_CASE
}
#endif

/* ------------------------------------------------------------------------------------- the layer */

/* x [M, K] (leading dimension ld_x) times the parts' rows (their output columns one after another),
 * plus bias (or NULL), into y [M, N] (leading dimension ld_y). Returns 0; -1 for a type not served or a K
 * its blocks do not divide; -3 when the activations' scratch cannot be allocated. */
int linear_ggml_f32(const float *x, int64_t ld_x, int64_t M, const ggml_part *parts, int64_t num_parts, int64_t K,
                    const float *bias, float *y, int64_t ld_y) {
    int needs_q8 = 0, needs_q8_K = 0, any_x16 = 0, k_pairs = 0, failed = 0;
    int64_t N = 0, max_row_bytes = 0, num_pairs = 0;
    const int path = ggml_linear_path();
    /* the parts whose groups this call unpacks once (unpacked[p]), and their pairs of groups (32 columns) */
    int unpacked[num_parts > 0 ? num_parts : 1];
    for (int64_t p = 0; p < num_parts; ++p) {
        const int64_t row_bytes = ggml_row_bytes(parts[p].type, K);
        if (row_bytes == 0 || (ggml_is_x16(parts[p].type) && parts[p].rows % X16)) return -1;
        needs_q8 |= ggml_act(parts[p].type) == ACT_Q8;
        needs_q8_K |= ggml_act(parts[p].type) == ACT_Q8_K;
        any_x16 |= ggml_is_x16(parts[p].type);
        max_row_bytes = row_bytes > max_row_bytes ? row_bytes : max_row_bytes;
        unpacked[p] = 0;
#ifdef GGML_AVX512 /* a part off a group boundary runs a row at a time below, whatever M: so it stays */
        unpacked[p] = path == GGML_PATH_AVX512 && N % GROUP_COLS == 0 && ggml_is_x16(parts[p].type) &&
                      (M >= unpacked_min_rows || parts[p].type == GGML_X16 + GGML_Q5_K); /* Q5_K: no group tile */
#endif
        N += parts[p].rows;
        num_pairs += unpacked[p] ? (parts[p].rows / X16 + 1) / 2 : 0;
        k_pairs |= unpacked[p] && ggml_act(parts[p].type) == ACT_Q8_K; /* pairs whose scales are unpacked */
    }
    if (M == 0 || N == 0) return 0;
    activations a = {x, ld_x, NULL, NULL, K};
    act_q8 *q8 = NULL;
    act_q8_K *q8_K = NULL;
    int32_t *offsets = NULL; /* [M][K / QK_K][UNPACKED_OFFSETS] for the K-quants' unpacked groups */
    if (k_pairs && (offsets = malloc((size_t)(M * (K / QK_K) * UNPACKED_OFFSETS) * sizeof(int32_t))) == NULL) return -3;
    if ((needs_q8 && (q8 = aligned_alloc(64, (size_t)(M * (K / QK) * sizeof(act_q8) + 63) / 64 * 64)) == NULL) ||
        (needs_q8_K && (q8_K = aligned_alloc(64, (size_t)(M * (K / QK_K) * sizeof(act_q8_K)))) == NULL)) {
        free(offsets);
        free(q8);
        return -3;
    }
    a.q8 = q8, a.q8_K = q8_K;
    const int64_t groups = (N + GROUP_COLS - 1) / GROUP_COLS;
#pragma omp parallel if (M * N * K > PARALLEL_MIN)
    {
        /* every block of every row on its own: one row's blocks split across the threads too */
        if (needs_q8) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * (K / QK); ++i)
                quantize_block_q8(x + i / (K / QK) * ld_x + i % (K / QK) * QK, q8 + i);
        }
        if (needs_q8_K) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * (K / QK_K); ++i)
                quantize_block_q8_K(x + i / (K / QK_K) * ld_x + i % (K / QK_K) * QK_K, q8_K + i);
        }
#ifdef GGML_AVX512
        if (num_pairs) { /* a thread unpacks a pair of groups into its scratch, then every row passes over it */
            uint8_t *scratch = NULL;
            if (k_pairs) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < M * (K / QK_K); ++i) unpacked_offsets(q8_K + i, offsets + i * UNPACKED_OFFSETS);
                if ((scratch = aligned_alloc(64, (size_t)(2 * (K / QK_K) * unpacked_sb_bytes(GGML_Q6_K)))) == NULL) {
#pragma omp atomic write
                    failed = 1;
                }
            }
#pragma omp for schedule(guided) nowait
            for (int64_t i = 0; i < num_pairs; ++i) {
                int64_t p = 0, first = 0, pair = i; /* pair i: the part, its first column, the pair within it */
                for (;; first += parts[p++].rows) {
                    const int64_t here = unpacked[p] ? (parts[p].rows / X16 + 1) / 2 : 0;
                    if (pair < here) break;
                    pair -= here;
                }
                const int type = parts[p].type - GGML_X16, two = 2 * (pair + 1) * X16 <= parts[p].rows;
                const int64_t row_bytes = ggml_row_bytes(parts[p].type, K), local = 2 * pair * X16;
                const uint8_t *w[2] = {NULL, NULL};
                for (int h = 0; h < 1 + two; ++h) w[h] = parts[p].data + (local + h * X16) * row_bytes;
                float b[2 * X16] = {0};
                if (bias != NULL) memcpy(b, bias + first + local, (1 + two) * X16 * sizeof(float));
                if (type == GGML_Q4_0 || type == GGML_Q8_0) {
                    rows_times_legacy_pair(type == GGML_Q4_0, w, two, q8, M, K, b, y + first + local, ld_y);
                    continue;
                }
                if (scratch == NULL) continue; /* out of memory: reported after the region */
                const uint8_t *u[2] = {scratch, scratch + (K / QK_K) * unpacked_sb_bytes(type)};
                for (int h = 0; h < 1 + two; ++h) {
                    if (type == GGML_Q6_K) unpack_q6_K_x16(w[h], K, (uint8_t *)u[h]);
                    else unpack_k4_x16(type == GGML_Q5_K, w[h], K, (uint8_t *)u[h]);
                }
                rows_times_unpacked(type, u, w, two, q8_K, offsets, M, K, b, y + first + local, ld_y);
            }
            free(scratch);
        }
#endif
        uint8_t *unpacked_row = any_x16 ? malloc((size_t)max_row_bytes) : NULL; /* an x16 row in the file's layout */
        /* guided: a fused projection's parts differ in bytes a column (Q4_K query and key, Q6_K value), so equal
         * counts of groups are not equal work; chunks that shrink as the groups run out even it out */
#pragma omp for schedule(guided)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t n0 = g * GROUP_COLS, n1 = n0 + GROUP_COLS < N ? n0 + GROUP_COLS : N;
            for (int64_t m0 = 0; m0 < M; m0 += GGML_TILE_ROWS) {
                const int R = M - m0 < GGML_TILE_ROWS ? (int)(M - m0) : GGML_TILE_ROWS;
                int64_t p = 0, first = 0; /* the part of column n0, and its first column */
                while (n0 >= first + parts[p].rows) first += parts[p++].rows;
                for (int64_t n = n0; n < n1; ++n) {
                    if (n >= first + parts[p].rows) first += parts[p++].rows;
                    if (unpacked[p]) continue;
                    int type = parts[p].type;
                    const int64_t row_bytes = ggml_row_bytes(type, K), local = n - first;
                    const uint8_t *w = parts[p].data + local * row_bytes;
                    float b = bias != NULL ? bias[n] : 0.0f;
                    if (ggml_is_x16(type)) {
                        const uint8_t *group = parts[p].data + (local - local % X16) * row_bytes;
#ifdef GGML_AVX512
                        if (path == GGML_PATH_AVX512 && local % X16 == 0 && n + X16 <= n1) {
                            float out16[GGML_TILE_ROWS * X16];
                            tile_x16(type, group, &a, m0, R, out16);
                            for (int c = 0; c < X16; ++c, ++n) {
                                b = bias != NULL ? bias[n] : 0.0f;
                                for (int r = 0; r < R; ++r) y[(m0 + r) * ld_y + n] = out16[X16 * r + c] + b;
                            }
                            --n;
                            continue;
                        }
#endif
                        if (unpacked_row == NULL) continue; /* out of memory: reported after the region */
                        x16_unpack_row(type, group, (int)(local % X16), K, unpacked_row);
                        type = ggml_base_type(type), w = unpacked_row;
                    }
                    float out[GGML_TILE_ROWS];
#ifdef GGML_AVX2
                    if (path >= GGML_PATH_AVX2) tile_avx2(type, w, &a, m0, R, out);
                    else
#endif
                        tile_generic(type, w, &a, m0, R, out);
                    for (int r = 0; r < R; ++r) y[(m0 + r) * ld_y + n] = out[r] + b;
                }
            }
        }
        if (any_x16 && unpacked_row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        free(unpacked_row);
    }
    (void)path;
    free(offsets);
    free(q8);
    free(q8_K);
    return failed ? -3 : 0;
}

/* Rows index[0 .. n - 1] of a [rows, K] weight of `type` (x16 types too), dequantized to float32 into out [n, K]:
 * an embedding lookup. Returns 0, -1 for a type not served, -3 when a row's scratch cannot be allocated. */
int ggml_dequantize_rows(int32_t type, const uint8_t *data, int64_t K, const int64_t *index, int64_t n, float *out) {
    const int64_t row_bytes = ggml_row_bytes(type, K);
    if (row_bytes == 0) return -1;
    if (!ggml_is_x16(type)) {
#pragma omp parallel for schedule(static) if (n * K > PARALLEL_MIN)
        for (int64_t i = 0; i < n; ++i) dequantize_row(type, data + index[i] * row_bytes, K, out + i * K);
        return 0;
    }
    int failed = 0;
#pragma omp parallel if (n * K > PARALLEL_MIN)
    {
        uint8_t *row = malloc((size_t)row_bytes);
        if (row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            if (row == NULL) continue;
            const int64_t g = index[i] / X16;
            x16_unpack_row(type, data + g * X16 * row_bytes, (int)(index[i] % X16), K, row);
            dequantize_row(ggml_base_type(type), row, K, out + i * K);
        }
        free(row);
    }
    return failed ? -3 : 0;
}

/* ------------------------------------------------------------------------ the dense layout at batch */

/* Rows of a weight of `type` (x16 types too) as linear_int8.c's int8-products layout, what
 * quantization.py's pack(quantize_symmetric_int8(hadamard_blocks(W)), int8_products=True) makes of the
 * dequantized rows: each block of 32 weights rotated (W H / 32, the Walsh-Hadamard butterflies in double),
 * symmetric int8 codes q + 128 with d = max |w| / 127, q = round(w / d) ties to even. The `rows` rows land at
 * output rows row0 .. row0 + rows - 1 of codes [P][K / 32][8][16][4] and scales [P][K / 32][16]. Returns 0; -1
 * for a type not served or K not a multiple of 32; -3 when a row's scratch cannot be allocated. */
int ggml_int8_panels(int32_t type, const uint8_t *data, int64_t rows, int64_t K, int64_t row0, uint8_t *codes,
                     float *scales) {
    const int64_t row_bytes = ggml_row_bytes(type, K), nb = K / 32;
    if (row_bytes == 0 || K % 32) return -1;
    const int x16 = ggml_is_x16(type);
    int failed = 0;
#pragma omp parallel if (rows * K > PARALLEL_MIN)
    {
        float *w = malloc((size_t)K * sizeof(float));
        uint8_t *unpacked = x16 ? malloc((size_t)row_bytes) : NULL;
        const int ok = w != NULL && (!x16 || unpacked != NULL);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            if (!ok) continue;
            if (x16) {
                x16_unpack_row(type, data + i / X16 * X16 * row_bytes, (int)(i % X16), K, unpacked);
                dequantize_row(ggml_base_type(type), unpacked, K, w);
            } else {
                dequantize_row(type, data + i * row_bytes, K, w);
            }
            const int64_t n = row0 + i, p = n / 16, j = n % 16;
            for (int64_t b = 0; b < nb; ++b) {
                double v[32];
                for (int l = 0; l < 32; ++l) v[l] = w[b * 32 + l];
                for (int h = 1; h < 32; h *= 2) /* v H, H Sylvester's: H[i][j] = (-1)^popcount(i & j) */
                    for (int s = 0; s < 32; s += 2 * h)
                        for (int l = s; l < s + h; ++l) {
                            const double a = v[l], c = v[l + h];
                            v[l] = a + c, v[l + h] = a - c;
                        }
                float r[32], amax = 0.0f;
                for (int l = 0; l < 32; ++l) {
                    r[l] = (float)(v[l] / 32.0);
                    amax = fabsf(r[l]) > amax ? fabsf(r[l]) : amax;
                }
                const float d = amax / 127.0f, div = d > 0.0f ? d : 1.0f;
                uint8_t *c = codes + (p * nb + b) * 32 * 16;
                for (int l = 0; l < 32; ++l) {
                    float q = nearbyintf(r[l] / div);
                    q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
                    c[(l / 4 * 16 + j) * 4 + l % 4] = (uint8_t)(int)(q + 128.0f);
                }
                scales[(p * nb + b) * 16 + j] = d;
            }
        }
        free(w);
        free(unpacked);
    }
    return failed ? -3 : 0;
}
