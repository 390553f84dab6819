/* Paged decode attention for the CPU, float32.
 *
 * One query token per sequence attends over its whole context, read in place from the
 * paged cache (no gather into a contiguous copy). Work items are (sequence, KV head)
 * pairs, split across OpenMP threads in order, so rows that share prefix blocks read
 * them while they are still in cache; an item serves the G query heads of its KV group
 * together. Softmax is online per block of the table: running max, running sum,
 * rescaled accumulator.
 *
 * Built at run time with -O3 -march=native -fopenmp; vectors as in vec.h, so head_dim
 * must be a multiple of 8.
 */

#include "vec.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

/* Scores of the G queries at q against n key rows (stride token_stride) into
 * scores[g * MAX_BLOCK_SIZE + t]: four rows at a time, four independent FMA chains. */
static inline __attribute__((always_inline)) void block_scores(const float *restrict q, const float *restrict k,
                                                               int64_t n, int64_t token_stride, int G,
                                                               const int D, float *restrict scores) {
    for (int g = 0; g < G; ++g) {
        const float *restrict qg = q + g * D;
        float *restrict sg = scores + g * MAX_BLOCK_SIZE;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            const float *k0 = k + t * token_stride, *k1 = k0 + token_stride;
            const float *k2 = k1 + token_stride, *k3 = k2 + token_stride;
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int c = 0; c < D; c += VL) {
                const vf qv = load(qg + c);
                a0 += qv * load(k0 + c);
                a1 += qv * load(k1 + c);
                a2 += qv * load(k2 + c);
                a3 += qv * load(k3 + c);
            }
            hsum4(a0, a1, a2, a3, sg + t);
        }
        for (; t < n; ++t) {
            const float *kt = k + t * token_stride;
            vf a = {0};
            for (int c = 0; c < D; c += VL) a += load(qg + c) * load(kt + c);
            sg[t] = hsum(a);
        }
    }
}

/* Attention of the G queries at q_raw over context positions [0, end) of one sequence,
 * for the KV head at head_offset; writes out[G * D]. D is a compile-time constant in
 * the callers, so a query head's accumulator lives in registers. */
static inline __attribute__((always_inline)) void attend(const float *restrict q_raw, const float *restrict k_cache,
                                                         const float *restrict v_cache,
                                                         const int32_t *restrict table, int64_t end,
                                                         int64_t block_size, int64_t token_stride,
                                                         int64_t head_offset, int G, const int D, float scale,
                                                         float *restrict out) {
    float q[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM];
    float scores[MAX_GROUP * MAX_BLOCK_SIZE];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int i = 0; i < G * D; ++i) q[i] = q_raw[i] * scale;
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t pos = 0; pos < end;) {
        const int64_t offset = pos % block_size;
        const int64_t n = (block_size - offset < end - pos) ? block_size - offset : end - pos;
        const int64_t padded = (n + VL - 1) / VL * VL;
        const int64_t base = ((int64_t)table[pos / block_size] * block_size + offset) * token_stride + head_offset;
        const float *restrict k = k_cache + base;
        const float *restrict v = v_cache + base;
        if (pos + n < end) { /* the next block sits anywhere in the cache: fetch it while this one computes */
            const int64_t next = (int64_t)table[(pos + n) / block_size] * block_size * token_stride + head_offset;
            const int64_t rows = end - pos - n < block_size ? end - pos - n : block_size;
            for (int64_t t = 0; t < rows; ++t)
                for (int c = 0; c < D; c += 16) {
                    __builtin_prefetch(k_cache + next + t * token_stride + c);
                    __builtin_prefetch(v_cache + next + t * token_stride + c);
                }
        }
        block_scores(q, k, n, token_stride, G, D, scores);
        for (int g = 0; g < G; ++g) {
            float *restrict sg = scores + g * MAX_BLOCK_SIZE;
            for (int64_t t = n; t < padded; ++t) sg[t] = -INFINITY; /* exp -> 0 */
            vf vmax = load(sg);
            for (int64_t t = VL; t < padded; t += VL) vmax = vmaxf(vmax, load(sg + t));
            const float block_max = hmax(vmax);
            const float new_max = block_max > m[g] ? block_max : m[g];
            const float correction = m[g] == -INFINITY ? 0.0f : expf(m[g] - new_max);
            vf sum = {0};
            for (int64_t t = 0; t < padded; t += VL) {
                const vf p = vexp(load(sg + t) - new_max);
                store(sg + t, p);
                sum += p;
            }
            l[g] = l[g] * correction + hsum(sum);
            m[g] = new_max;
            vf a[MAX_HEAD_DIM / VL];
            for (int c = 0; c < D / VL; ++c) a[c] = load(acc + g * D + c * VL) * correction;
            for (int64_t t = 0; t < n; ++t) {
                const vf p = splat(sg[t]);
                const float *restrict vt = v + t * token_stride;
                for (int c = 0; c < D / VL; ++c) a[c] += p * load(vt + c * VL);
            }
            for (int c = 0; c < D / VL; ++c) store(acc + g * D + c * VL, a[c]);
        }
        pos += n;
    }
    for (int g = 0; g < G; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
    }
}

#define ATTEND_ARGS                                                                                              \
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t end, int64_t block_size, \
        int64_t token_stride, int64_t head_offset, int G, float scale, float *out
#define ATTEND_CALL(D) attend(q, k_cache, v_cache, table, end, block_size, token_stride, head_offset, G, D, scale, out)
static void attend_d64(ATTEND_ARGS) { ATTEND_CALL(64); }
static void attend_d128(ATTEND_ARGS) { ATTEND_CALL(128); }
static void attend_any(ATTEND_ARGS, int D) { ATTEND_CALL(D); }

/* q [B, Hq, D] at strides (q_row, q_head, q_col), caches [num_blocks, block_size, Hkv, D],
 * block_tables [B, table_stride], seq_lens [B]: context length of each row, its new
 * token included. out: contiguous [B, Hq, D].
 * Returns 0, or -1 when a dimension exceeds the kernel's fixed limits (the caller
 * checks them first). */
int paged_decode_attention_f32(const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t table_stride, const int64_t *seq_lens, float *out,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale) {
    const int G = (int)(num_heads / num_kv_heads);
    const int D = (int)head_dim;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || D % VL != 0 || block_size > MAX_BLOCK_SIZE) return -1;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t row = i * num_heads + h * G; /* first query head of this KV group */
        float qi[MAX_GROUP * MAX_HEAD_DIM];
        for (int g = 0; g < G; ++g)
            for (int d = 0; d < D; ++d) qi[g * D + d] = q[i * q_row + (h * G + g) * q_head + d * q_col];
        const int32_t *table = block_tables + i * table_stride;
        if (D == 64)
            attend_d64(qi, k_cache, v_cache, table, seq_lens[i], block_size, token_stride, h * head_dim, G, scale,
                       out + row * D);
        else if (D == 128)
            attend_d128(qi, k_cache, v_cache, table, seq_lens[i], block_size, token_stride, h * head_dim, G, scale,
                        out + row * D);
        else
            attend_any(qi, k_cache, v_cache, table, seq_lens[i], block_size, token_stride, h * head_dim, G, scale,
                       out + row * D, D);
    }
    return 0;
}

/* Writes the new tokens' keys and values into the paged caches: row t of k and v
 * ([T, width] at strides (row, col), width = Hkv * D) goes to slot slots[t] (block *
 * block_size + offset) of k_cache and v_cache ([num_slots, width]). Returns -1, writing
 * nothing, when a slot is out of range. */
int store_kv_f32(const float *k, int64_t k_row, int64_t k_col, const float *v, int64_t v_row, int64_t v_col,
                 const int64_t *slots, int64_t num_rows, int64_t width, float *k_cache, float *v_cache,
                 int64_t num_slots) {
    for (int64_t t = 0; t < num_rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    if (k_row == 1 && v_row == 1) { /* column-major rows: read along the contiguous axis */
        for (int64_t f = 0; f < width; ++f)
            for (int64_t t = 0; t < num_rows; ++t) {
                k_cache[slots[t] * width + f] = k[f * k_col + t];
                v_cache[slots[t] * width + f] = v[f * v_col + t];
            }
        return 0;
    }
    for (int64_t t = 0; t < num_rows; ++t) {
        float *restrict kd = k_cache + slots[t] * width, *restrict vd = v_cache + slots[t] * width;
        const float *restrict ks = k + t * k_row, *restrict vs = v + t * v_row;
        for (int64_t f = 0; f < width; ++f) {
            kd[f] = ks[f * k_col];
            vd[f] = vs[f * v_col];
        }
    }
    return 0;
}
