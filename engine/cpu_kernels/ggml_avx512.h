/* The x16 types' dot products on AVX512-VNNI (ggml_x16.h): a group of 16 weight rows against R activation
 * rows (R = 1..GGML_TILE_ROWS) into 16 output columns a row. Each 512-bit load holds the same 4 codes of the
 * 16 rows; VPDPBUSD multiplies them (unsigned) by the activation row's 4 codes broadcast (signed) and adds the
 * 4 products into the row's int32 lane, so a block's integer sums come out one per lane, exact; the 16 rows'
 * f16 scales convert in one instruction, and a block's sums are scaled in float once. The lanes never mix:
 * a column's result is the same steps whatever R or the other columns. */

#ifndef PAGED_GGML_AVX512_H
#define PAGED_GGML_AVX512_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGML_AVX512 1

#include <immintrin.h>

#include "ggml_blocks.h"
#include "ggml_x16.h"

#ifndef GGML_TILE_ROWS
#define GGML_TILE_ROWS 4
#endif

/* The activation codes x[off .. off + 3] in every lane. */
static inline __m512i codes4(const int8_t *x, int off) {
    int32_t v;
    memcpy(&v, x + off, 4);
    return _mm512_set1_epi32(v);
}

static inline __m512 f16x16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Q4_0: w = d (q - 8), so a column's block is d (x.d sum(q x) - 8 x.s). */
static inline __attribute__((always_inline)) void tile_q4_0_x16(const uint8_t *w, const act_q8 *a, int64_t a_row,
                                                                int R, int64_t K, float *out) {
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / QK; ++i, w += X16 * sizeof(block_q4_0)) {
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(w + 32 + 64 * c);
            prefetch_ahead(w + 64 * c);
            lo[c] = _mm512_and_si512(v, low4), hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        const __m512 d = f16x16(w);
        for (int r = 0; r < R; ++r) {
            const act_q8 *x = a + r * a_row + i;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) {
                s0 = _mm512_dpbusd_epi32(s0, lo[c], codes4(x->qs, 4 * c));
                s1 = _mm512_dpbusd_epi32(s1, hi[c], codes4(x->qs, 16 + 4 * c));
            }
            const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(x->d),
                                             _mm512_set1_ps(8.0f * x->s));
            acc[r] = _mm512_fmadd_ps(d, t, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + X16 * r, acc[r]);
}

/* Q8_0: w = d q, the codes stored as q + 128, so a column's block is d x.d (sum((q + 128) x) - 128 sum(x)), the sum
 * starting from x.start = -128 sum(x). */
static inline __attribute__((always_inline)) void tile_q8_0_x16(const uint8_t *w, const act_q8 *a, int64_t a_row,
                                                                int R, int64_t K, float *out) {
    __m512 acc[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / QK; ++i, w += X16 * sizeof(block_q8_0)) {
        __m512i codes[8];
        for (int c = 0; c < 8; ++c) codes[c] = _mm512_loadu_si512(w + 32 + 64 * c);
        for (int c = 0; c < 9; ++c) prefetch_ahead(w + 64 * c); /* a block of 16 rows: 544 bytes */
        const __m512 d = f16x16(w);
        for (int r = 0; r < R; ++r) {
            const act_q8 *x = a + r * a_row + i;
            __m512i sum = _mm512_set1_epi32(x->start);
            for (int c = 0; c < 8; ++c) sum = _mm512_dpbusd_epi32(sum, codes[c], codes4(x->qs, 4 * c));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x->d)), _mm512_cvtepi32_ps(sum), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + X16 * r, acc[r]);
}

/* A Q4_K (or Q5_K) x16 block's 16 rows' 6-bit scales sc[j] and mins mn[j] of sub-blocks j = 0..7, a lane a row,
 * unpacked from the 3 units of scale bytes at w + 64 as k4_scales does: bytes 0..3 of the first unit's masked
 * lanes are sc_0..3, and so on. */
static inline __attribute__((always_inline)) void k4_x16_scales(const uint8_t *w, __m512i sc[8], __m512i mn[8]) {
    const __m512i low4 = _mm512_set1_epi8(15), low6 = _mm512_set1_epi8(0x3f), two = _mm512_set1_epi8(3),
                  byte = _mm512_set1_epi32(0xff);
    const __m512i A = _mm512_loadu_si512(w + 64), B = _mm512_loadu_si512(w + 128), C = _mm512_loadu_si512(w + 192);
    const __m512i sc03 = _mm512_and_si512(A, low6), mn03 = _mm512_and_si512(B, low6);
    const __m512i sc47 = _mm512_or_si512(_mm512_and_si512(C, low4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(A, 6), two), 4));
    const __m512i mn47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 4), low4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(B, 6), two), 4));
    for (int j = 0; j < 4; ++j) {
        sc[j] = _mm512_and_si512(_mm512_srli_epi32(sc03, 8 * j), byte);
        sc[j + 4] = _mm512_and_si512(_mm512_srli_epi32(sc47, 8 * j), byte);
        mn[j] = _mm512_and_si512(_mm512_srli_epi32(mn03, 8 * j), byte);
        mn[j + 4] = _mm512_and_si512(_mm512_srli_epi32(mn47, 8 * j), byte);
    }
}

/* Q4_K: w = d sc_j q - dmin m_j for sub-block j (k4_x16_scales). */
static inline __attribute__((always_inline)) void tile_q4_K_x16(const uint8_t *w, const act_q8_K *a, int64_t a_row,
                                                                int R, int64_t K, float *out) {
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / QK_K; ++i, w += X16 * sizeof(block_q4_K)) {
        __m512i sc[8], mn[8];
        for (int l = 0; l < 4; ++l) prefetch_ahead(w + 64 * l); /* d, dmin and the scales */
        k4_x16_scales(w, sc, mn);
        const __m512 d = f16x16(w), dmin = f16x16(w + 32);
        const uint8_t *qs = w + 256;
        __m512i sum[GGML_TILE_ROWS], mins[GGML_TILE_ROWS];
        for (int r = 0; r < R; ++r) {
            const act_q8_K *x = a + r * a_row + i;
            sum[r] = _mm512_setzero_si512(), mins[r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j)
                mins[r] = _mm512_add_epi32(mins[r], _mm512_mullo_epi32(mn[j], _mm512_set1_epi32(x->bsums[2 * j] + x->bsums[2 * j + 1])));
        }
        for (int g = 0; g < 4; ++g) {
            __m512i s_lo[GGML_TILE_ROWS], s_hi[GGML_TILE_ROWS];
            for (int r = 0; r < R; ++r) s_lo[r] = s_hi[r] = _mm512_setzero_si512();
            for (int c = 0; c < 8; ++c) {
                const __m512i v = _mm512_loadu_si512(qs + 64 * (8 * g + c));
                prefetch_ahead(qs + 64 * (8 * g + c));
                const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int r = 0; r < R; ++r) {
                    const int8_t *x = a[r * a_row + i].qs + 64 * g;
                    s_lo[r] = _mm512_dpbusd_epi32(s_lo[r], lo, codes4(x, 4 * c));
                    s_hi[r] = _mm512_dpbusd_epi32(s_hi[r], hi, codes4(x, 32 + 4 * c));
                }
            }
            for (int r = 0; r < R; ++r)
                sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(_mm512_mullo_epi32(sc[2 * g], s_lo[r]),
                                                                   _mm512_mullo_epi32(sc[2 * g + 1], s_hi[r])));
        }
        for (int r = 0; r < R; ++r) {
            const __m512 xd = _mm512_set1_ps(a[r * a_row + i].d);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(sum[r]), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, xd), _mm512_cvtepi32_ps(mins[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + X16 * r, acc[r]);
}

/* Q6_K: w = d sc_s (q - 32) for sub-block s of 16; q's low 4 bits in ql, high 2 in qh. Weight 4c + u of part p of
 * half h is ql unit (16 h + 8 (p & 1) + c) shifted by 4 (p >= 2), qh unit (8 h + c) shifted by 2 p, which the
 * layout puts side by side (ggml_x16.h); its sub-block is 8 h + 2 p + c / 4 and its activation 128 h + 32 p + 4 c + u. */
static inline __attribute__((always_inline)) void tile_q6_K_x16(const uint8_t *w, const act_q8_K *a, int64_t a_row,
                                                                int R, int64_t K, float *out) {
    const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3);
    __m512 acc[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / QK_K; ++i, w += X16 * sizeof(block_q6_K)) {
        const uint8_t *codes = w + 288;
        for (int l = 0; l < 5; ++l) prefetch_ahead(w + 64 * l); /* d and the scales */
        __m512i sum[GGML_TILE_ROWS];
        for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
            for (int half = 0; half < 2; ++half) { /* c in 0..3, then 4..7: one sub-block per part */
                __m512i s[GGML_TILE_ROWS][4];
                for (int r = 0; r < R; ++r)
                    for (int p = 0; p < 4; ++p) s[r][p] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int c = 4 * half; c < 4 * half + 4; ++c) {
                    const uint8_t *unit = codes + 192 * (8 * h + c);
                    const __m512i l0 = _mm512_loadu_si512(unit), l1 = _mm512_loadu_si512(unit + 64);
                    const __m512i hb = _mm512_loadu_si512(unit + 128);
                    for (int l = 0; l < 3; ++l) prefetch_ahead(unit + 64 * l);
                    __m512i q[4];
                    q[0] = _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_slli_epi16(_mm512_and_si512(hb, low2), 4));
                    q[1] = _mm512_or_si512(_mm512_and_si512(l1, low4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2), low2), 4));
                    q[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), low2), 4));
                    q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 6), low2), 4));
                    for (int r = 0; r < R; ++r) {
                        const int8_t *x = a[r * a_row + i].qs + 128 * h + 4 * c;
                        for (int p = 0; p < 4; ++p) s[r][p] = _mm512_dpbusd_epi32(s[r][p], q[p], codes4(x, 32 * p));
                    }
                }
                for (int p = 0; p < 4; ++p) {
                    const int sb = 8 * h + 2 * p + half;
                    const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 32 + 16 * sb)));
                    for (int r = 0; r < R; ++r) {
                        const __m512i offset = _mm512_set1_epi32(32 * a[r * a_row + i].bsums[sb]);
                        sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(scale, _mm512_sub_epi32(s[r][p], offset)));
                    }
                }
            }
        const __m512 d = f16x16(w);
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[r * a_row + i].d)), _mm512_cvtepi32_ps(sum[r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + X16 * r, acc[r]);
}

#endif /* AVX512F, BW, VNNI */
#endif
