/* Paged attention for the CPU: float32 queries over a float32 or bfloat16 KV cache.
 *
 * Each row is one query token attending over its context, read in place from the paged
 * cache (no gather into a contiguous copy): a decode token, or a token of a prefill chunk
 * with its causal context (its position + 1 keys). Rows come in tiles: a tile is one row,
 * or up to 24 / G rows whose tables begin with the same blocks (a shared system prompt,
 * the tokens of one chunk). Work items are (tile, KV head) pairs, split across OpenMP
 * threads in order, a tile's KV heads to one thread where there are tiles for every thread
 * (their elements share the cache's token rows and pages), so tiles that share prefix
 * blocks read them while they are still in cache.
 *
 * A multi-row tile first attends over its shared keys with the tile's R * G queries as
 * the lanes of its vectors (shared_phase): each key and value element is loaded once for
 * all of them and no horizontal sums are needed. Over a bfloat16 cache where the CPU has AMX,
 * the queries are the columns of tiles instead (attention_amx.h). Each row then continues alone
 * over its own keys (attend_range), its G query heads scored together against each key row.
 * Softmax is online per block of the table: running max, running sum, rescaled
 * accumulator, carried from one phase to the next.
 *
 * Built at run time with -O3 -march=native -fopenmp; vectors as in vec.h, so head_dim
 * must be a multiple of 8. This file builds the float32-cache functions; attention_bf16.c
 * includes it with KV_BF16 set for those of a bfloat16 cache, whose elements widen exactly
 * as they load and round to nearest even as they are stored.
 */

#include <omp.h>
#include <stdlib.h>

#include "vec.h"

#ifndef KV_BF16
#define KV_BF16 0
#endif
#if KV_BF16
typedef uint16_t kv_t;
#define KV_LOAD(p) load_bf16(p)
#define KV_FROM_F32(x) f32_to_bf16(x)
#define KV_NAME(name) name##_bf16
#else
typedef float kv_t;
#define KV_LOAD(p) load(p)
#define KV_FROM_F32(x) (x)
#define KV_NAME(name) name##_f32
#endif
#define KV_LINE (64 / (int)sizeof(kv_t)) /* cache elements a 64-byte line holds */

/* Cache elements p[0] and p[1], each broadcast to a vector: for bfloat16 one 32-bit broadcast of
 * the pair, split by a shift and a mask (3 operations where two widened scalars take 8). */
static inline void splat2(const kv_t *p, vf *a, vf *b) {
#if KV_BF16
    uint32_t pair;
    memcpy(&pair, p, sizeof pair);
    const vi v = (vi){0} + (int32_t)pair;
    *a = (vf)(v << 16);
    *b = (vf)(v & ((vi){0} - 65536)); /* 0xffff0000 */
#else
    *a = splat(p[0]);
    *b = splat(p[1]);
#endif
}

/* Fetches the cache lines of one token's head (D elements) ahead of their use. */
static inline __attribute__((always_inline)) void prefetch_row(const kv_t *p, const int D) {
    for (int c = 0; c < D; c += KV_LINE) __builtin_prefetch(p + c);
}

/* Rows [from, to) of the next block's keys or values (next: its first row; an empty range when
 * there is none). A block's passes fetch the next block's row t as they reach their own row t,
 * spread over the work: fetched at once, a block's 64 lines fill the core's miss buffers and stall it. */
static inline __attribute__((always_inline)) void prefetch_rows(const kv_t *next, int64_t from, int64_t to,
                                                                int64_t token_stride, const int D) {
    for (int64_t t = from; t < to; ++t) prefetch_row(next + t * token_stride, D);
}

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256
#define MAX_LANES 24 /* queries of a multi-row tile: three vectors */
#define MAX_LANE_VECTORS (MAX_LANES / VL)

#if KV_BF16
#include "attention_amx.h"
#endif

/* Scores of the G queries at q against n key rows (stride token_stride) into
 * scores[g * MAX_BLOCK_SIZE + t]: four rows at a time, four independent FMA chains. */
static inline __attribute__((always_inline)) void block_scores(const float *restrict q, const kv_t *restrict k,
                                                               int64_t n, int64_t token_stride, int G,
                                                               const int D, const kv_t *next, int64_t next_rows,
                                                               float *restrict scores) {
    prefetch_rows(next, 0, next_rows, token_stride, D);
    for (int g = 0; g < G; ++g) {
        const float *restrict qg = q + g * D;
        float *restrict sg = scores + g * MAX_BLOCK_SIZE;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            const kv_t *k0 = k + t * token_stride, *k1 = k0 + token_stride;
            const kv_t *k2 = k1 + token_stride, *k3 = k2 + token_stride;
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int c = 0; c < D; c += VL) {
                const vf qv = load(qg + c);
                a0 += qv * KV_LOAD(k0 + c);
                a1 += qv * KV_LOAD(k1 + c);
                a2 += qv * KV_LOAD(k2 + c);
                a3 += qv * KV_LOAD(k3 + c);
            }
            hsum4(a0, a1, a2, a3, sg + t);
        }
        for (; t < n; ++t) {
            const kv_t *kt = k + t * token_stride;
            vf a = {0};
            for (int c = 0; c < D; c += VL) a += load(qg + c) * KV_LOAD(kt + c);
            sg[t] = hsum(a);
        }
    }
}

#define FUSED_GROUP 4 /* query heads of a KV head scored and weighted in one pass over each key and value */

/* block_scores for G <= FUSED_GROUP query heads (a constant in the callers) in one pass: each key
 * vector is loaded (and widened) once for all of them. */
static inline __attribute__((always_inline)) void block_scores_fused(const float *restrict q, const kv_t *restrict k,
                                                                     int64_t n, int64_t token_stride, const int G,
                                                                     const int D, const kv_t *next,
                                                                     int64_t next_rows, float *restrict scores) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        prefetch_rows(next, t, t + 4 < next_rows ? t + 4 : next_rows, token_stride, D);
        const kv_t *k0 = k + t * token_stride, *k1 = k0 + token_stride;
        const kv_t *k2 = k1 + token_stride, *k3 = k2 + token_stride;
        vf a[FUSED_GROUP][4] = {{{0}}};
        for (int c = 0; c < D; c += VL) {
            const vf x0 = KV_LOAD(k0 + c), x1 = KV_LOAD(k1 + c), x2 = KV_LOAD(k2 + c), x3 = KV_LOAD(k3 + c);
            for (int g = 0; g < G; ++g) {
                const vf qv = load(q + g * D + c);
                a[g][0] += qv * x0;
                a[g][1] += qv * x1;
                a[g][2] += qv * x2;
                a[g][3] += qv * x3;
            }
        }
        for (int g = 0; g < G; ++g) hsum4(a[g][0], a[g][1], a[g][2], a[g][3], scores + g * MAX_BLOCK_SIZE + t);
    }
    for (; t < n; ++t) {
        const kv_t *kt = k + t * token_stride;
        vf a[FUSED_GROUP] = {{0}};
        for (int c = 0; c < D; c += VL) {
            const vf x = KV_LOAD(kt + c);
            for (int g = 0; g < G; ++g) a[g] += load(q + g * D + c) * x;
        }
        for (int g = 0; g < G; ++g) scores[g * MAX_BLOCK_SIZE + t] = hsum(a[g]);
    }
    prefetch_rows(next, n / 4 * 4, next_rows, token_stride, D);
}

/* Continues the online softmax of the G scaled queries q over context positions
 * [start, end) of one sequence, for the KV head at head_offset: running maxima m[G], sums
 * l[G] and accumulators acc[G * D]. D is a compile-time constant in the callers, so a
 * query head's accumulator lives in registers. */
static inline __attribute__((always_inline)) void attend_range(const float *restrict q, const kv_t *restrict k_cache,
                                                               const kv_t *restrict v_cache,
                                                               const int32_t *restrict table, int64_t start,
                                                               int64_t end, int64_t block_size, int64_t token_stride,
                                                               int64_t head_offset, int G, const int D,
                                                               float *restrict m, float *restrict l,
                                                               float *restrict acc) {
    float scores[MAX_GROUP * MAX_BLOCK_SIZE];
    for (int64_t pos = start; pos < end;) {
        const int64_t offset = pos % block_size;
        const int64_t n = (block_size - offset < end - pos) ? block_size - offset : end - pos;
        const int64_t padded = (n + VL - 1) / VL * VL;
        const int64_t base = ((int64_t)table[pos / block_size] * block_size + offset) * token_stride + head_offset;
        const kv_t *restrict k = k_cache + base;
        const kv_t *restrict v = v_cache + base;
        /* the next block sits anywhere in the cache: fetched while this one computes */
        const kv_t *next_k = NULL, *next_v = NULL;
        const int64_t next_rows = end - pos - n < block_size ? end - pos - n : block_size;
        if (next_rows > 0) {
            const int64_t next = (int64_t)table[(pos + n) / block_size] * block_size * token_stride + head_offset;
            next_k = k_cache + next;
            next_v = v_cache + next;
        }
        if (G <= FUSED_GROUP)
            block_scores_fused(q, k, n, token_stride, G, D, next_k, next_rows, scores);
        else
            block_scores(q, k, n, token_stride, G, D, next_k, next_rows, scores);
        float correction[MAX_GROUP];
        for (int g = 0; g < G; ++g) {
            float *restrict sg = scores + g * MAX_BLOCK_SIZE;
            for (int64_t t = n; t < padded; ++t) sg[t] = -INFINITY; /* exp -> 0 */
            vf vmax = load(sg);
            for (int64_t t = VL; t < padded; t += VL) vmax = vmaxf(vmax, load(sg + t));
            const float block_max = hmax(vmax);
            const float new_max = block_max > m[g] ? block_max : m[g];
            correction[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - new_max);
            vf sum = {0};
            for (int64_t t = 0; t < padded; t += VL) {
                const vf p = vexp(load(sg + t) - new_max);
                store(sg + t, p);
                sum += p;
            }
            l[g] = l[g] * correction[g] + hsum(sum);
            m[g] = new_max;
        }
        if (G <= FUSED_GROUP) { /* each value vector loaded once for every head, four vectors of D at a time */
            for (int c0 = 0; c0 < D / VL; c0 += 4) {
                const int cn = D / VL - c0 < 4 ? D / VL - c0 : 4;
                vf a[FUSED_GROUP][4];
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < cn; ++c) a[g][c] = load(acc + g * D + (c0 + c) * VL) * correction[g];
                for (int64_t t = 0; t < n; ++t) {
                    if (c0 == 0 && t < next_rows) prefetch_row(next_v + t * token_stride, D);
                    const kv_t *restrict vt = v + t * token_stride + c0 * VL;
                    for (int c = 0; c < cn; ++c) {
                        const vf x = KV_LOAD(vt + c * VL);
                        for (int g = 0; g < G; ++g) a[g][c] += splat(scores[g * MAX_BLOCK_SIZE + t]) * x;
                    }
                }
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < cn; ++c) store(acc + g * D + (c0 + c) * VL, a[g][c]);
            }
            prefetch_rows(next_v, n, next_rows, token_stride, D);
        } else {
            prefetch_rows(next_v, 0, next_rows, token_stride, D);
            for (int g = 0; g < G; ++g) {
                const float *restrict sg = scores + g * MAX_BLOCK_SIZE;
                vf a[MAX_HEAD_DIM / VL];
                for (int c = 0; c < D / VL; ++c) a[c] = load(acc + g * D + c * VL) * correction[g];
                for (int64_t t = 0; t < n; ++t) {
                    const vf p = splat(sg[t]);
                    const kv_t *restrict vt = v + t * token_stride;
                    for (int c = 0; c < D / VL; ++c) a[c] += p * KV_LOAD(vt + c * VL);
                }
                for (int c = 0; c < D / VL; ++c) store(acc + g * D + c * VL, a[c]);
            }
        }
        pos += n;
    }
}

/* Attention over the shared keys [0, shared) of one table for Q <= MAX_LANES queries held
 * as vector lanes: qt[d * QV + j] holds element d of the queries of lanes j * VL .. j * VL + 7
 * (scaled; padding lanes 0). Carries per-lane state: maxima m[QV], sums l[QV] and
 * accumulators ot[d * QV + j]. QV and D are compile-time constants in the callers. */
static inline __attribute__((always_inline)) void shared_phase(const vf *restrict qt, const int QV,
                                                               const kv_t *restrict k_cache,
                                                               const kv_t *restrict v_cache,
                                                               const int32_t *restrict table, int64_t shared,
                                                               int64_t block_size, int64_t token_stride,
                                                               int64_t head_offset, const int D, vf *restrict m,
                                                               vf *restrict l, vf *restrict ot) {
    vf s[MAX_BLOCK_SIZE * MAX_LANE_VECTORS];
    for (int64_t pos = 0; pos < shared;) {
        const int64_t offset = pos % block_size;
        const int64_t n = (block_size - offset < shared - pos) ? block_size - offset : shared - pos;
        const int64_t base = ((int64_t)table[pos / block_size] * block_size + offset) * token_stride + head_offset;
        const kv_t *restrict k = k_cache + base;
        const kv_t *restrict v = v_cache + base;
        /* scores: four keys at a time against every lane, each key element broadcast once */
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            vf a[4][MAX_LANE_VECTORS] = {{{0}}};
            const kv_t *restrict k0 = k + t * token_stride;
            for (int d = 0; d < D; d += 2)
                for (int u = 0; u < 4; ++u) {
                    vf kb0, kb1;
                    splat2(k0 + u * token_stride + d, &kb0, &kb1);
                    for (int j = 0; j < QV; ++j) a[u][j] += kb0 * qt[d * QV + j];
                    for (int j = 0; j < QV; ++j) a[u][j] += kb1 * qt[(d + 1) * QV + j];
                }
            for (int u = 0; u < 4; ++u)
                for (int j = 0; j < QV; ++j) s[(t + u) * QV + j] = a[u][j];
        }
        for (; t < n; ++t) {
            vf a[MAX_LANE_VECTORS] = {{0}};
            const kv_t *restrict kt = k + t * token_stride;
            for (int d = 0; d < D; d += 2) {
                vf kb0, kb1;
                splat2(kt + d, &kb0, &kb1);
                for (int j = 0; j < QV; ++j) a[j] += kb0 * qt[d * QV + j];
                for (int j = 0; j < QV; ++j) a[j] += kb1 * qt[(d + 1) * QV + j];
            }
            for (int j = 0; j < QV; ++j) s[t * QV + j] = a[j];
        }
        /* online softmax, every lane at once */
        vf correction[MAX_LANE_VECTORS];
        for (int j = 0; j < QV; ++j) {
            vf block_max = s[j];
            for (int64_t u = 1; u < n; ++u) block_max = vmaxf(block_max, s[u * QV + j]);
            const vf new_max = vmaxf(block_max, m[j]);
            correction[j] = vexp(m[j] - new_max); /* 0 while m is -inf */
            vf sum = {0};
            for (int64_t u = 0; u < n; ++u) {
                const vf p = vexp(s[u * QV + j] - new_max);
                s[u * QV + j] = p;
                sum += p;
            }
            l[j] = l[j] * correction[j] + sum;
            m[j] = new_max;
        }
        /* values: four head-dim elements at a time, each value element broadcast once */
        for (int d0 = 0; d0 < D; d0 += 4) {
            vf a[4][MAX_LANE_VECTORS];
            for (int e = 0; e < 4; ++e)
                for (int j = 0; j < QV; ++j) a[e][j] = ot[(d0 + e) * QV + j] * correction[j];
            for (int64_t u = 0; u < n; ++u) {
                const kv_t *restrict vt = v + u * token_stride + d0;
                for (int e = 0; e < 4; e += 2) {
                    vf vb0, vb1;
                    splat2(vt + e, &vb0, &vb1);
                    for (int j = 0; j < QV; ++j) a[e][j] += vb0 * s[u * QV + j];
                    for (int j = 0; j < QV; ++j) a[e + 1][j] += vb1 * s[u * QV + j];
                }
            }
            for (int e = 0; e < 4; ++e)
                for (int j = 0; j < QV; ++j) ot[(d0 + e) * QV + j] = a[e][j];
        }
        pos += n;
    }
}

/* The Q = R * G scaled queries of KV head h for rows[0..R): lane r * G + g is row r's query head h * G + g,
 * its element d stored at out[lane * lane_step + d * d_step]. */
static inline __attribute__((always_inline)) void scaled_queries(const float *restrict q, int64_t q_row,
                                                                 int64_t q_head, int64_t q_col,
                                                                 const int64_t *restrict rows, int Q, int G,
                                                                 int64_t h, const int D, float scale,
                                                                 int64_t lane_step, int64_t d_step,
                                                                 float *restrict out) {
    for (int lane = 0; lane < Q; ++lane) {
        const float *qi = q + rows[lane / G] * q_row + (h * G + lane % G) * q_head;
        for (int d = 0; d < D; ++d) out[lane * lane_step + d * d_step] = qi[d * q_col] * scale;
    }
}

/* One work item: the rows[0..R) of a tile (their shared keys: [0, shared)) for KV head h. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *restrict q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *restrict k_cache,
    const kv_t *restrict v_cache, const int32_t *restrict block_tables, int64_t table_stride,
    const int64_t *restrict seq_lens, const int64_t *restrict rows, int64_t R, int64_t shared, int64_t h,
    int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int G, const int D, float scale, int amx,
    float *restrict out) {
    const int64_t token_stride = num_kv_heads * D, head_offset = h * D;
    float qs[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    const int Q = (int)R * G, QV = (Q + VL - 1) / VL;
    vf qt[MAX_HEAD_DIM * MAX_LANE_VECTORS], ot[MAX_HEAD_DIM * MAX_LANE_VECTORS];
    vf mt[MAX_LANE_VECTORS], lt[MAX_LANE_VECTORS];
    /* the shared phase leaves query lane's element d at ot[lane * lane_step + d * d_step] */
    int64_t lane_step = 0, d_step = 0;
    if (R > 1 && shared > 0) {
        float *restrict qtf = (float *)qt;
        const int32_t *table = block_tables + rows[0] * table_stride;
#if KV_BF16 && defined(HAVE_AMX)
        if (amx) {
            scaled_queries(q, q_row, q_head, q_col, rows, Q, G, h, D, scale, D, 1, qtf);
            if (amx_shared_phase(qtf, Q, k_cache, v_cache, table, shared, block_size, token_stride, head_offset, D,
                                 (float *)mt, (float *)lt, (float *)ot) == 0)
                lane_step = D, d_step = 1;
        }
#endif
        if (lane_step == 0) {
            memset(qt, 0, sizeof(vf) * (size_t)(D * QV));
            memset(ot, 0, sizeof(vf) * (size_t)(D * QV));
            for (int j = 0; j < QV; ++j) {
                mt[j] = splat(-INFINITY);
                lt[j] = splat(0.0f);
            }
            scaled_queries(q, q_row, q_head, q_col, rows, Q, G, h, D, scale, 1, QV * VL, qtf);
            if (QV == 1)
                shared_phase(qt, 1, k_cache, v_cache, table, shared, block_size, token_stride, head_offset, D, mt, lt,
                             ot);
            else if (QV == 2)
                shared_phase(qt, 2, k_cache, v_cache, table, shared, block_size, token_stride, head_offset, D, mt, lt,
                             ot);
            else
                shared_phase(qt, 3, k_cache, v_cache, table, shared, block_size, token_stride, head_offset, D, mt, lt,
                             ot);
            lane_step = 1, d_step = QV * VL;
        }
    } else {
        shared = 0;
    }
    const float *restrict otf = (const float *)ot, *restrict mtf = (const float *)mt, *restrict ltf = (const float *)lt;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t i = rows[r];
        scaled_queries(q, q_row, q_head, q_col, rows + r, G, G, h, D, scale, D, 1, qs);
        for (int g = 0; g < G; ++g) {
            const int lane = (int)r * G + g;
            if (shared > 0) {
                m[g] = mtf[lane];
                l[g] = ltf[lane];
                for (int d = 0; d < D; ++d) acc[g * D + d] = otf[lane * lane_step + d * d_step];
            } else {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                memset(acc + g * D, 0, sizeof(float) * (size_t)D);
            }
        }
        const int32_t *table = block_tables + i * table_stride;
        switch (G) { /* the fused group sizes as constants, so that their accumulators stay in registers */
#define RANGE(g) \
    case g: attend_range(qs, k_cache, v_cache, table, shared, seq_lens[i], block_size, token_stride, head_offset, g, \
                         D, m, l, acc); break;
            RANGE(1) RANGE(2) RANGE(3) RANGE(4)
#undef RANGE
        default:
            attend_range(qs, k_cache, v_cache, table, shared, seq_lens[i], block_size, token_stride, head_offset, G, D,
                         m, l, acc);
        }
        float *restrict o = out + (i * num_heads + h * G) * D;
        for (int g = 0; g < G; ++g) {
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv;
        }
    }
}

#define TILE_ARGS                                                                                                 \
    const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache, const kv_t *v_cache,       \
        const int32_t *block_tables, int64_t table_stride, const int64_t *seq_lens, const int64_t *rows, int64_t R, \
        int64_t shared, int64_t h, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int G, float scale, \
        int amx, float *out
#define TILE_CALL(D)                                                                                              \
    attend_tile(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R, shared, \
                h, num_heads, num_kv_heads, block_size, G, D, scale, amx, out)
static void attend_tile_d64(TILE_ARGS) { TILE_CALL(64); }
static void attend_tile_d128(TILE_ARGS) { TILE_CALL(128); }
static void attend_tile_any(TILE_ARGS, int D) { TILE_CALL(D); }

/* q [B, Hq, D] at strides (q_row, q_head, q_col), caches [num_blocks, block_size, Hkv, D],
 * block_tables [B, table_stride], seq_lens [B]: the number of keys each row attends over
 * (for a decode row its context, the new token included). Tile t holds rows
 * tile_rows[tile_starts[t] .. tile_starts[t + 1]) (each row of [0, B) in exactly one tile),
 * whose tables agree over their first tile_shared[t] keys (every row sees them); at most
 * MAX_LANES / G rows a tile. out: contiguous [B, Hq, D].
 * Returns 0; -1 when a dimension exceeds the kernel's fixed limits, the tiles do not hold
 * each row once, or a tile holds too many rows or claims shared keys its rows do not all
 * have; -2 when a row needs a block outside [0, num_blocks) or more blocks than its table
 * holds; -3 when out of memory. Nothing is computed then. */
int KV_NAME(paged_attention)(const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache,
                             const kv_t *v_cache, const int32_t *block_tables, int64_t table_stride,
                             const int64_t *seq_lens, int64_t num_rows, const int64_t *tile_rows,
                             const int64_t *tile_starts, const int64_t *tile_shared, int64_t num_tiles, float *out,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t num_blocks, float scale) {
    const int G = (int)(num_heads / num_kv_heads);
    const int D = (int)head_dim;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || D % VL != 0 || block_size > MAX_BLOCK_SIZE) return -1;
    if (num_tiles < 1 || tile_starts[0] != 0 || tile_starts[num_tiles] != num_rows) return -1;
    unsigned char *seen = calloc((size_t)num_rows, 1);
    if (seen == NULL) return -3;
    int status = 0;
    for (int64_t t = 0; t < num_tiles && status == 0; ++t) {
        const int64_t R = tile_starts[t + 1] - tile_starts[t];
        if (R < 1 || tile_starts[t + 1] > num_rows || (R > 1 && R * G > MAX_LANES)) {
            status = -1;
            break;
        }
        const int64_t first = tile_rows[tile_starts[t]]; /* checked as the loop's first row */
        for (int64_t r = tile_starts[t]; r < tile_starts[t + 1] && status == 0; ++r) {
            const int64_t i = tile_rows[r];
            if (i < 0 || i >= num_rows || seen[i]) {
                status = -1;
                break;
            }
            seen[i] = 1;
            const int64_t used = (seq_lens[i] + block_size - 1) / block_size;
            if (used > table_stride) status = -2;
            for (int64_t b = 0; b < used && status == 0; ++b)
                if (block_tables[i * table_stride + b] < 0 || block_tables[i * table_stride + b] >= num_blocks)
                    status = -2;
            if (status == 0 && R > 1 && tile_shared[t] > seq_lens[i]) status = -1;
            for (int64_t b = 0; status == 0 && R > 1 && b < (tile_shared[t] + block_size - 1) / block_size; ++b)
                if (block_tables[i * table_stride + b] != block_tables[first * table_stride + b]) status = -1;
        }
    }
    free(seen);
    if (status != 0) return status;
    const int64_t items = num_tiles * num_kv_heads;
#if KV_BF16
    const int amx = attention_bf16_path(D) == ATTENTION_AMX;
#else
    const int amx = 0;
#endif
    /* a tile's KV heads to one thread, once there are tiles enough for every thread */
    const int64_t chunk = num_tiles >= 2 * omp_get_max_threads() ? num_kv_heads : 1;
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t *rows = tile_rows + tile_starts[t];
        const int64_t R = tile_starts[t + 1] - tile_starts[t];
        if (D == 64)
            attend_tile_d64(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R,
                            tile_shared[t], h, num_heads, num_kv_heads, block_size, G, scale, amx, out);
        else if (D == 128)
            attend_tile_d128(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R,
                             tile_shared[t], h, num_heads, num_kv_heads, block_size, G, scale, amx, out);
        else
            attend_tile_any(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R,
                            tile_shared[t], h, num_heads, num_kv_heads, block_size, G, scale, amx, out, D);
    }
    return 0;
}

/* Writes the new tokens' keys and values into the paged caches: row t of k and v
 * ([T, width] at strides (row, col), width = Hkv * D) goes to slot slots[t] (block *
 * block_size + offset) of k_cache and v_cache ([num_slots, width]). Returns -1, writing
 * nothing, when a slot is out of range. */
int KV_NAME(store_kv)(const float *k, int64_t k_row, int64_t k_col, const float *v, int64_t v_row, int64_t v_col,
                      const int64_t *slots, int64_t num_rows, int64_t width, kv_t *k_cache, kv_t *v_cache,
                      int64_t num_slots) {
    for (int64_t t = 0; t < num_rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
#pragma omp parallel for schedule(static) if (num_rows * width >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_rows; ++t) {
        kv_t *restrict kd = k_cache + slots[t] * width, *restrict vd = v_cache + slots[t] * width;
        const float *restrict ks = k + t * k_row, *restrict vs = v + t * v_row;
        for (int64_t f = 0; f < width; ++f) {
            kd[f] = KV_FROM_F32(ks[f * k_col]);
            vd[f] = KV_FROM_F32(vs[f * v_col]);
        }
    }
    return 0;
}
