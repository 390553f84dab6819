/* A multi-row tile's attention over its shared keys in a bfloat16 cache with AMX-BF16 tiles
 * (attention.c includes it for paged_attention_bf16).
 *
 * The tile's queries (up to 32; tiles hold MAX_LANES) are the columns of B tiles, so the
 * scores come out transposed, K Q^T: their A tiles are 16 key rows x 32 head-dim elements read
 * straight from the cache (a key row is that operand's row as it lies in memory). Softmax runs
 * down the score rows with the queries as vector lanes, as in shared_phase. The weights, transposed to query rows and rounded to
 * bfloat16, are the A tiles of out = P V, whose B tiles hold the values in pairs of token rows.
 * Keys are taken in chunks of up to AMX_CHUNK; the accumulators carry the online softmax's
 * rescaling from one chunk to the next.
 *
 * Against shared_phase it rounds the scaled queries and the softmax weights to bfloat16 (a
 * relative 2^-9 each, as any bfloat16 attention does); the products and sums are float32.
 */

#ifndef PAGED_ATTENTION_AMX_H
#define PAGED_ATTENTION_AMX_H

#include "bf16_kernels.h"

#ifdef HAVE_AMX

#define AMX_QUERIES 32 /* two B tiles of 16 query columns */
#define AMX_CHUNK 256 /* shared keys scored before their weights meet the values */

/* 16 floats rounded to bfloat16 (to nearest even), each in the low half of a 32-bit lane. */
static inline __m512i bf16_widened(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

/* Rows r[0..16) of a 16 x 16 float32 block become its columns. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Per-thread scratch of amx_shared_phase, grown to the largest head_dim seen and kept for the thread's life. */
struct amx_scratch {
    float scores[AMX_CHUNK * AMX_QUERIES]; /* [key][query] */
    float c[16 * 16];                      /* a C tile read back */
    uint16_t weights[AMX_QUERIES * AMX_CHUNK]; /* [query][key] bfloat16: A tiles of P V */
    uint32_t queries[MAX_HEAD_DIM / 2 * AMX_QUERIES]; /* [D / 32][2][16 pairs][16 queries]: B tiles */
    uint16_t keys[16 * MAX_HEAD_DIM];      /* a partial group of key rows, zero-padded */
    int64_t rows[AMX_CHUNK];               /* the chunk's token rows in the cache */
    uint32_t values[];                     /* [AMX_CHUNK / 32][D / 16][16 pairs][16 columns]: B tiles */
};

static struct amx_scratch *amx_scratch(int D) {
    static __thread struct amx_scratch *scratch;
    static __thread int scratch_d;
    if (scratch_d < D) {
        free(scratch);
        scratch = aligned_alloc(64, sizeof *scratch + (size_t)AMX_CHUNK * D * sizeof(uint16_t));
        scratch_d = scratch == NULL ? 0 : D;
    }
    return scratch;
}

/* The tile's shared keys [0, shared) for Q <= AMX_QUERIES scaled queries q[Q][D]: sets each query's
 * maximum m[Q], sum l[Q] and unnormalized output o[Q][D]. D a multiple of 32. Returns 0, or -3
 * without memory for the scratch (nothing computed). */
static int amx_shared_phase(const float *restrict q, int Q, const uint16_t *restrict k_cache,
                            const uint16_t *restrict v_cache, const int32_t *restrict table, int64_t shared,
                            int64_t block_size, int64_t token_stride, int64_t head_offset, int D,
                            float *restrict m, float *restrict l, float *restrict o) {
    struct amx_scratch *s = amx_scratch(D);
    if (s == NULL) return -3;
    const int halves = (Q + 15) / 16, steps = D / 32, dblocks = D / 16;
    /* B tile (d / 32, h): row i, column j = query 16h + j's elements d, d + 1 (d = 32 (d / 32) + 2i) */
    for (int h = 0; h < halves; ++h)
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = 16 * h + j < Q ? _mm512_loadu_ps(q + (16 * h + j) * D + d0) : _mm512_setzero_ps();
            transpose16(r); /* r[e]: element d0 + e of the 16 queries */
            for (int e = 0; e < 16; e += 2) {
                const int d = d0 + e;
                _mm512_storeu_si512(s->queries + ((d / 32 * 2 + h) * 16 + d % 32 / 2) * 16,
                                    _mm512_or_si512(bf16_widened(r[e]), _mm512_slli_epi32(bf16_widened(r[e + 1]), 16)));
            }
        }
    vf16 mv[2], lv[2];
    for (int h = 0; h < halves; ++h) mv[h] = (vf16){0} - INFINITY, lv[h] = (vf16){0};
    memset(o, 0, sizeof(float) * (size_t)(Q * D));
    amx_configure();
    for (int64_t pos = 0; pos < shared; pos += AMX_CHUNK) {
        const int n = shared - pos < AMX_CHUNK ? (int)(shared - pos) : AMX_CHUNK, padded = (n + 31) / 32 * 32;
        for (int t = 0; t < n; ++t) {
            const int64_t p = pos + t;
            s->rows[t] = ((int64_t)table[p / block_size] * block_size + p % block_size) * token_stride + head_offset;
        }
        /* scores^T: 16 keys at a time */
        for (int t0 = 0; t0 < n; t0 += 16) {
            const int64_t p = pos + t0;
            const uint16_t *k = k_cache + s->rows[t0];
            int64_t stride = token_stride;
            if (t0 + 16 > n || p % block_size + 16 > block_size) { /* rows past the chunk or the block */
                memset(s->keys, 0, sizeof(uint16_t) * 16 * (size_t)D);
                for (int t = t0; t < n && t < t0 + 16; ++t)
                    memcpy(s->keys + (t - t0) * D, k_cache + s->rows[t], sizeof(uint16_t) * (size_t)D);
                k = s->keys;
                stride = D;
            }
            _tile_zero(0);
            _tile_zero(1);
            for (int ks = 0; ks < steps; ++ks) {
                _tile_loadd(2, k + 32 * ks, stride * (int64_t)sizeof(uint16_t));
                _tile_loadd(3, s->queries + (ks * 2) * 256, 64);
                _tile_dpbf16ps(0, 2, 3);
                if (halves > 1) {
                    _tile_loadd(4, s->queries + (ks * 2 + 1) * 256, 64);
                    _tile_dpbf16ps(1, 2, 4);
                }
            }
            _tile_stored(0, s->scores + t0 * AMX_QUERIES, AMX_QUERIES * sizeof(float));
            if (halves > 1) _tile_stored(1, s->scores + t0 * AMX_QUERIES + 16, AMX_QUERIES * sizeof(float));
        }
        /* online softmax down the keys, the queries as lanes */
        float correction[AMX_QUERIES];
        for (int h = 0; h < halves; ++h) {
            const float *sh = s->scores + 16 * h;
            __m512 chunk_max = _mm512_loadu_ps(sh);
            for (int t = 1; t < n; ++t) chunk_max = _mm512_max_ps(chunk_max, _mm512_loadu_ps(sh + t * AMX_QUERIES));
            const vf16 new_max = (vf16)_mm512_max_ps(chunk_max, (__m512)mv[h]);
            const vf16 c = vexp16(mv[h] - new_max); /* 0 while m is -inf */
            vf16 sum = {0};
            for (int t = 0; t < n; ++t) {
                float *st = s->scores + t * AMX_QUERIES + 16 * h;
                const vf16 p = vexp16((vf16)_mm512_loadu_ps(st) - new_max);
                _mm512_storeu_ps(st, (__m512)p);
                sum += p;
            }
            _mm512_storeu_ps(correction + 16 * h, (__m512)c);
            lv[h] = lv[h] * c + sum;
            mv[h] = new_max;
        }
        /* the weights as query rows of bfloat16, zero past the chunk's keys */
        for (int h = 0; h < halves; ++h)
            for (int t0 = 0; t0 < padded; t0 += 16) {
                __m512 r[16];
                for (int i = 0; i < 16; ++i)
                    r[i] = t0 + i < n ? _mm512_loadu_ps(s->scores + (t0 + i) * AMX_QUERIES + 16 * h)
                                      : _mm512_setzero_ps();
                transpose16(r);
                for (int i = 0; i < 16; ++i)
                    _mm256_storeu_si256((__m256i *)(s->weights + (16 * h + i) * AMX_CHUNK + t0),
                                        (__m256i)_mm512_cvtneps_pbh(r[i]));
            }
        /* the values in pairs of token rows: B tile (group of 32 keys, 16 columns), zero past the chunk */
        for (int t = 0; t < padded; t += 2) {
            const uint16_t *v0 = t < n ? v_cache + s->rows[t] : NULL, *v1 = t + 1 < n ? v_cache + s->rows[t + 1] : NULL;
            for (int b = 0; b < dblocks; ++b) {
                const __m512i even = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + 16 * b)))
                                        : _mm512_setzero_si512();
                const __m512i odd = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + 16 * b)))
                                       : _mm512_setzero_si512();
                _mm512_storeu_si512(s->values + (((t / 32) * dblocks + b) * 16 + (t % 32) / 2) * 16,
                                    _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
            }
        }
        /* out = out * correction + P V, four column blocks (C tiles 0-3) at a time */
        for (int h = 0; h < halves; ++h) {
            const int rows = Q - 16 * h < 16 ? Q - 16 * h : 16;
            for (int b0 = 0; b0 < dblocks; b0 += 4) {
                const int nb = dblocks - b0 < 4 ? dblocks - b0 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int g = 0; g < padded / 32; ++g) {
                    _tile_loadd(4, s->weights + 16 * h * AMX_CHUNK + 32 * g, AMX_CHUNK * sizeof(uint16_t));
                    const uint32_t *vb = s->values + (g * dblocks + b0) * 256;
                    _tile_loadd(5, vb, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nb > 1) {
                        _tile_loadd(6, vb + 256, 64);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (nb > 2) {
                        _tile_loadd(7, vb + 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                    if (nb > 3) {
                        _tile_loadd(5, vb + 768, 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                for (int b = 0; b < nb; ++b) {
                    switch (b) { /* tile registers are immediates */
                    case 0: _tile_stored(0, s->c, 64); break;
                    case 1: _tile_stored(1, s->c, 64); break;
                    case 2: _tile_stored(2, s->c, 64); break;
                    default: _tile_stored(3, s->c, 64);
                    }
                    for (int i = 0; i < rows; ++i) {
                        float *oi = o + (16 * h + i) * D + 16 * (b0 + b);
                        _mm512_storeu_ps(oi, _mm512_fmadd_ps(_mm512_loadu_ps(oi),
                                                             _mm512_set1_ps(correction[16 * h + i]),
                                                             _mm512_loadu_ps(s->c + 16 * i)));
                    }
                }
            }
        }
    }
    _tile_release();
    for (int j = 0; j < Q; ++j) m[j] = ((const float *)mv)[j], l[j] = ((const float *)lv)[j];
    return 0;
}

#endif /* HAVE_AMX */
#endif
