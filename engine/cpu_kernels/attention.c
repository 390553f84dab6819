/* Paged attention for the CPU: float32 queries over a float32 or bfloat16 KV cache.
 *
 * Each row is one query token attending over its context, read in place from the paged
 * cache (no gather into a contiguous copy): a decode token, or a token of a prefill chunk
 * with its causal context (its position + 1 keys). Rows come in tiles: a tile is one row,
 * or up to MAX_LANES / G rows whose tables begin with the same blocks (a shared system
 * prompt, the tokens of one chunk). Work items are a tile and a range of its KV heads (all of
 * them, up to MAX_GROUP query heads, where there are tiles for every thread; one where there
 * are fewer), split across OpenMP threads in order, so tiles that share prefix blocks read
 * them while they are still in cache.
 *
 * A multi-row tile first attends over its shared keys, KV head by KV head, with the tile's
 * R * G queries as the lanes of its vectors (shared_phase): each key and value element is
 * loaded once for all of them and no horizontal sums are needed. Over a bfloat16 cache where
 * the CPU has AMX, the queries are the columns of tiles instead (attention_amx.h); where it has
 * AVX512-BF16, VDPBF16PS multiplies pairs of them (attention_dot.h). Each row
 * then continues alone over its own keys for all the item's KV heads in one pass over its
 * blocks (own_keys, attention_rows.h). Softmax is online: running max, running sum, rescaled
 * accumulator, carried from one phase to the next in the output row. The widened shared phase
 * rounds every lane as own_keys rounds that query alone, so a row's output is the same bits in
 * any tile (batch-invariant); the AMX and VDPBF16PS paths round queries to bfloat16 and are not.
 *
 * With fewer rows than threads and a long context, rows attend alone, split by keys across the threads instead
 * (attention_split.h).
 *
 * Built at run time with -O3 -march=native -fopenmp; vectors as in vec.h (16 lanes where the
 * build has AVX-512), so head_dim must be a multiple of 8. This file builds the float32-cache
 * functions; attention_bf16.c includes it with KV_BF16 set for those of a bfloat16 cache, whose
 * elements widen exactly as they load and round to nearest even as they are stored, and attention_i8.c with KV_I8
 * set for those of an int8 cache (codes with a scale per block and KV head).
 */

#include <omp.h>
#include <stdlib.h>
#include <unistd.h>

#include "vec.h"
#include "kernels.h"

#ifndef KV_BF16
#define KV_BF16 0
#endif
#ifndef KV_I8
#define KV_I8 0
#endif
#define KV_F32 (!KV_BF16 && !KV_I8) /* the float32-cache build, which defines once what every build reads */
#if KV_I8
/* int8 codes: a key or value element is its code times the scale of its block and KV head ([num_blocks, Hkv]
 * k_scales and v_scales). A chunk of keys lies within one block, so the key scale multiplies each score and the
 * value scale each weight as it meets the values; the softmax sums take the weights unscaled. */
typedef int8_t kv_t;
#define KV_TO_F32(x) ((float)(x))
#define KV_NAME(name) name##_i8
#elif KV_BF16
typedef uint16_t kv_t;
#define KV_LOAD(p) load_bf16(p)
#define KV_TO_F32(x) bf16_to_f32(x)
#define KV_FROM_F32(x) f32_to_bf16(x)
#define KV_NAME(name) name##_bf16
#else
typedef float kv_t;
#define KV_LOAD(p) load(p)
#define KV_TO_F32(x) (x)
#define KV_FROM_F32(x) (x)
#define KV_NAME(name) name##_f32
#endif
#if KV_I8
#define KV_SCALE_PARAMS , const float *k_scales, const float *v_scales
#else
#define KV_SCALE_PARAMS
#endif
#define KV_LINE (64 / (int)sizeof(kv_t)) /* cache elements a 64-byte line holds */
/* The scale of the block holding context position pos for KV head h: 1 but in an int8 cache. */
#if KV_I8
#define KV_SCALE(scales, table, pos, block_size, num_kv_heads, h) \
    ((scales)[(int64_t)(table)[(pos) / (block_size)] * (num_kv_heads) + (h)])
#else
#define KV_SCALE(scales, table, pos, block_size, num_kv_heads, h) 1.0f
#endif

/* A tile's queries are the lanes of its vectors in the shared phase: 16 a vector where the build has
 * AVX-512, 8 elsewhere (GCC lowers either to what the target has). */
#ifdef __AVX512F__
#define SHARED_W 16
typedef vf16 vs;
typedef vi16 vsi;
#define VEXP_S vexp16
#else
#define SHARED_W 8
typedef vf vs;
typedef vi vsi;
#define VEXP_S vexp
#endif

/* a * b + c as own_keys' ROWS(fma) rounds it (attention_rows.h). */
static inline vs vs_fma(vs a, vs b, vs c) {
#if SHARED_W == 16
    return (vs)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX2__)
    return (vs)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline vs vs_max(vs a, vs b) {
    const vsi a_larger = a > b;
    return (vs)(((vsi)a & a_larger) | ((vsi)b & ~a_larger));
}

/* Fetches the cache lines of one token's head (D elements) ahead of their use: into every cache level, or
 * into L2 and below where attention_fetch_l2 says so (attention_fetch_into). */
static inline __attribute__((always_inline)) void prefetch_row(const kv_t *p, const int D) {
    if (attention_fetch_l2)
        for (int c = 0; c < D; c += KV_LINE) __builtin_prefetch(p + c, 0, 2); /* prefetcht1 */
    else
        for (int c = 0; c < D; c += KV_LINE) __builtin_prefetch(p + c);
}

#if KV_F32 /* once in the library: the float32-cache build defines what every build reads */
int attention_fetch_l2; /* into L1 until library() calls attention_fetch_into */

/* Where the attention kernels fetch cache lines ahead: level 1 into L1 (and below), 2 into L2 only, 0 the
 * machine's default: L2 where the L1 data cache holds under 48 KiB. A chunk fetched ahead is 12 KiB of a
 * bfloat16 cache at the bundled model's shapes; into a 32 KiB L1 it displaced what the chunk before still
 * used (a Zen 4 EPYC: a 64-row decode step 1.15x faster without sharing, 1.08x behind a shared prompt,
 * fetching into L2 only), where a 48 KiB L1 held both (a Zen 5 EPYC: into L2 only was 1.14-1.24x slower).
 * docs/performance.md. */
void attention_fetch_into(int level) {
#ifdef _SC_LEVEL1_DCACHE_SIZE
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#else
    const long l1 = 0; /* not known here: into L1 */
#endif
    attention_fetch_l2 = level == 2 || (level == 0 && l1 > 0 && l1 < 48 * 1024);
}

/* The level attention_fetch_into chose: 1 or 2. */
int attention_fetch_level(void) { return attention_fetch_l2 ? 2 : 1; }
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256
#define MAX_LANE_VECTORS 3
#define MAX_LANES (MAX_LANE_VECTORS * SHARED_W) /* queries of a multi-row tile: 48, or 24 without AVX-512 */

#if KV_BF16
#include "attention_amx.h"
#endif

#define FUSED_GROUP 4 /* query heads of a KV head weighted in one pass over each value */

/* Keys of the chunk at context position pos: up to `width`, within its block and before end. */
static inline int64_t chunk_len(int64_t pos, int64_t end, int64_t block_size, int64_t width) {
    int64_t n = block_size - pos % block_size;
    if (n > end - pos) n = end - pos;
    return n < width ? n : width;
}

/* The cache element where context position pos's token row starts. */
static inline int64_t chunk_base(const int32_t *table, int64_t pos, int64_t block_size, int64_t token_stride) {
    return ((int64_t)table[pos / block_size] * block_size + pos % block_size) * token_stride;
}

#ifdef __AVX512F__
#define ROW_W 16
#include "attention_rows.h"
#undef ROW_W
#endif
#define ROW_W 8
#include "attention_rows.h"
#undef ROW_W

/* Online softmax over a chunk's scores s[u * QV + j] (n keys), every lane at once: the scores become their
 * weights, the maxima m[QV] and sums l[QV] move on, and correction[QV] rescales what came before. */
static inline __attribute__((always_inline)) void softmax_chunk(vs *restrict s, int64_t n, const int QV,
                                                                vs *restrict m, vs *restrict l,
                                                                vs *restrict correction) {
    for (int j = 0; j < QV; ++j) {
        vs top[4] = {s[j], s[j], s[j], s[j]}; /* four chains of maxima, not one n long */
        int64_t u = 1;
        for (; u + 4 <= n; u += 4)
            for (int c = 0; c < 4; ++c) top[c] = vs_max(top[c], s[(u + c) * QV + j]);
        for (; u < n; ++u) top[0] = vs_max(top[0], s[u * QV + j]);
        const vs new_max = vs_max(vs_max(vs_max(top[0], top[1]), vs_max(top[2], top[3])), m[j]);
        correction[j] = VEXP_S(m[j] - new_max); /* 0 while m is -inf */
        vs even = {0}, odd = {0}; /* two chains of sums, in registers */
        for (u = 0; u + 2 <= n; u += 2) {
            const vs p0 = VEXP_S(s[u * QV + j] - new_max), p1 = VEXP_S(s[(u + 1) * QV + j] - new_max);
            s[u * QV + j] = p0;
            s[(u + 1) * QV + j] = p1;
            even += p0;
            odd += p1;
        }
        if (u < n) {
            const vs p = VEXP_S(s[u * QV + j] - new_max);
            s[u * QV + j] = p;
            even += p;
        }
        l[j] = l[j] * correction[j] + (even + odd);
        m[j] = new_max;
    }
}

#if KV_BF16 && defined(__AVX512BF16__) && SHARED_W == 16
#define HAVE_DOT_ATTENTION 1
#include "attention_dot.h"
#endif

/* The width of own_keys' vectors for head_dim D: 16 lanes where the build has AVX-512 and D allows, else 8.
 * A row's keys come in chunks of this many (within a block), and its softmax sums in this many lanes. */
#ifdef __AVX512F__
#define ROW_WIDTH(D) ((D) % 16 == 0 ? 16 : 8)
#else
#define ROW_WIDTH(D) 8
#endif
#define MAX_ROW_WIDTH 16

/* Attention over the shared keys [0, shared) of one table for Q <= MAX_LANES queries held as vector lanes:
 * qt[d * QV + j] holds element d of the queries of lanes j * SHARED_W .. (j + 1) * SHARED_W - 1 (scaled;
 * padding lanes 0). Carries per-lane state: maxima m[QV], the softmax sums as RW partial sums l[t * QV + j]
 * (RW = ROW_WIDTH(D)) and accumulators ot[d * QV + j]. QV, D and RW are compile-time constants in the callers.
 *
 * Every lane takes the steps own_keys (attention_rows.h) takes for one query, in the same order, so a row's
 * attention is the same bits in a tile as alone, whatever it is batched with: chunks of RW keys within a
 * block; a score as RW partial sums (element d into sum d % RW, in order) folded pairwise as transpose_sum
 * folds them; the running maximum moved, and what came before rescaled, only where a chunk's maximum
 * exceeds it; key t of each chunk into partial sum t; each value weighted key by key. `shared` must end a
 * chunk (attend_tile rounds it down). With `dot` (a bfloat16 cache where the build has AVX512-BF16)
 * VDPBF16PS multiplies, dot_shared_phase: faster, its queries and weights rounded to bfloat16. */
static inline __attribute__((always_inline)) void shared_phase(const vs *restrict qt, const int QV,
                                                               const kv_t *restrict k_cache,
                                                               const kv_t *restrict v_cache,
                                                               const int32_t *restrict table, int64_t shared,
                                                               int64_t block_size, int64_t token_stride,
                                                               int64_t head_offset, const int D, const int RW, int dot,
                                                               const float *restrict k_scales,
                                                               const float *restrict v_scales, vs *restrict m,
                                                               vs *restrict l, vs *restrict ot) {
#ifdef HAVE_DOT_ATTENTION
    if (dot) { /* its sums in partial sum 0 */
        dot_shared_phase(qt, QV, k_cache, v_cache, table, shared, block_size, token_stride, head_offset, D, m, l, ot);
        return;
    }
#endif
    (void)dot, (void)k_scales, (void)v_scales;
    vs s[MAX_ROW_WIDTH * MAX_LANE_VECTORS];
    for (int64_t pos = 0; pos < shared;) {
        const int64_t n = chunk_len(pos, shared, block_size, RW);
        const float k_scale = KV_SCALE(k_scales, table, pos, block_size, token_stride / D, head_offset / D);
        const float v_scale = KV_SCALE(v_scales, table, pos, block_size, token_stride / D, head_offset / D);
        (void)k_scale, (void)v_scale;
        const int64_t base = chunk_base(table, pos, block_size, token_stride) + head_offset;
        const kv_t *restrict k = k_cache + base;
        const kv_t *restrict v = v_cache + base;
        /* scores: key t's element d into partial sum d % RW of every lane; the partial sums come in the order of
         * transpose_sum's folds (partial i at step bit_reverse(i)), each fold made as soon as both its halves are
         * there, so five levels of RW / 2^level partial sums stay in registers rather than RW of them */
        for (int64_t t = 0; t < n; ++t) {
            const kv_t *restrict kt = k + t * token_stride;
            vs level[5][MAX_LANE_VECTORS];
#pragma GCC unroll 16
            for (int step = 0; step < RW; ++step) {
                int i = 0; /* step's bits reversed, over log2(RW) of them */
                for (int bit = 1, rev = RW / 2; bit < RW; bit <<= 1, rev >>= 1) i |= step & bit ? rev : 0;
                vs part[MAX_LANE_VECTORS];
                for (int j = 0; j < QV; ++j) part[j] = (vs){0};
                for (int d = i; d < D; d += RW) {
                    const vs kb = KV_TO_F32(kt[d]) - (vs){0};
                    for (int j = 0; j < QV; ++j) part[j] = vs_fma(qt[d * QV + j], kb, part[j]);
                }
                int height = 0;
                for (int done = step; done & 1; done >>= 1, ++height)
                    for (int j = 0; j < QV; ++j) part[j] = level[height][j] + part[j];
                for (int j = 0; j < QV; ++j) level[height][j] = part[j];
            }
            const int top = RW == 16 ? 4 : 3;
#if KV_I8
            for (int j = 0; j < QV; ++j) s[t * QV + j] = level[top][j] * k_scale;
#else
            for (int j = 0; j < QV; ++j) s[t * QV + j] = level[top][j];
#endif
        }
        vs correction[MAX_LANE_VECTORS];
        for (int j = 0; j < QV; ++j) {
            vs top = s[j];
            for (int64_t t = 1; t < n; ++t) top = vs_max(top, s[t * QV + j]);
            const vsi moved = top > m[j]; /* own_keys rescales only where the maximum moves */
            const vs rescale = VEXP_S(m[j] - top), one = (vs){0} + 1.0f;
            correction[j] = (vs)(((vsi)rescale & moved) | ((vsi)one & ~moved));
            m[j] = vs_max(top, m[j]);
            for (int64_t t = 0; t < n; ++t) s[t * QV + j] = VEXP_S(s[t * QV + j] - m[j]);
            for (int t = 0; t < n; ++t) l[t * QV + j] = vs_fma(l[t * QV + j], correction[j], s[t * QV + j]);
            for (int t = n; t < RW; ++t) l[t * QV + j] = l[t * QV + j] * correction[j]; /* own_keys adds a weight 0 */
#if KV_I8
            for (int64_t t = 0; t < n; ++t) s[t * QV + j] = s[t * QV + j] * v_scale; /* the weights of the codes */
#endif
        }
        /* values: four head-dim elements at a time, key by key */
        for (int d0 = 0; d0 < D; d0 += 4) {
            vs a[4][MAX_LANE_VECTORS];
            for (int e = 0; e < 4; ++e)
                for (int j = 0; j < QV; ++j) a[e][j] = ot[(d0 + e) * QV + j] * correction[j];
            for (int64_t u = 0; u < n; ++u) {
                const kv_t *restrict vt = v + u * token_stride + d0;
                for (int e = 0; e < 4; ++e) {
                    const float x = KV_TO_F32(vt[e]);
                    for (int j = 0; j < QV; ++j) a[e][j] = vs_fma(s[u * QV + j], x - (vs){0}, a[e][j]);
                }
            }
            for (int e = 0; e < 4; ++e)
                for (int j = 0; j < QV; ++j) ot[(d0 + e) * QV + j] = a[e][j];
        }
        pos += n;
    }
}

/* The paths of a tile's shared keys: widened float32 vectors (shared_phase; every path over a float32
 * cache), VDPBF16PS (dot_shared_phase), AMX tiles (amx_shared_phase). */
enum { ATTENTION_WIDENED = 0, ATTENTION_DOT = 1, ATTENTION_AMX = 2 };

#if KV_BF16
static int attention_limit = ATTENTION_AMX;

/* Caps the shared keys' path at `limit` (an ATTENTION_ value): tests, PAGED_BF16_ATTENTION. */
void attention_bf16_limit(int limit) { attention_limit = limit; }

/* The path a tile's shared keys take over a bfloat16 cache for head_dim D on this build and CPU: AMX where
 * permitted, else the dot products where they out-run the widened FMAs (dot_outruns_fma) or the cap names them;
 * both need D a multiple of 32. */
int attention_bf16_path(int64_t D) {
#ifdef HAVE_AMX
    if (attention_limit >= ATTENTION_AMX && D % 32 == 0 && amx_permitted()) return ATTENTION_AMX;
#endif
#ifdef HAVE_DOT_ATTENTION
    if (D % 32 == 0 && (attention_limit == ATTENTION_DOT || (attention_limit > ATTENTION_DOT && dot_outruns_fma())))
        return ATTENTION_DOT;
#endif
    (void)D;
    return ATTENTION_WIDENED;
}
#endif

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

/* The own keys of one row from its query heads' state: the row-wide pass of attention_rows.h, ROW_WIDTH(D)
 * lanes (16 where the build has AVX-512 and D allows: split into AVX halves, the 16-lane folds cost 5x). With
 * `specialized` (the head_dim-specific builds), the group sizes up to FUSED_GROUP as constants, so that
 * their accumulators stay in registers. */
static inline __attribute__((always_inline)) void own_keys(const float *restrict q, const kv_t *restrict k_cache,
                                                           const kv_t *restrict v_cache, const int32_t *restrict table,
                                                           int64_t start, int64_t end, int64_t block_size,
                                                           int64_t token_stride, int64_t h0, int64_t h1, int G,
                                                           const int D, const int specialized, float softcap,
                                                           const float *restrict k_scales,
                                                           const float *restrict v_scales, float *restrict m,
                                                           float *restrict sums, float *restrict acc) {
#define OWN(width, g)                                                                                                \
    own_keys_##width(q, k_cache, v_cache, table, start, end, block_size, token_stride, h0, h1, g, D, softcap, k_scales, \
                     v_scales, m, sums, acc)
#define OWN_GROUPS(width)                                                                                   \
    switch (specialized ? G : 0) {                                                                          \
    case 1: OWN(width, 1); break;                                                                           \
    case 2: OWN(width, 2); break;                                                                           \
    case 3: OWN(width, 3); break;                                                                           \
    case 4: OWN(width, 4); break;                                                                           \
    default: OWN(width, G);                                                                                 \
    }
#ifdef __AVX512F__
    if (D % 16 == 0) {
        OWN_GROUPS(w16)
        return;
    }
#endif
    OWN_GROUPS(w8)
#undef OWN_GROUPS
#undef OWN
}

/* Fetches the cache lines of one row's first chunk of keys and values at context position pos (up to 16 keys,
 * within a block, before end) for KV heads [h0, h1), ahead of the row. */
static inline __attribute__((always_inline)) void prefetch_chunk(const kv_t *k_cache, const kv_t *v_cache,
                                                                 const int32_t *table, int64_t pos, int64_t end,
                                                                 int64_t block_size, int64_t token_stride, int64_t h0,
                                                                 int64_t h1, const int D) {
    if (pos >= end) return;
    const int64_t n = chunk_len(pos, end, block_size, 16);
    const int64_t base = chunk_base(table, pos, block_size, token_stride) + h0 * D;
    for (int64_t t = 0; t < n; ++t) {
        prefetch_row(k_cache + base + t * token_stride, (int)(h1 - h0) * D);
        prefetch_row(v_cache + base + t * token_stride, (int)(h1 - h0) * D);
    }
}

/* One work item: the rows[0..R) of a tile (their shared keys: [0, shared), rounded down to the end of a chunk of
 * own_keys) for KV heads [h0, h1), at most MAX_GROUP query heads. A multi-row tile's shared phase runs head by
 * head, leaving each row's accumulators in out (unnormalized) and its maxima and partial sums in row_max and
 * row_sums; each row then takes its own keys for all the item's heads in one pass (own_keys), adds up its
 * partial sums lane by lane and normalizes its outputs in place. With a window, a row's own keys start at
 * seq_lens - window (its tile then shares none past it, paged_attention checks). */
static inline __attribute__((always_inline)) void attend_tile(
    const float *restrict q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *restrict k_cache,
    const kv_t *restrict v_cache, const int32_t *restrict block_tables, int64_t table_stride,
    const int64_t *restrict seq_lens, const int64_t *restrict rows, int64_t R, int64_t shared, int64_t h0, int64_t h1,
    int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int G, const int D, const int specialized,
    float scale, int64_t window, float softcap, int path, const float *restrict k_scales,
    const float *restrict v_scales, float *restrict out) {
    const int64_t token_stride = num_kv_heads * D;
    const int Q = (int)R * G, QV = (Q + SHARED_W - 1) / SHARED_W, heads = (int)(h1 - h0) * G; /* a row's here */
    const int RW = ROW_WIDTH(D);
    /* row r's query head j of the item: its maximum [r * heads + j], its partial sums from [(r * heads + j) * RW] */
    float row_max[MAX_LANES * MAX_GROUP], row_sums[MAX_LANES * MAX_GROUP * MAX_ROW_WIDTH];
    shared -= shared % block_size % RW; /* where a row alone ends a chunk */
    if (R > 1 && shared > 0) {
        prefetch_chunk(k_cache, v_cache, block_tables + rows[0] * table_stride, shared, seq_lens[rows[0]], block_size,
                       token_stride, h0, h1, D);
        const int32_t *table = block_tables + rows[0] * table_stride;
        vs qt[MAX_HEAD_DIM * MAX_LANE_VECTORS], ot[MAX_HEAD_DIM * MAX_LANE_VECTORS];
        vs mt[MAX_LANE_VECTORS], lt[MAX_ROW_WIDTH * MAX_LANE_VECTORS]; /* lt: partial sum t of lane i at [t * QV][i] */
        float *restrict qtf = (float *)qt;
        for (int64_t h = h0; h < h1; ++h) {
            const int64_t head_offset = h * D;
            /* the shared phase leaves query lane's element d at ot[lane * lane_step + d * d_step] */
            int64_t lane_step = 0, d_step = 0;
            memset(lt, 0, sizeof(vs) * (size_t)(RW * QV)); /* AMX's and the dot products' sums: partial sum 0 */
#if KV_BF16 && defined(HAVE_AMX)
            if (path == ATTENTION_AMX && Q <= AMX_QUERIES) {
                scaled_queries(q, q_row, q_head, q_col, rows, Q, G, h, D, scale, D, 1, qtf);
                if (amx_shared_phase(qtf, Q, k_cache, v_cache, table, shared, block_size, token_stride, head_offset,
                                     D, (float *)mt, (float *)lt, (float *)ot) == 0)
                    lane_step = D, d_step = 1;
            }
#endif
            if (lane_step == 0) {
                memset(qt, 0, sizeof(vs) * (size_t)(D * QV));
                memset(ot, 0, sizeof(vs) * (size_t)(D * QV));
                for (int j = 0; j < QV; ++j) mt[j] = (vs){0} - INFINITY;
                scaled_queries(q, q_row, q_head, q_col, rows, Q, G, h, D, scale, 1, QV * SHARED_W, qtf);
                const int dot = path == ATTENTION_DOT;
#define SHARED(qv, rw) \
    shared_phase(qt, qv, k_cache, v_cache, table, shared, block_size, token_stride, head_offset, D, rw, dot, k_scales, \
                 v_scales, mt, lt, ot)
                /* QV and RW as constants: the loops unroll, and every product is contracted as own_keys' are */
                if (RW == 16)
                    QV == 1 ? SHARED(1, 16) : QV == 2 ? SHARED(2, 16) : SHARED(3, 16);
                else
                    QV == 1 ? SHARED(1, 8) : QV == 2 ? SHARED(2, 8) : SHARED(3, 8);
#undef SHARED
                lane_step = 1, d_step = QV * SHARED_W;
            }
            const float *restrict otf = (const float *)ot, *restrict mtf = (const float *)mt;
            const float *restrict ltf = (const float *)lt;
            for (int lane = 0; lane < Q; ++lane) {
                const int r = lane / G, j = (int)(h - h0) * G + lane % G;
                float *restrict o = out + (rows[r] * num_heads + h0 * G + j) * D;
                for (int d = 0; d < D; ++d) o[d] = otf[lane * lane_step + d * d_step];
                row_max[r * heads + j] = mtf[lane];
                for (int t = 0; t < RW; ++t) row_sums[(r * heads + j) * RW + t] = ltf[t * QV * SHARED_W + lane];
            }
        }
    } else {
        shared = 0;
    }
#define ROW_START(i) (window > 0 && seq_lens[i] - window > shared ? seq_lens[i] - window : shared)
    for (int64_t r = 0; r < R; ++r) {
        const int64_t i = rows[r];
        if (r + 1 < R)
            prefetch_chunk(k_cache, v_cache, block_tables + rows[r + 1] * table_stride, ROW_START(rows[r + 1]),
                           seq_lens[rows[r + 1]], block_size, token_stride, h0, h1, D);
        float qs[MAX_GROUP * MAX_HEAD_DIM], m[MAX_GROUP], sums[MAX_GROUP * MAX_ROW_WIDTH];
        float *restrict acc = out + (i * num_heads + h0 * G) * D;
        for (int64_t h = h0; h < h1; ++h)
            scaled_queries(q, q_row, q_head, q_col, rows + r, G, G, h, D, scale, D, 1, qs + (h - h0) * G * D);
        for (int j = 0; j < heads; ++j) {
            if (shared > 0) {
                m[j] = row_max[r * heads + j];
                memcpy(sums + j * RW, row_sums + (r * heads + j) * RW, sizeof(float) * (size_t)RW);
            } else {
                m[j] = -INFINITY;
                memset(sums + j * RW, 0, sizeof(float) * (size_t)RW);
                memset(acc + j * D, 0, sizeof(float) * (size_t)D);
            }
        }
        own_keys(qs, k_cache, v_cache, block_tables + i * table_stride, ROW_START(i), seq_lens[i], block_size,
                 token_stride, h0, h1, G, D, specialized, softcap, k_scales, v_scales, m, sums, acc);
        for (int j = 0; j < heads; ++j) {
            float l = 0.0f;
            for (int t = 0; t < RW; ++t) l += sums[j * RW + t];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int d = 0; d < D; ++d) acc[j * D + d] *= inv;
        }
    }
#undef ROW_START
}

#define TILE_ARGS                                                                                                 \
    const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache, const kv_t *v_cache,       \
        const int32_t *block_tables, int64_t table_stride, const int64_t *seq_lens, const int64_t *rows, int64_t R, \
        int64_t shared, int64_t h0, int64_t h1, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int G, \
        float scale, int64_t window, float softcap, int path, const float *k_scales, const float *v_scales, float *out
#define TILE_CALL(D, S)                                                                                            \
    attend_tile(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R, shared, \
                h0, h1, num_heads, num_kv_heads, block_size, G, D, S, scale, window, softcap, path, k_scales,       \
                v_scales, out)
static void attend_tile_d64(TILE_ARGS) { TILE_CALL(64, 1); }
static void attend_tile_d128(TILE_ARGS) { TILE_CALL(128, 1); }
static void attend_tile_any(TILE_ARGS, int D) { TILE_CALL(D, 0); }

#include "attention_split.h"

#if KV_F32 /* defined once, in the float32 build */
/* MAX_LANES of this build: the most queries (rows x query heads of a KV group) a multi-row tile holds. */
int attention_max_lanes(void) { return MAX_LANES; }
#endif

/* q [B, Hq, D] at strides (q_row, q_head, q_col), caches [num_blocks, block_size, Hkv, D],
 * block_tables [B, table_stride], seq_lens [B]: the number of keys each row attends over
 * (for a decode row its context, the new token included); window > 0 keeps the last `window` of them
 * (a sliding window; the blocks before are not read and need not be valid), softcap > 0 turns each
 * scaled score s into softcap * tanh(s / softcap). Tile t holds rows
 * tile_rows[tile_starts[t] .. tile_starts[t + 1]) (each row of [0, B) in exactly one tile),
 * whose tables agree over their first tile_shared[t] keys (every row sees them: none with a
 * soft cap); at most MAX_LANES / G rows a tile. out: contiguous [B, Hq, D].
 * Returns 0; -1 when a dimension exceeds the kernel's fixed limits, the tiles do not hold
 * each row once, or a tile holds too many rows or claims shared keys its rows do not all
 * have; -2 when a row needs a block outside [0, num_blocks) or more blocks than its table
 * holds; -3 when out of memory. Nothing is computed then. */
int KV_NAME(paged_attention)(const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache,
                             const kv_t *v_cache, const int32_t *block_tables, int64_t table_stride,
                             const int64_t *seq_lens, int64_t num_rows, const int64_t *tile_rows,
                             const int64_t *tile_starts, const int64_t *tile_shared, int64_t num_tiles, float *out,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t num_blocks, float scale, int64_t window, float softcap KV_SCALE_PARAMS) {
#if !KV_I8
    const float *k_scales = NULL, *v_scales = NULL; /* no scales but in an int8 cache */
#endif
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
            const int64_t unseen = window > 0 && seq_lens[i] > window ? (seq_lens[i] - window) / block_size : 0;
            if (used > table_stride) status = -2;
            for (int64_t b = unseen; b < used && status == 0; ++b)
                if (block_tables[i * table_stride + b] < 0 || block_tables[i * table_stride + b] >= num_blocks)
                    status = -2;
            if (status == 0 && R > 1 && tile_shared[t] > seq_lens[i]) status = -1;
            if (status == 0 && R > 1 && tile_shared[t] > 0 && (softcap > 0.0f || (window > 0 && seq_lens[i] > window)))
                status = -1; /* shared keys are scored uncapped and seen by every row */
            for (int64_t b = 0; status == 0 && R > 1 && b < (tile_shared[t] + block_size - 1) / block_size; ++b)
                if (block_tables[i * table_stride + b] != block_tables[first * table_stride + b]) status = -1;
        }
    }
    free(seen);
    if (status != 0) return status;
    const int64_t span = (SPLIT_SPAN_KEYS / block_size > 0 ? SPLIT_SPAN_KEYS / block_size : 1) * block_size;
    if (split_by_keys(seq_lens, num_rows, span))
        return split_attention(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens,
                               num_rows, out, num_heads, num_kv_heads, D, block_size, span, scale, window, softcap,
                               k_scales, v_scales);
#if KV_BF16
    const int path = attention_bf16_path(D); /* an int8 cache's shared keys: the widened path */
#else
    const int path = ATTENTION_WIDENED;
#endif
    /* a tile's KV heads (up to MAX_GROUP query heads) to one item, once there are tiles enough for every thread:
     * a row's own keys then come front to back, and the heads' elements share the cache's lines and pages */
    const int64_t most = MAX_GROUP / G < num_kv_heads ? MAX_GROUP / G : num_kv_heads;
    const int64_t item_heads = num_tiles >= 2 * omp_get_max_threads() ? most : 1;
    const int64_t groups = (num_kv_heads + item_heads - 1) / item_heads, items = num_tiles * groups;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t t = item / groups, h0 = item % groups * item_heads;
        const int64_t h1 = h0 + item_heads < num_kv_heads ? h0 + item_heads : num_kv_heads;
        const int64_t *rows = tile_rows + tile_starts[t];
        const int64_t R = tile_starts[t + 1] - tile_starts[t];
        if (D == 64)
            attend_tile_d64(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R,
                            tile_shared[t], h0, h1, num_heads, num_kv_heads, block_size, G, scale, window, softcap,
                            path, k_scales, v_scales, out);
        else if (D == 128)
            attend_tile_d128(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R,
                             tile_shared[t], h0, h1, num_heads, num_kv_heads, block_size, G, scale, window, softcap,
                             path, k_scales, v_scales, out);
        else
            attend_tile_any(q, q_row, q_head, q_col, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, R,
                            tile_shared[t], h0, h1, num_heads, num_kv_heads, block_size, G, scale, window, softcap,
                            path, k_scales, v_scales, out, D);
    }
    return 0;
}

#if !KV_I8
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
#else
/* Rows of x ([T, Hkv * D] at strides (row, col)) as int8 codes at slots[t] of cache ([num_slots, Hkv * D]), one KV
 * head h at a time, a run of rows in one block at a time: the block's scale, scales[block * Hkv + h], grows to the
 * head's largest |element| / 127 where the run's exceeds what it holds (the codes written before in the block
 * requantized to it: a second rounding, one for each growth), and starts afresh with a block's first slot. A block
 * written in one call (a prompt's) has its exact scale and each code rounded once. */
static void store_codes(const float *x, int64_t x_row, int64_t x_col, const int64_t *slots, int64_t num_rows,
                        int64_t num_kv_heads, int64_t D, int64_t block_size, int8_t *cache, float *scales) {
#pragma omp parallel for schedule(static) if (num_rows * num_kv_heads * D >= PARALLEL_MIN)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t t = 0, u; t < num_rows; t = u) {
            const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
            float top = 0.0f;
            for (u = t; u < num_rows && slots[u] == slots[t] + (u - t) && slots[u] / block_size == block; ++u)
                for (int64_t d = 0; d < D; ++d) top = fmaxf(top, fabsf(x[u * x_row + (h * D + d) * x_col]));
            float *scale = scales + block * num_kv_heads + h;
            if (offset == 0) *scale = 0.0f;
            if (top > *scale * 127.0f) { /* the block's earlier codes to the larger scale */
                const float grown = top / 127.0f, ratio = *scale / grown;
                for (int64_t o = 0; o < offset; ++o) {
                    int8_t *restrict c = cache + (block * block_size + o) * num_kv_heads * D + h * D;
                    for (int64_t d = 0; d < D; ++d) c[d] = (int8_t)lrintf((float)c[d] * ratio);
                }
                *scale = grown;
            }
            const float inv = *scale > 0.0f ? 1.0f / *scale : 0.0f;
            for (int64_t r = t; r < u; ++r) {
                const float *restrict src = x + r * x_row + h * D * x_col;
                int8_t *restrict dst = cache + slots[r] * num_kv_heads * D + h * D;
                for (int64_t d = 0; d < D; ++d) {
                    const float c = rintf(src[d * x_col] * inv);
                    dst[d] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
                }
            }
        }
    }
}

/* Writes the new tokens' keys and values as int8 codes with scales per block and KV head (store_codes): row t of k
 * and v ([T, Hkv * D] at strides (row, col)) to slot slots[t] of k_cache and v_cache ([num_slots, Hkv * D]), their
 * scales in k_scales and v_scales ([num_slots / block_size, Hkv]). Returns -1, writing nothing, when a slot is out
 * of range. */
int store_kv_i8(const float *k, int64_t k_row, int64_t k_col, const float *v, int64_t v_row, int64_t v_col,
                const int64_t *slots, int64_t num_rows, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int8_t *k_cache, int8_t *v_cache, float *k_scales, float *v_scales, int64_t num_slots) {
    for (int64_t t = 0; t < num_rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    store_codes(k, k_row, k_col, slots, num_rows, num_kv_heads, head_dim, block_size, k_cache, k_scales);
    store_codes(v, v_row, v_col, slots, num_rows, num_kv_heads, head_dim, block_size, v_cache, v_scales);
    return 0;
}
#endif
