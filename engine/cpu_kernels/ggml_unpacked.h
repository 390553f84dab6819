/* The x16 types at several rows, in pairs of groups: the K-quants' scales (and Q5_K's and Q6_K's codes) unpacked
 * once a call, Q4_0's and Q8_0's codes read in place.
 *
 * ggml_avx512.h's tiles unpack a super-block's packed scales and mins (and Q6_K's 6-bit codes from three bit
 * fields) for each tile of GGML_TILE_ROWS rows and one group of 16 columns, so at 64 rows that unpacking, not the
 * VPDPBUSD, sets the pace. Here a thread unpacks a pair of groups (32 columns) once into its scratch, a super-block
 * of a group into unpacked_sb_bytes():
 *   scales int32 [sub-blocks][16]: Q4_K's 8 sc_j, Q6_K's 16 sc_s;
 *   Q4_K: mins as int16 pairs [4][16][2] (m_2p, m_2p+1), for VPDPWSSD against pairs of x's sums of 32;
 *   d [16] and (Q4_K) dmin [16] in float32;
 *   Q5_K, Q6_K: codes uint8 [64 units][16 columns][4], unit u the codes q (0..31, 0..63) of features 4 u .. 4 u + 3.
 * Q5_K has no group tile (its five-bit codes cost the same to rebuild for one row as for six): its groups go in
 * pairs at every row count, so its outputs too keep their bits whatever the batch.
 * Q4_K's codes are read from the group as they are (a mask or a shift and a mask a load): unpacking them into the
 * scratch was slower, Q6_K's three-field codes the other way round. Tiles of UNPACKED_TILE_ROWS rows then multiply
 * both groups, each broadcast of x feeding two VPDPBUSD. The integer sums are the x16 tiles' (exact, so their
 * order is free) and the float steps after them are the same steps in the same order: every output has the bits
 * ggml_avx512.h's tiles give it, whatever the number of rows.
 */

#ifndef PAGED_GGML_UNPACKED_H
#define PAGED_GGML_UNPACKED_H

#include "ggml_avx512.h"

#ifdef GGML_AVX512

#define UNPACKED_SCALES 0     /* offsets within a group's unpacked super-block */
#define UNPACKED_MINS 1024
#define UNPACKED_D 1280
#define UNPACKED_DMIN 1344
#define UNPACKED_CODES 1408
#define UNPACKED_OFFSETS 20   /* int32 a row's super-block of x: unpacked_offsets */
#define UNPACKED_TILE_ROWS 6  /* rows of x a tile: 6 x 2 groups x 3 accumulators (float, super-block, sub-block) */

/* Bytes of a group's unpacked super-block of `type` (Q4_K, Q5_K, Q6_K): Q5_K's and Q6_K's hold their codes too. */
static inline int64_t unpacked_sb_bytes(int type) { return type == GGML_Q4_K ? UNPACKED_CODES : UNPACKED_CODES + 64 * 64; }

/* Group `w` (x16 Q4_K, or Q5_K with q5, K features): its scales, mins and d's into out, a super-block every
 * unpacked_sb_bytes; Q5_K's codes too, each low nibble with its fifth bit (sub-block s: bit s of its qh byte). */
static void unpack_k4_x16(int q5, const uint8_t *w, int64_t K, uint8_t *out) {
    const __m512i low4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const int64_t block = X16 * (q5 ? sizeof(block_q5_K) : sizeof(block_q4_K));
    for (int64_t i = 0; i < K / QK_K; ++i, w += block, out += unpacked_sb_bytes(q5 ? GGML_Q5_K : GGML_Q4_K)) {
        __m512i sc[8], mn[8];
        if (!q5) /* Q4_K's codes, which the tiles read in place (Q5_K's are read just below) */
            for (int64_t l = 0; l < block; l += 64) _mm_prefetch((const char *)w + l, _MM_HINT_T1);
        for (int l = 0; l < 4; ++l) prefetch_ahead(w + 64 * l);
        k4_x16_scales(w, sc, mn);
        for (int j = 0; j < 8; ++j) _mm512_storeu_si512(out + UNPACKED_SCALES + 64 * j, sc[j]);
        for (int p = 0; p < 4; ++p) /* m_2p in the low 16 bits of a lane, m_2p+1 in the high */
            _mm512_storeu_si512(out + UNPACKED_MINS + 64 * p, _mm512_or_si512(mn[2 * p], _mm512_slli_epi32(mn[2 * p + 1], 16)));
        _mm512_storeu_ps(out + UNPACKED_D, f16x16(w));
        _mm512_storeu_ps(out + UNPACKED_DMIN, f16x16(w + 32));
        if (!q5) continue;
        for (int s = 0; s < 8; ++s) /* qh unit c at 256, qs unit 8 g + c at 768 (ggml_x16.h) */
            for (int c = 0; c < 8; ++c) {
                const __m512i v = _mm512_loadu_si512(w + 768 + 64 * (8 * (s / 2) + c)), h = _mm512_loadu_si512(w + 256 + 64 * c);
                const __m512i lo = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(v, 4) : v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(h, s), one);
                _mm512_storeu_si512(out + UNPACKED_CODES + 64 * (8 * s + c), _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
            }
    }
}

/* Group `w` (x16 Q6_K, K features) into out: the 16 int8 scales widened, d, the codes q (0..63). */
static void unpack_q6_K_x16(const uint8_t *w, int64_t K, uint8_t *out) {
    const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3);
    for (int64_t i = 0; i < K / QK_K; ++i, w += X16 * sizeof(block_q6_K), out += unpacked_sb_bytes(GGML_Q6_K)) {
        for (int l = 0; l < 5; ++l) prefetch_ahead(w + 64 * l);
        for (int s = 0; s < 16; ++s)
            _mm512_storeu_si512(out + UNPACKED_SCALES + 64 * s,
                                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 32 + 16 * s))));
        _mm512_storeu_ps(out + UNPACKED_D, f16x16(w));
        for (int h = 0; h < 2; ++h)
            for (int c = 0; c < 8; ++c) { /* part p: features 128 h + 32 p + 4 c, unit 32 h + 8 p + c */
                const uint8_t *unit = w + 288 + 192 * (8 * h + c);
                const __m512i l0 = _mm512_loadu_si512(unit), l1 = _mm512_loadu_si512(unit + 64);
                const __m512i hb = _mm512_loadu_si512(unit + 128);
                for (int l = 0; l < 3; ++l) prefetch_ahead(unit + 64 * l);
                uint8_t *q = out + UNPACKED_CODES + 64 * (32 * h + c);
                _mm512_storeu_si512(q, _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_slli_epi16(_mm512_and_si512(hb, low2), 4)));
                _mm512_storeu_si512(q + 64 * 8, _mm512_or_si512(_mm512_and_si512(l1, low4),
                                                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2), low2), 4)));
                _mm512_storeu_si512(q + 64 * 16, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                                                                 _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), low2), 4)));
                _mm512_storeu_si512(q + 64 * 24, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                                                                 _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 6), low2), 4)));
            }
    }
}

/* `rows` rows of x (act_q8_K [., K / QK_K], a_row super-blocks a row) times one or two unpacked groups u[0], u[1]
 * (`two`) of `type` (Q4_K, Q5_K, Q6_K; Q4_K's codes read from w), plus bias (16 entries a group), into y's first
 * 16 (32) columns (leading dimension ld_y). Inlined with constant type, rows and two. */
static inline __attribute__((always_inline)) void tile_unpacked(int type, const uint8_t *const u[2],
                                                                const uint8_t *const w[2], int two,
                                                                const act_q8_K *a, const int32_t *offsets,
                                                                int64_t a_row, int rows,
                                                                int64_t K, const float *bias, float *y,
                                                                int64_t ld_y) {
    const int G = two ? 2 : 1, q6 = type == GGML_Q6_K;
    __m512 acc[UNPACKED_TILE_ROWS][2];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / QK_K; ++i) {
        const uint8_t *sb[2] = {u[0] + i * unpacked_sb_bytes(type), u[1] + i * unpacked_sb_bytes(type)};
        __m512i sum[UNPACKED_TILE_ROWS][2];
        for (int r = 0; r < rows; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
        const int subs = q6 ? 16 : 8, units = q6 ? 4 : 8; /* sub-blocks, and 4-feature units a sub-block */
        for (int s = 0; s < subs; ++s) {
            __m512i part[UNPACKED_TILE_ROWS][2];
            for (int r = 0; r < rows; ++r) /* Q6_K: sum(sc (q - 32) x) = sc (sum(q x) - 32 sum(x)) */
                part[r][0] = part[r][1] = q6 ? _mm512_set1_epi32(offsets[(r * a_row + i) * UNPACKED_OFFSETS + s])
                                            : _mm512_setzero_si512();
            for (int c = 0; c < units; ++c) {
                const int unit = s * units + c;
                __m512i wv[2];
                for (int h = 0; h < G; ++h) {
                    if (type != GGML_Q4_K) {
                        wv[h] = _mm512_loadu_si512(sb[h] + UNPACKED_CODES + 64 * unit);
                    } else { /* the group's own codes: sub-block s in the low (even s) or high nibbles of unit 8 (s / 2) + c */
                        const __m512i v = _mm512_loadu_si512(w[h] + i * X16 * sizeof(block_q4_K) + 256 + 64 * (8 * (s / 2) + c));
                        wv[h] = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(15));
                    }
                }
                for (int r = 0; r < rows; ++r) {
                    const __m512i xb = codes4(a[r * a_row + i].qs, 4 * unit);
                    for (int h = 0; h < G; ++h) part[r][h] = _mm512_dpbusd_epi32(part[r][h], wv[h], xb);
                }
            }
            for (int h = 0; h < G; ++h) {
                const __m512i scale = _mm512_loadu_si512(sb[h] + UNPACKED_SCALES + 64 * s);
                for (int r = 0; r < rows; ++r) sum[r][h] = _mm512_add_epi32(sum[r][h], _mm512_mullo_epi32(scale, part[r][h]));
            }
        }
        for (int r = 0; r < rows; ++r) {
            const act_q8_K *x = a + r * a_row + i;
            const __m512 xd = _mm512_set1_ps(x->d);
            for (int h = 0; h < G; ++h)
                acc[r][h] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps((const float *)(sb[h] + UNPACKED_D)), xd),
                                            _mm512_cvtepi32_ps(sum[r][h]), acc[r][h]);
            if (!q6) { /* mins: sum_j m_j (x's sum of sub-block j), as int16 pairs */
                __m512i mins[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int p = 0; p < 4; ++p) {
                    const __m512i pair = _mm512_set1_epi32(offsets[(r * a_row + i) * UNPACKED_OFFSETS + 16 + p]);
                    for (int h = 0; h < G; ++h)
                        mins[h] = _mm512_dpwssd_epi32(mins[h], _mm512_loadu_si512(sb[h] + UNPACKED_MINS + 64 * p), pair);
                }
                for (int h = 0; h < G; ++h)
                    acc[r][h] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_loadu_ps((const float *)(sb[h] + UNPACKED_DMIN)), xd),
                                                 _mm512_cvtepi32_ps(mins[h]), acc[r][h]);
            }
        }
    }
    for (int h = 0; h < G; ++h) {
        const __m512 b = _mm512_loadu_ps(bias + X16 * h);
        for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * ld_y + X16 * h, _mm512_add_ps(acc[r][h], b));
    }
}

/* Rows 0 .. M - 1 of x times the unpacked groups (tile_unpacked's arguments), in tiles of as equal sizes as
 * UNPACKED_TILE_ROWS allows (8 rows: 2 of 4, not 6 and 2). */
static void rows_times_unpacked(int type, const uint8_t *const u[2], const uint8_t *const w[2], int two,
                                const act_q8_K *a, const int32_t *offsets, int64_t M, int64_t K, const float *bias,
                                float *y, int64_t ld_y) {
    const int64_t a_row = K / QK_K, tiles = (M + UNPACKED_TILE_ROWS - 1) / UNPACKED_TILE_ROWS;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int rows = (int)(M / tiles + (t < M % tiles));
        const act_q8_K *am = a + m * a_row;
        const int32_t *om = offsets + m * a_row * UNPACKED_OFFSETS;
        float *ym = y + m * ld_y;
#define TILE(T, TWO, R) tile_unpacked(T, u, w, TWO, am, om, a_row, R, K, bias, ym, ld_y)
#define ROWS(T, TWO)                                \
    switch (rows) {                                 \
    case 1: TILE(T, TWO, 1); break;                 \
    case 2: TILE(T, TWO, 2); break;                 \
    case 3: TILE(T, TWO, 3); break;                 \
    case 4: TILE(T, TWO, 4); break;                 \
    case 5: TILE(T, TWO, 5); break;                 \
    default: TILE(T, TWO, UNPACKED_TILE_ROWS); break; \
    }
#define TYPE(T)                              \
    case T:                                  \
        if (two) ROWS(T, 1) else ROWS(T, 0) \
        break;
        switch (type) {
            TYPE(GGML_Q4_K)
            TYPE(GGML_Q5_K)
            TYPE(GGML_Q6_K)
        }
#undef TYPE
#undef ROWS
#undef TILE
        m += rows;
    }
}

/* `rows` rows of x (act_q8 [., K / QK], a_row blocks a row) times one or two x16 Q4_0 or Q8_0 groups w[0], w[1] read
 * in place (their codes need no unpacking: Q4_0's a mask, or a shift and a mask, a load), plus bias, into y: the
 * steps of tile_q4_0_x16 and tile_q8_0_x16, each broadcast of x feeding both groups. The first tile of a pair
 * (`ahead`) prefetches Q4_0's groups for the others (Q8_0's twice as many codes a byte of x keep it busy enough
 * that prefetching cost more than it saved). Inlined with constant q4, rows and two. */
static inline __attribute__((always_inline)) void tile_legacy_pair(int q4, const uint8_t *const w[2], int two,
                                                                   const act_q8 *a, int64_t a_row, int rows, int64_t K,
                                                                   const float *bias, float *y, int64_t ld_y, int ahead) {
    const int G = two ? 2 : 1;
    const int64_t block = X16 * (q4 ? sizeof(block_q4_0) : sizeof(block_q8_0));
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[UNPACKED_TILE_ROWS][2];
    for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / QK; ++i) {
        const uint8_t *b[2] = {w[0] + i * block, w[1] + i * block};
        __m512i sum[UNPACKED_TILE_ROWS][2];
        for (int r = 0; r < rows; ++r)
            sum[r][0] = sum[r][1] = q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(a[r * a_row + i].start);
        for (int c = 0; c < (q4 ? 4 : 8); ++c) {
            __m512i wv[2][2]; /* Q4_0: the low nibbles (features 4 c ..) and the high ones (16 + 4 c ..) */
            for (int h = 0; h < G; ++h) {
                const __m512i v = _mm512_loadu_si512(b[h] + 32 + 64 * c);
                if (ahead && q4) prefetch_ahead(b[h] + 64 * c);
                wv[h][0] = q4 ? _mm512_and_si512(v, low4) : v;
                if (q4) wv[h][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
            for (int r = 0; r < rows; ++r) {
                const int8_t *x = a[r * a_row + i].qs;
                const __m512i x0 = codes4(x, 4 * c);
                for (int h = 0; h < G; ++h) sum[r][h] = _mm512_dpbusd_epi32(sum[r][h], wv[h][0], x0);
                if (q4) {
                    const __m512i x1 = codes4(x, 16 + 4 * c);
                    for (int h = 0; h < G; ++h) sum[r][h] = _mm512_dpbusd_epi32(sum[r][h], wv[h][1], x1);
                }
            }
        }
        for (int h = 0; h < G; ++h) {
            const __m512 d = f16x16(b[h]);
            for (int r = 0; r < rows; ++r) {
                const act_q8 *x = a + r * a_row + i;
                if (q4) /* Q4_0: d (x.d sum(q x) - 8 x.s) */
                    acc[r][h] = _mm512_fmadd_ps(d, _mm512_fmsub_ps(_mm512_cvtepi32_ps(sum[r][h]), _mm512_set1_ps(x->d),
                                                                   _mm512_set1_ps(8.0f * x->s)), acc[r][h]);
                else
                    acc[r][h] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(sum[r][h]),
                                                acc[r][h]);
            }
        }
    }
    for (int h = 0; h < G; ++h) {
        const __m512 bv = _mm512_loadu_ps(bias + X16 * h);
        for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * ld_y + X16 * h, _mm512_add_ps(acc[r][h], bv));
    }
}

/* Rows 0 .. M - 1 of x times one or two x16 Q4_0 (q4) or Q8_0 groups, in tiles of as equal sizes as
 * UNPACKED_TILE_ROWS allows. */
static void rows_times_legacy_pair(int q4, const uint8_t *const w[2], int two, const act_q8 *a, int64_t M, int64_t K,
                                   const float *bias, float *y, int64_t ld_y) {
    const int64_t a_row = K / QK, tiles = (M + UNPACKED_TILE_ROWS - 1) / UNPACKED_TILE_ROWS;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int rows = (int)(M / tiles + (t < M % tiles));
        const act_q8 *am = a + m * a_row;
        float *ym = y + m * ld_y;
#define TILE(Q4, TWO, R) tile_legacy_pair(Q4, w, TWO, am, a_row, R, K, bias, ym, ld_y, t == 0)
#define ROWS(Q4, TWO)                                  \
    switch (rows) {                                    \
    case 1: TILE(Q4, TWO, 1); break;                   \
    case 2: TILE(Q4, TWO, 2); break;                   \
    case 3: TILE(Q4, TWO, 3); break;                   \
    case 4: TILE(Q4, TWO, 4); break;                   \
    case 5: TILE(Q4, TWO, 5); break;                   \
    default: TILE(Q4, TWO, UNPACKED_TILE_ROWS); break; \
    }
        if (q4) {
            if (two) ROWS(1, 1) else ROWS(1, 0)
        } else {
            if (two) ROWS(0, 1) else ROWS(0, 0)
        }
#undef ROWS
#undef TILE
        m += rows;
    }
}

/* A row's super-block of x (act_q8_K) as the int32 offsets[UNPACKED_OFFSETS] that tile_unpacked broadcasts: -32 times
 * each sum of 16 (Q6_K's q - 32), then the sums of 32 in int16 pairs (sub-blocks 2 p, 2 p + 1; Q4_K's mins). */
static inline void unpacked_offsets(const act_q8_K *x, int32_t *offsets) {
    for (int s = 0; s < 16; ++s) offsets[s] = -32 * x->bsums[s];
    for (int p = 0; p < 4; ++p) {
        const int32_t lo = x->bsums[4 * p] + x->bsums[4 * p + 1], hi = x->bsums[4 * p + 2] + x->bsums[4 * p + 3];
        offsets[16 + p] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)hi << 16);
    }
}

#endif /* GGML_AVX512 */
#endif
