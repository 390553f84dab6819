/* Bidirectional attention of an encoder's packed variable-length batch (BERT, XLM-RoBERTa): every token of a
 * sequence attends over every token of that sequence, none of another; no cache, no mask, no padding.
 *
 * q, k, v are [T, H, D] rows (a fused QKV projection's views: any row stride, heads side by side), the
 * sequences laid end to end at cu_seqlens; out is [T, H * D] rows. A work item is one sequence, one head and
 * a block of its queries (blocks split a sequence only where there are too few sequences x heads to keep the
 * threads busy); it lays the head's keys out once for the block, then for each tile of TILE_ROWS queries
 * scores every key, takes the softmax of the whole row (no online rescaling: a row is at most a few thousand
 * keys) and multiplies by the values.
 *
 * Paths (encoder_attention_bf16_path):
 *   - widened: float32 vectors (GCC's generic 16-lane type, one AVX-512 register or two AVX ones); bfloat16
 *     inputs are widened (exactly) to float32 first and the output rounded to nearest even;
 *   - avx512-bf16: bfloat16 inputs multiplied by VDPBF16PS, two products a lane: keys laid out in pairs of
 *     head-dim elements (16 keys a vector), values in pairs of keys (16 head-dim elements a vector); the
 *     softmax weights rounded to bfloat16 (a relative 2^-9, as any bfloat16 attention does); the sums float32.
 *     Needs D a multiple of 32.
 */

#include <omp.h>
#include <stdlib.h>

#include "bf16_kernels.h"
#include "vec.h"

#ifdef __AVX512F__
#define TILE_ROWS 8 /* queries a tile: 8 x 2 vector accumulators */
#define KEY_VECS 2  /* key vectors (16 keys each) a score block */
#else
#define TILE_ROWS 4 /* 4 x 1 accumulators, each two AVX registers */
#define KEY_VECS 1
#endif
#define KEY_BLOCK (16 * KEY_VECS)
#define MAX_ENCODER_HEAD_DIM 256

/* The paths of bfloat16 inputs, and as a cap the machine's choice between them (ENCODER_AUTO). */
enum { ENCODER_WIDENED = 0, ENCODER_DOT = 1, ENCODER_AUTO = 2 };
static int encoder_limit = ENCODER_AUTO;

/* Caps the path of bfloat16 inputs at `limit` (an ENCODER_ value): tests, PAGED_BF16_ENCODER_ATTENTION. */
void encoder_attention_bf16_limit(int limit) { encoder_limit = limit; }

/* The path bfloat16 inputs of head_dim D take on this build and CPU: the dot products where the CPU has them
 * and D is a multiple of 32, if the cap names them or (uncapped) they out-run the widened FMAs
 * (dot_outruns_fma). */
int encoder_attention_bf16_path(int64_t D) {
#ifdef __AVX512BF16__
    if (D % 32 == 0 && (encoder_limit == ENCODER_DOT || (encoder_limit == ENCODER_AUTO && dot_outruns_fma())))
        return ENCODER_DOT;
#endif
    (void)D;
    return ENCODER_WIDENED;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* ---------------------------------------------------------------------------------------------------------
 * float32 core: keys transposed (kt [D][Lp], zero past L), values as rows of v (ld v_ld).
 */

static inline vf16 max16(vf16 a, vf16 b) {
    const vi16 gt = a > b;
    return (vf16)(((vi16)a & gt) | ((vi16)b & ~gt));
}

/* x with its lanes from `valid` on (keys past the input's end) set to -inf. */
static inline vf16 keys_before(vf16 x, int64_t valid) {
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vi16 in = lane < (int32_t)(valid < 16 ? valid : 16);
    return (vf16)(((vi16)x & in) | ((vi16)((vf16){0} - INFINITY) & ~in));
}

/* Scaled scores x of keys j .. j + 15 into row r of s, and into r's running maximum m over the first L keys. */
static inline void put_scores(vf16 x, float *restrict row, int64_t j, int64_t L, vf16 *restrict m) {
    *(vf16 *)(row + j) = x;
    *m = max16(*m, j + 16 <= L ? x : keys_before(x, L - j));
}

static inline float max_lane(vf16 m) {
    float mx = m[0];
    for (int i = 1; i < 16; ++i) mx = m[i] > mx ? m[i] : mx;
    return mx;
}

/* Row r of s [TILE_ROWS][Lp]: the scaled scores of the tile's queries qt [TILE_ROWS][D] against every key; mx[r]
 * the row's maximum over the first L keys. */
static inline void f32_scores(const float *restrict qt, const float *restrict kt, int64_t Lp, int64_t L, int D,
                              float scale, float *restrict s, float *restrict mx) {
    vf16 m[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) m[r] = (vf16){0} - INFINITY;
    for (int64_t j = 0; j < Lp; j += KEY_BLOCK) {
        vf16 a[TILE_ROWS][KEY_VECS];
        for (int r = 0; r < TILE_ROWS; ++r)
            for (int c = 0; c < KEY_VECS; ++c) a[r][c] = (vf16){0};
        for (int d = 0; d < D; ++d) {
            vf16 kv[KEY_VECS];
            for (int c = 0; c < KEY_VECS; ++c) kv[c] = *(const vf16 *)(kt + d * Lp + j + 16 * c);
            for (int r = 0; r < TILE_ROWS; ++r) {
                const float x = qt[r * D + d];
                for (int c = 0; c < KEY_VECS; ++c) a[r][c] += x * kv[c];
            }
        }
        for (int r = 0; r < TILE_ROWS; ++r)
            for (int c = 0; c < KEY_VECS; ++c) *(vf16 *)(s + r * Lp + j + 16 * c) = a[r][c] * scale;
    }
    /* NOTE: the maxima in a pass of their own: kept beside the accumulators above they spill (0.87x) */
    for (int r = 0; r < TILE_ROWS; ++r) {
        for (int64_t j = 0; j < Lp; j += 16) {
            const vf16 x = *(const vf16 *)(s + r * Lp + j);
            m[r] = max16(m[r], j + 16 <= L ? x : keys_before(x, L - j));
        }
        mx[r] = max_lane(m[r]);
    }
}

/* exp(x) for x <= 0 (vexp16's contract: exactly 0 below -30 and for -inf), with AVX-512's scalef where there. */
static inline vf16 exp16(vf16 x) {
#ifdef __AVX512F__
    const __m512 lo = _mm512_set1_ps(-30.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, lo, _CMP_GE_OQ);
    const __m512 y = _mm512_max_ps((__m512)x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), y);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r); /* ln2 split in two, as vexp */
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return (vf16)_mm512_maskz_scalef_ps(keep, p, n);
#else
    return vexp16(x);
#endif
}

/* Weights of row `row` (scaled scores; keys from L on ignored) against its maximum mx: exp, into `row` itself
 * (0 past L); returns 1 / their sum. */
static inline float f32_weights(float *restrict row, int64_t L, int64_t Lp, float mx) {
    vf16 sum = (vf16){0};
    for (int64_t j = 0; j < Lp; j += 16) {
        vf16 x = *(vf16 *)(row + j) - mx;
        if (j + 16 > L) x = keys_before(x, L - j);
        const vf16 p = exp16(x);
        *(vf16 *)(row + j) = p;
        sum += p;
    }
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += sum[i];
    return 1.0f / total;
}

/* o [TILE_ROWS][D] = the weights p [TILE_ROWS][Lp] (first L keys) times the value rows v, scaled by inv. */
static inline void f32_values(const float *restrict p, int64_t Lp, int64_t L, const float *restrict v,
                              int64_t v_ld, int D, const float *restrict inv, float *restrict o) {
    for (int d0 = 0; d0 < D; d0 += 16 * KEY_VECS) {
        const int nv = D - d0 >= 16 * KEY_VECS ? KEY_VECS : (D - d0) / 16;
        vf16 a[TILE_ROWS][KEY_VECS];
        for (int r = 0; r < TILE_ROWS; ++r)
            for (int c = 0; c < KEY_VECS; ++c) a[r][c] = (vf16){0};
        if (nv == KEY_VECS) {
            for (int64_t j = 0; j < L; ++j) {
                vf16 vv[KEY_VECS];
                for (int c = 0; c < KEY_VECS; ++c) memcpy(&vv[c], v + j * v_ld + d0 + 16 * c, sizeof(vf16));
                for (int r = 0; r < TILE_ROWS; ++r) {
                    const float w = p[r * Lp + j];
                    for (int c = 0; c < KEY_VECS; ++c) a[r][c] += w * vv[c];
                }
            }
        } else { /* one vector left (D an odd multiple of 16 with two vectors a block) */
            for (int64_t j = 0; j < L; ++j) {
                vf16 vv;
                memcpy(&vv, v + j * v_ld + d0, sizeof(vf16));
                for (int r = 0; r < TILE_ROWS; ++r) a[r][0] += p[r * Lp + j] * vv;
            }
        }
        for (int r = 0; r < TILE_ROWS; ++r)
            for (int c = 0; c < nv; ++c) *(vf16 *)(o + r * D + d0 + 16 * c) = a[r][c] * inv[r];
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * AVX512-BF16 core: kp [Lp / 16][D / 2][16] pairs of head-dim elements of 16 keys; vp [Lp / 2][D] pairs of
 * keys' values; queries and weights as bfloat16 rows (read as pairs).
 */
#ifdef __AVX512BF16__
static inline void dot_scores(const uint16_t *restrict qb, const uint32_t *restrict kp, int64_t Lp, int64_t L,
                              int D, float scale, float *restrict s, float *restrict mx) {
    const int P = D / 2;
    vf16 m[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) m[r] = (vf16){0} - INFINITY;
    const uint32_t *restrict qp = (const uint32_t *)qb; /* [TILE_ROWS][P] */
    for (int64_t j = 0; j < Lp; j += 32) {
        __m512 a[TILE_ROWS][2];
        for (int r = 0; r < TILE_ROWS; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        const uint32_t *restrict k0 = kp + (j / 16) * P * 16, *restrict k1 = k0 + P * 16;
        for (int i = 0; i < P; ++i) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512(k0 + i * 16);
            const __m512bh x1 = (__m512bh)_mm512_load_si512(k1 + i * 16);
            for (int r = 0; r < TILE_ROWS; ++r) {
                const __m512bh y = (__m512bh)_mm512_set1_epi32((int)qp[r * P + i]);
                a[r][0] = _mm512_dpbf16_ps(a[r][0], x0, y);
                a[r][1] = _mm512_dpbf16_ps(a[r][1], x1, y);
            }
        }
        for (int r = 0; r < TILE_ROWS; ++r) {
            put_scores((vf16)a[r][0] * scale, s + r * Lp, j, L, &m[r]);
            put_scores((vf16)a[r][1] * scale, s + r * Lp, j + 16, L, &m[r]);
        }
    }
    for (int r = 0; r < TILE_ROWS; ++r) mx[r] = max_lane(m[r]);
}

/* f32_weights rounded to bfloat16 into pb (0 past L); returns 1 / the sum of the unrounded weights. */
static inline float dot_weights(const float *restrict row, int64_t L, int64_t Lp, float mx, uint16_t *restrict pb) {
    vf16 sum = (vf16){0};
    for (int64_t j = 0; j < Lp; j += 16) {
        vf16 x = *(const vf16 *)(row + j) - mx;
        if (j + 16 > L) x = keys_before(x, L - j);
        const vf16 p = exp16(x);
        _mm256_store_si256((__m256i *)(pb + j), (__m256i)_mm512_cvtneps_pbh((__m512)p));
        sum += p;
    }
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += sum[i];
    return 1.0f / total;
}

/* o rows (bfloat16, ld o_ld, the first `rows`) = weights pb [TILE_ROWS][Lp] (bfloat16) x values vp, times inv. */
static inline void dot_values(const uint16_t *restrict pb, int64_t Lp, const uint32_t *restrict vp, int D,
                              const float *restrict inv, int rows, uint16_t *restrict o, int64_t o_ld) {
    const int64_t pairs = Lp / 2;
    const uint32_t *restrict pp = (const uint32_t *)pb; /* [TILE_ROWS][pairs] */
    for (int d0 = 0; d0 < D; d0 += 32) {
        __m512 a[TILE_ROWS][2];
        for (int r = 0; r < TILE_ROWS; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int64_t u = 0; u < pairs; ++u) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512(vp + u * D + d0);
            const __m512bh x1 = (__m512bh)_mm512_load_si512(vp + u * D + d0 + 16);
            for (int r = 0; r < TILE_ROWS; ++r) {
                const __m512bh y = (__m512bh)_mm512_set1_epi32((int)pp[r * pairs + u]);
                a[r][0] = _mm512_dpbf16_ps(a[r][0], x0, y);
                a[r][1] = _mm512_dpbf16_ps(a[r][1], x1, y);
            }
        }
        for (int r = 0; r < rows; ++r) {
            const __m512 w = _mm512_set1_ps(inv[r]);
            _mm256_storeu_si256((__m256i *)(o + r * o_ld + d0), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a[r][0], w)));
            _mm256_storeu_si256((__m256i *)(o + r * o_ld + d0 + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a[r][1], w)));
        }
    }
}

/* One work item on the dot path: queries [q0, q1) of a sequence of L tokens, one head. */
static void dot_item(const uint16_t *restrict q, int64_t q_ld, const uint16_t *restrict k, int64_t k_ld,
                     const uint16_t *restrict v, int64_t v_ld, int64_t L, int64_t q0, int64_t q1, int D, float scale,
                     uint16_t *restrict out, int64_t o_ld, uint32_t *restrict kp, uint32_t *restrict vp,
                     float *restrict s, uint16_t *restrict pb, uint16_t *restrict qb) {
    const int P = D / 2;
    const int64_t Lp = round_up(L, 32);
    for (int64_t j = 0; j < Lp; ++j) { /* keys: pairs of head-dim elements, 16 keys a vector */
        uint32_t *restrict dst = kp + (j / 16) * P * 16 + j % 16;
        if (j < L) {
            const uint32_t *restrict src = (const uint32_t *)(k + j * k_ld);
            for (int i = 0; i < P; ++i) dst[i * 16] = src[i];
        } else {
            for (int i = 0; i < P; ++i) dst[i * 16] = 0;
        }
    }
    for (int64_t u = 0; u < Lp / 2; ++u) /* values: pairs of keys, zero past L */
        for (int d = 0; d < D; d += 32) {
            const int64_t j = 2 * u;
            const __m512i a = j < L ? _mm512_loadu_si512(v + j * v_ld + d) : _mm512_setzero_si512();
            const __m512i b = j + 1 < L ? _mm512_loadu_si512(v + (j + 1) * v_ld + d) : _mm512_setzero_si512();
            _mm512_store_si512(vp + u * D + d, interleave_words(a, b, 0));
            _mm512_store_si512(vp + u * D + d + 16, interleave_words(a, b, 16));
        }
    float inv[TILE_ROWS], mx[TILE_ROWS];
    for (int64_t t = q0; t < q1; t += TILE_ROWS) {
        const int rows = q1 - t < TILE_ROWS ? (int)(q1 - t) : TILE_ROWS;
        for (int r = 0; r < TILE_ROWS; ++r) {
            if (r < rows)
                memcpy(qb + r * D, q + (t + r) * q_ld, D * sizeof *qb);
            else
                memset(qb + r * D, 0, D * sizeof *qb);
        }
        dot_scores(qb, kp, Lp, L, D, scale, s, mx);
        for (int r = 0; r < TILE_ROWS; ++r) inv[r] = dot_weights(s + r * Lp, L, Lp, mx[r], pb + r * Lp);
        dot_values(pb, Lp, vp, D, inv, rows, out + t * o_ld, o_ld);
    }
}
#endif

/* One work item on the widened path: as dot_item; bfloat16 inputs (bf16 set) widened into kt, vw and qt. */
static void widened_item(const void *q, int64_t q_ld, const void *k, int64_t k_ld, const void *v, int64_t v_ld,
                         int bf16, int64_t L, int64_t q0, int64_t q1, int D, float scale, void *out, int64_t o_ld,
                         float *restrict kt, float *restrict vw, float *restrict s, float *restrict qt,
                         float *restrict ot) {
    const int64_t Lp = round_up(L, KEY_BLOCK);
    for (int64_t j = 0; j < Lp; ++j)
        for (int d = 0; d < D; ++d)
            kt[d * Lp + j] = j >= L ? 0.0f
                             : bf16 ? bf16_to_f32(((const uint16_t *)k)[j * k_ld + d])
                                    : ((const float *)k)[j * k_ld + d];
    const float *restrict vr = v;
    int64_t vr_ld = v_ld;
    if (bf16) {
        for (int64_t j = 0; j < L; ++j)
            for (int d = 0; d < D; ++d) vw[j * D + d] = bf16_to_f32(((const uint16_t *)v)[j * v_ld + d]);
        vr = vw, vr_ld = D;
    }
    float inv[TILE_ROWS], mx[TILE_ROWS];
    for (int64_t t = q0; t < q1; t += TILE_ROWS) {
        const int rows = q1 - t < TILE_ROWS ? (int)(q1 - t) : TILE_ROWS;
        for (int r = 0; r < TILE_ROWS; ++r)
            for (int d = 0; d < D; ++d)
                qt[r * D + d] = r >= rows ? 0.0f
                                : bf16    ? bf16_to_f32(((const uint16_t *)q)[(t + r) * q_ld + d])
                                          : ((const float *)q)[(t + r) * q_ld + d];
        f32_scores(qt, kt, Lp, L, D, scale, s, mx);
        for (int r = 0; r < TILE_ROWS; ++r) inv[r] = f32_weights(s + r * Lp, L, Lp, mx[r]);
        f32_values(s, Lp, L, vr, vr_ld, D, inv, ot);
        for (int r = 0; r < rows; ++r)
            for (int d = 0; d < D; ++d) {
                if (bf16)
                    ((uint16_t *)out)[(t + r) * o_ld + d] = f32_to_bf16(ot[r * D + d]);
                else
                    ((float *)out)[(t + r) * o_ld + d] = ot[r * D + d];
            }
    }
}

/* Both dtypes' entry: element size esize (4 float32, 2 bfloat16). Returns 0; -1 for a head_dim that is not a
 * multiple of 16 or over MAX_ENCODER_HEAD_DIM, or cu_seqlens that decrease; -3 when scratch cannot be had. */
static int encoder_attention(const void *q, int64_t q_row, const void *k, int64_t k_row, const void *v,
                             int64_t v_row, const int64_t *cu_seqlens, int64_t num_seqs, int64_t H, int64_t D,
                             float scale, void *out, int64_t out_row, int bf16) {
    if (D <= 0 || D % 16 || D > MAX_ENCODER_HEAD_DIM || num_seqs < 0) return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t L = cu_seqlens[b + 1] - cu_seqlens[b];
        if (L < 0) return -1;
        max_len = L > max_len ? L : max_len;
    }
    if (max_len == 0) return 0;
    const int path = bf16 ? encoder_attention_bf16_path(D) : ENCODER_WIDENED;
    const int threads = omp_get_max_threads();
    /* items: (sequence, head, first query, end); a sequence's queries split in blocks only where sequences x
     * heads are fewer than twice the threads */
    const int64_t split_max = (2 * threads + num_seqs * H - 1) / (num_seqs * H);
    int64_t num_items = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t L = cu_seqlens[b + 1] - cu_seqlens[b], tiles = (L + TILE_ROWS - 1) / TILE_ROWS;
        num_items += H * (tiles < split_max ? tiles : split_max);
    }
    int64_t *items = malloc(sizeof(int64_t) * 4 * (size_t)(num_items ? num_items : 1));
    if (!items) return -3;
    int64_t n = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t L = cu_seqlens[b + 1] - cu_seqlens[b], tiles = (L + TILE_ROWS - 1) / TILE_ROWS;
        if (L == 0) continue;
        const int64_t splits = tiles < split_max ? tiles : split_max;
        const int64_t block = (tiles + splits - 1) / splits * TILE_ROWS;
        for (int64_t h = 0; h < H; ++h)
            for (int64_t q0 = 0; q0 < L; q0 += block) {
                items[4 * n] = b, items[4 * n + 1] = h, items[4 * n + 2] = q0;
                items[4 * n + 3] = q0 + block < L ? q0 + block : L;
                ++n;
            }
    }
    const int64_t Lp = round_up(max_len, 32), es = bf16 ? 2 : 4;
    /* per thread: keys (float32 transposed or bfloat16 pairs), values (widened or pairs), scores, weights, a
     * tile's queries and outputs */
    const size_t scratch = sizeof(float) * (size_t)(2 * Lp * D + TILE_ROWS * Lp + TILE_ROWS * Lp + 2 * TILE_ROWS * D);
    int failed = 0;
#pragma omp parallel if (n > 1 && (int64_t)cu_seqlens[num_seqs] * H * D >= PARALLEL_MIN)
    {
        float *buf = aligned_alloc(64, round_up((int64_t)scratch, 64));
        if (!buf) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        float *kt = buf, *vw = kt + Lp * D, *s = vw + Lp * D, *pw = s + TILE_ROWS * Lp, *qt = pw + TILE_ROWS * Lp,
              *ot = qt + TILE_ROWS * D;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            if (!buf) continue;
            const int64_t b = items[4 * i], h = items[4 * i + 1], first = cu_seqlens[b];
            const int64_t L = cu_seqlens[b + 1] - first, q0 = items[4 * i + 2], q1 = items[4 * i + 3];
            const char *qs = (const char *)q + (first * q_row + h * D) * es;
            const char *ks = (const char *)k + (first * k_row + h * D) * es;
            const char *vs_ = (const char *)v + (first * v_row + h * D) * es;
            char *os = (char *)out + (first * out_row + h * D) * es;
#ifdef __AVX512BF16__
            if (path == ENCODER_DOT) {
                dot_item((const uint16_t *)qs, q_row, (const uint16_t *)ks, k_row, (const uint16_t *)vs_, v_row, L, q0,
                         q1, (int)D, scale, (uint16_t *)os, out_row, (uint32_t *)kt, (uint32_t *)vw, s,
                         (uint16_t *)pw, (uint16_t *)qt);
                continue;
            }
#endif
            (void)path;
            widened_item(qs, q_row, ks, k_row, vs_, v_row, bf16, L, q0, q1, (int)D, scale, os, out_row, kt, vw, s,
                         qt, ot);
        }
        free(buf);
    }
    free(items);
    return failed ? -3 : 0;
}

#define ENCODER_ATTENTION_ARGS(t)                                                                                  \
    const t *q, int64_t q_row, const t *k, int64_t k_row, const t *v, int64_t v_row, const int64_t *cu_seqlens, \
        int64_t num_seqs, int64_t num_heads, int64_t head_dim, float scale, t *out, int64_t out_row

int encoder_attention_f32(ENCODER_ATTENTION_ARGS(float)) {
    return encoder_attention(q, q_row, k, k_row, v, v_row, cu_seqlens, num_seqs, num_heads, head_dim, scale, out,
                             out_row, 0);
}

int encoder_attention_bf16(ENCODER_ATTENTION_ARGS(uint16_t)) {
    return encoder_attention(q, q_row, k, k_row, v, v_row, cu_seqlens, num_seqs, num_heads, head_dim, scale, out,
                             out_row, 1);
}
