/* The GGUF types' dot products on AVX2: one weight row against R activation rows (R = 1..GGML_TILE_ROWS),
 * the weight's codes unpacked once for all R. Integer products run 32 at a time (VPMADDUBSW: unsigned
 * weight codes times signed activation codes, then VPMADDWD by the sub-block scales or by ones), exact
 * in int32; each block scales its sums in float once per row. The same sums as ggml_generic.h, in
 * another float order (the tests bound both against a float64 reference). */

#ifndef PAGED_GGML_AVX2_H
#define PAGED_GGML_AVX2_H

/* AVX2 with FMA and F16C: every CPU with AVX2 has both, but a -march may turn them off. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGML_AVX2 1

#include <immintrin.h>
#include <math.h>

#include "ggml_blocks.h"

#define GGML_TILE_ROWS 4

static inline float f16_scalar(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* 32 bits as 32 bytes: 0xff where the bit is set (byte i <- bit i). */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

/* 16 bytes of 4-bit codes as 32 bytes: the low nibbles, then the high ones. */
static inline __m256i nibbles_split(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

static inline __m256 sum_pairs_f(__m256i p16) { return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1))); }

/* ------------------------------------------------------------------------- legacy types x act_q8 */

/* Block i of a legacy-type row: its codes as unsigned bytes (Q8_0: their magnitudes, *sign the signed codes
 * for their signs), its d and its offset m (w = d q + m). */
static inline __attribute__((always_inline)) __m256i legacy_block(int type, const uint8_t *w, int64_t i, __m256i *sign,
                                                                  float *d, float *m) {
    switch (type) {
    case GGML_Q8_0: {
        const block_q8_0 *b = (const block_q8_0 *)w + i;
        *sign = _mm256_loadu_si256((const __m256i *)b->qs);
        *d = f16_scalar(b->d), *m = 0.0f;
        return _mm256_sign_epi8(*sign, *sign);
    }
    case GGML_Q4_0: {
        const block_q4_0 *b = (const block_q4_0 *)w + i;
        *d = f16_scalar(b->d), *m = -8.0f * *d;
        return nibbles_split(b->qs);
    }
    case GGML_Q4_1: {
        const block_q4_1 *b = (const block_q4_1 *)w + i;
        *d = f16_scalar(b->d), *m = f16_scalar(b->m);
        return nibbles_split(b->qs);
    }
    case GGML_Q5_0: {
        const block_q5_0 *b = (const block_q5_0 *)w + i;
        uint32_t qh;
        memcpy(&qh, b->qh, 4);
        *d = f16_scalar(b->d), *m = -16.0f * *d;
        return _mm256_or_si256(nibbles_split(b->qs), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16)));
    }
    default: { /* GGML_Q5_1 */
        const block_q5_1 *b = (const block_q5_1 *)w + i;
        uint32_t qh;
        memcpy(&qh, b->qh, 4);
        *d = f16_scalar(b->d), *m = f16_scalar(b->m);
        return _mm256_or_si256(nibbles_split(b->qs), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16)));
    }
    }
}

/* Block i of a legacy row against activation block x: its integer sums (8 lanes) and its scales. */
static inline __attribute__((always_inline)) __m256 legacy_dot(int type, __m256i q, __m256i sign, const act_q8 *x) {
    __m256i xq = _mm256_loadu_si256((const __m256i *)x->qs);
    if (type == GGML_Q8_0) xq = _mm256_sign_epi8(xq, sign);
    return sum_pairs_f(_mm256_maddubs_epi16(q, xq));
}

/* Legacy types: each block's integer sums scaled in float once. Blocks go in pairs to two accumulators, so that a
 * row's chain of FMAs is not one long dependency (every row the same way, whatever R); the accumulators are named
 * per block of the pair (not indexed by the block's parity) so that they stay in registers. */
static inline __attribute__((always_inline)) void tile_q8_avx2(int type, const uint8_t *w, const act_q8 *a,
                                                               int64_t a_row, int R, int64_t K, float *out) {
    const int offset = type != GGML_Q8_0; /* w = d q + m with m != 0 */
    __m256 even[GGML_TILE_ROWS], odd[GGML_TILE_ROWS];
    float off[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps(), off[r] = 0.0f;
    const int64_t nb = K / QK, block = ggml_row_bytes(type, QK);
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        prefetch_ahead(w + i * block), prefetch_ahead(w + (i + 1) * block);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        float d0, m0, d1, m1;
        const __m256i q0 = legacy_block(type, w, i, &s0, &d0, &m0);
        const __m256i q1 = legacy_block(type, w, i + 1, &s1, &d1, &m1);
        for (int r = 0; r < R; ++r) {
            const act_q8 *x = a + r * a_row + i;
            even[r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x[0].d), legacy_dot(type, q0, s0, x), even[r]);
            odd[r] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * x[1].d), legacy_dot(type, q1, s1, x + 1), odd[r]);
            if (offset) off[r] = fmaf(m1, x[1].s, fmaf(m0, x[0].s, off[r])); /* fused whatever R: the same bits */
        }
    }
    if (i < nb) {
        __m256i s0 = _mm256_setzero_si256();
        float d0, m0;
        const __m256i q0 = legacy_block(type, w, i, &s0, &d0, &m0);
        for (int r = 0; r < R; ++r) {
            const act_q8 *x = a + r * a_row + i;
            even[r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x->d), legacy_dot(type, q0, s0, x), even[r]);
            if (offset) off[r] = fmaf(m0, x->s, off[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum8(_mm256_add_ps(even[r], odd[r])) + off[r];
}

/* ------------------------------------------------------------------------ K-quants x act_q8_K */

/* Lanes of 16-bit scales broadcast: scale j of the 8 (Q4_K, Q5_K) to all 16 lanes. */
static inline __m256i broadcast_scale(__m256i scales16, int j) {
    return _mm256_shuffle_epi8(scales16, _mm256_set1_epi16((short)(((2 * j + 1) << 8) | (2 * j))));
}

static inline __attribute__((always_inline)) void tile_k4_avx2(int q5, const uint8_t *w, const act_q8_K *a,
                                                               int64_t a_row, int R, int64_t K, float *out) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 acc[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QK_K; ++i) {
        const block_q4_K *b4 = (const block_q4_K *)w + i;
        const block_q5_K *b5 = (const block_q5_K *)w + i;
        const uint8_t *qs = q5 ? b5->qs : b4->qs;
        for (int l = 0; l < 3; ++l) prefetch_ahead((const uint8_t *)(q5 ? (const void *)b5 : (const void *)b4) + 64 * l);
        uint8_t sc[8], mn[8];
        k4_scales(q5 ? b5->scales : b4->scales, sc, mn);
        const __m128i sc8 = _mm_loadl_epi64((const __m128i *)sc), mn8 = _mm_loadl_epi64((const __m128i *)mn);
        const __m128i sc16 = _mm_cvtepu8_epi16(sc8);
        const __m256i scales = _mm256_set_m128i(sc16, sc16);
        const float d = f16_scalar(q5 ? b5->d : b4->d);
        const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8)),
                                          _mm256_set1_ps(-f16_scalar(q5 ? b5->dmin : b4->dmin)));
        const __m256i hbits = q5 ? _mm256_loadu_si256((const __m256i *)b5->qh) : _mm256_setzero_si256();
        __m256i sum[GGML_TILE_ROWS];
        for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
        for (int g = 0; g < 4; ++g) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if (q5) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * g), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * g + 1), one), 4));
            }
            const __m256i s_lo = broadcast_scale(scales, 2 * g), s_hi = broadcast_scale(scales, 2 * g + 1);
            for (int r = 0; r < R; ++r) {
                const int8_t *x = a[r * a_row + i].qs + 64 * g;
                const __m256i p_lo = _mm256_madd_epi16(s_lo, _mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i *)x)));
                const __m256i p_hi = _mm256_madd_epi16(s_hi, _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i *)(x + 32))));
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        for (int r = 0; r < R; ++r) {
            const act_q8_K *x = a + r * a_row + i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(sum[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(x->dsums), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

static inline __attribute__((always_inline)) void tile_q6_K_avx2(const uint8_t *w, const act_q8_K *a, int64_t a_row,
                                                                 int R, int64_t K, float *out) {
    const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
    __m256 acc[GGML_TILE_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K / QK_K; ++i) {
        const block_q6_K *b = (const block_q6_K *)w + i;
        for (int l = 0; l < 4; ++l) prefetch_ahead((const uint8_t *)b + 64 * l);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales)); /* 16 scales */
        __m256i sum[GGML_TILE_ROWS];
        for (int r = 0; r < R; ++r) /* the codes' offset: -32 sum_s sc_s sum(x of s) */
            sum[r] = _mm256_slli_epi32(
                _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)a[r * a_row + i].bsums)), 5);
        for (int r = 0; r < R; ++r) sum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), sum[r]);
        for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            /* the half's 8 scales in both 128-bit lanes */
            const __m256i half_scales =
                h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int part = 0; part < 4; ++part) {
                const __m256i low = part & 1 ? l1 : l0;
                const __m256i nib = part < 2 ? _mm256_and_si256(low, low4) : _mm256_and_si256(_mm256_srli_epi16(low, 4), low4);
                const __m256i q = _mm256_or_si256(
                    nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * part), low2), 4));
                /* lanes 0-7 (weights 0-15 of the part) take scale 8h + 2 part, lanes 8-15 the next one */
                const __m256i sc_pair = _mm256_shuffle_epi8(
                    half_scales, _mm256_set_m128i(_mm_set1_epi16((short)(((4 * part + 3) << 8) | (4 * part + 2))),
                                                  _mm_set1_epi16((short)(((4 * part + 1) << 8) | (4 * part)))));
                for (int r = 0; r < R; ++r) {
                    const int8_t *x = a[r * a_row + i].qs + 128 * h + 32 * part;
                    sum[r] = _mm256_add_epi32(
                        sum[r], _mm256_madd_epi16(sc_pair, _mm256_maddubs_epi16(q, _mm256_load_si256((const __m256i *)x))));
                }
            }
        }
        const float d = f16_scalar(b->d);
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[r * a_row + i].d), _mm256_cvtepi32_ps(sum[r]), acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}

/* --------------------------------------------------------------------------- float types x float */

static inline __attribute__((always_inline)) __m256 load_weights8(int type, const uint8_t *w, int64_t k) {
    if (type == GGML_F32) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    if (type == GGML_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define FLOAT_TILE_ROWS 2 /* rows of x a float tile: four accumulators each */

/* Float types: 32 features a step in four accumulators a row (FMA latency), at most FLOAT_TILE_ROWS rows. */
static inline __attribute__((always_inline)) void tile_float_avx2(int type, const uint8_t *w, const float *x,
                                                                  int64_t ld_x, int R, int64_t K, float *out) {
    __m256 acc[FLOAT_TILE_ROWS][4];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
        for (int u = 0; u < 4; ++u) {
            const __m256 wv = load_weights8(type, w, k + 8 * u);
            for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * ld_x + k + 8 * u), acc[r][u]);
        }
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = load_weights8(type, w, k);
        for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * ld_x + k), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
        float tail = 0.0f;
        for (int64_t t = k; t < K; ++t) {
            const float wt = type == GGML_F32   ? ((const float *)w)[t]
                             : type == GGML_F16 ? f16_scalar(((const uint16_t *)w)[t])
                                                : bf16_to_f32(((const uint16_t *)w)[t]);
            tail += wt * x[r * ld_x + t];
        }
        out[r] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]))) + tail;
    }
}

#endif /* GGML_AVX2 */
#endif
