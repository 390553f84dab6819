/* A multi-row tile's attention over its shared keys in a bfloat16 cache with AVX512-BF16
 * (attention.c includes it for paged_attention_bf16): shared_phase with VDPBF16PS in its loops.
 *
 * Each VDPBF16PS adds two products to every lane. The scores pair head-dim elements: a key's
 * elements d, d + 1, broadcast from the cache, against the tile's scaled queries rounded to
 * bfloat16 pairs (lane i: query i's elements d, d + 1). The values pair keys: the softmax
 * weights of keys t, t + 1 rounded to bfloat16 pairs, against the two keys' value elements
 * side by side, interleaved into a scratch once a chunk. A chunk spans blocks (DOT_CHUNK
 * keys), so each output accumulator is loaded, rescaled and stored once for many keys. The
 * online softmax and the carried state are shared_phase's, so the rows go on over their own
 * keys as after it. Against shared_phase, half the multiply-adds and none of its widening
 * splits (splat2).
 *
 * It rounds the scaled queries and the softmax weights to bfloat16 (a relative 2^-9 each, as
 * the AMX path and any bfloat16 attention do); the sums are float32.
 */

#ifndef PAGED_ATTENTION_DOT_H
#define PAGED_ATTENTION_DOT_H

#include "bf16_kernels.h" /* interleave_words */

#define DOT_KEYS 8   /* keys scored together: 8 x 3 accumulators */
#define DOT_DIMS 8   /* head-dim elements of the output accumulated together */
#define DOT_CHUNK 64 /* keys a chunk: scored, weighted and multiplied by their values together */

/* Lane i holds (lo[i], hi[i]) rounded to bfloat16 (to nearest even), lo in the low half. */
static inline __m512bh pair_lanes(__m512 lo, __m512 hi) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_loadu_si512(order), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Scores s[u * QV + j] of the keys at k_cache + rows[u], u < KEYS, against the query pairs qp, for KEYS and QV
 * constant. */
static inline __attribute__((always_inline)) void dot_scores(const __m512bh *restrict qp, const int QV,
                                                             const uint16_t *restrict k_cache,
                                                             const int64_t *restrict rows, const int KEYS, const int D,
                                                             vs *restrict s) {
    __m512 a[DOT_KEYS][MAX_LANE_VECTORS];
    for (int u = 0; u < KEYS; ++u)
        for (int j = 0; j < QV; ++j) a[u][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2)
        for (int u = 0; u < KEYS; ++u) {
            uint32_t pair;
            memcpy(&pair, k_cache + rows[u] + d, sizeof pair);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < QV; ++j) a[u][j] = _mm512_dpbf16_ps(a[u][j], kb, qp[d / 2 * QV + j]);
        }
    for (int u = 0; u < KEYS; ++u)
        for (int j = 0; j < QV; ++j) s[u * QV + j] = (vs)a[u][j];
}

/* shared_phase with `dot`: its arguments and state, the queries qt as it takes them; D a multiple of 32. */
static inline __attribute__((always_inline)) void dot_shared_phase(const vs *restrict qt, const int QV,
                                                                   const uint16_t *restrict k_cache,
                                                                   const uint16_t *restrict v_cache,
                                                                   const int32_t *restrict table, int64_t shared,
                                                                   int64_t block_size, int64_t token_stride,
                                                                   int64_t head_offset, const int D, vs *restrict m,
                                                                   vs *restrict l, vs *restrict ot) {
    __m512bh qp[MAX_HEAD_DIM / 2 * MAX_LANE_VECTORS];
    for (int d = 0; d < D; d += 2)
        for (int j = 0; j < QV; ++j)
            qp[d / 2 * QV + j] = pair_lanes((__m512)qt[d * QV + j], (__m512)qt[(d + 1) * QV + j]);
    vs s[DOT_CHUNK * MAX_LANE_VECTORS];
    int64_t rows[DOT_CHUNK]; /* the chunk's token rows in the cache, at this head */
    uint32_t vp[DOT_CHUNK / 2][MAX_HEAD_DIM] __attribute__((aligned(64))); /* [pair][d]: values of keys 2p, 2p + 1 */
    __m512bh pp[DOT_CHUNK / 2 * MAX_LANE_VECTORS];                         /* [pair][j]: their weights */
    for (int64_t pos = 0; pos < shared;) {
        const int n = shared - pos < DOT_CHUNK ? (int)(shared - pos) : DOT_CHUNK, pairs = (n + 1) / 2;
        for (int t = 0; t < n;) { /* one table lookup and division a block, not a key */
            const int run = (int)chunk_len(pos + t, shared, block_size, n - t);
            const int64_t first = chunk_base(table, pos + t, block_size, token_stride) + head_offset;
            for (int u = 0; u < run; ++u) rows[t + u] = first + u * token_stride;
            t += run;
        }
        int t = 0;
        for (; t + DOT_KEYS <= n; t += DOT_KEYS) {
            for (int u = 0; u < DOT_KEYS; ++u) {
                prefetch_row(v_cache + rows[t + u], D); /* ahead of the values */
                if (t + DOT_KEYS + u < n) prefetch_row(k_cache + rows[t + DOT_KEYS + u], D); /* the next keys */
            }
            dot_scores(qp, QV, k_cache, rows + t, DOT_KEYS, D, s + t * QV);
        }
        for (; t < n; ++t) dot_scores(qp, QV, k_cache, rows + t, 1, D, s + t * QV);
        vs correction[MAX_LANE_VECTORS];
        softmax_chunk(s, n, QV, m, l, correction);
        for (int p = 0; p < pairs; ++p) {
            const int u = 2 * p, odd = u + 1 < n; /* else the pair's second key is zero, past the chunk */
            const uint16_t *restrict v0 = v_cache + rows[u], *restrict v1 = odd ? v_cache + rows[u + 1] : NULL;
            for (int c = 0; c < D; c += 32) {
                const __m512i a = _mm512_loadu_si512(v0 + c);
                const __m512i b = odd ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
                _mm512_store_si512(vp[p] + c, interleave_words(a, b, 0));
                _mm512_store_si512(vp[p] + c + 16, interleave_words(a, b, 16));
            }
            for (int j = 0; j < QV; ++j)
                pp[p * QV + j] =
                    pair_lanes((__m512)s[u * QV + j], odd ? (__m512)s[(u + 1) * QV + j] : _mm512_setzero_ps());
        }
        for (int d0 = 0; d0 < D; d0 += DOT_DIMS) {
            __m512 a[DOT_DIMS][MAX_LANE_VECTORS];
            for (int e = 0; e < DOT_DIMS; ++e)
                for (int j = 0; j < QV; ++j) a[e][j] = (__m512)(ot[(d0 + e) * QV + j] * correction[j]);
            for (int p = 0; p < pairs; ++p)
                for (int e = 0; e < DOT_DIMS; ++e) {
                    const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)vp[p][d0 + e]);
                    for (int j = 0; j < QV; ++j) a[e][j] = _mm512_dpbf16_ps(a[e][j], vb, pp[p * QV + j]);
                }
            for (int e = 0; e < DOT_DIMS; ++e)
                for (int j = 0; j < QV; ++j) ot[(d0 + e) * QV + j] = (vs)a[e][j];
        }
        pos += n;
    }
}

#endif
