/* Paged decode attention for the CPU, float32.
 *
 * One query token per sequence attends over its whole context, read in place from the
 * paged cache (no gather into a contiguous copy). Work items are (sequence, KV head)
 * pairs, split across OpenMP threads in order, so rows that share prefix blocks read
 * them while they are still in cache; an item serves the G query heads of its KV group
 * together. Softmax is online per block of the table: running max, running sum,
 * rescaled accumulator.
 *
 * Built at run time with -O3 -march=native -fopenmp. Vectors are GCC's generic vector
 * type of 8 floats (one AVX register; two SSE or NEON registers elsewhere), so the same
 * source builds on any target; head_dim must be a multiple of 8.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256
#define VL 8 /* floats per vector; GCC lowers the vector type to what the target has */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
typedef float vf_unaligned __attribute__((vector_size(VL * sizeof(float)), aligned(4)));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf x) { *(vf_unaligned *)p = x; }
static inline vf splat(float x) { return (vf){0} + x; }

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += x[i];
    return s;
}

/* Pairwise sums inside each half, as x86's haddps: [a0+a1, a2+a3, b0+b1, b2+b3 | same for 4..7]. */
static inline vf hadd(vf a, vf b) {
    return __builtin_shuffle(a, b, (vi){0, 2, 8, 10, 4, 6, 12, 14}) +
           __builtin_shuffle(a, b, (vi){1, 3, 9, 11, 5, 7, 13, 15});
}

/* The four horizontal sums of a0..a3, stored to out[0..3]. */
static inline void hsum4(vf a0, vf a1, vf a2, vf a3, float *out) {
    const vf t = hadd(hadd(a0, a1), hadd(a2, a3)); /* [sum0..3 of the low halves | of the high halves] */
    for (int i = 0; i < 4; ++i) out[i] = t[i] + t[i + 4];
}

/* exp(x) for x <= 0: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2, degree-6 Taylor
 * polynomial (relative error under 2e-7). Exactly 0 below -30 (and for -inf): a weight
 * under exp(-30) of the row's maximum is far below float32's resolution of the sum, and
 * cutting there keeps denormals (slow on x86) out of the accumulators. */
static inline vf vexp(vf x) {
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vi cut = x < -30.0f;
    x = (vf)(((vi)x & ~cut) | ((vi)splat(-30.0f) & cut));
    const vf shifted = x * 1.44269504088896341f + magic;
    const vf n = shifted - magic;
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 split in two for precision */
    vf p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi bits = ((vi)shifted - (vi)magic) << 23; /* n in the exponent field */
    const vf result = (vf)((vi)p + bits);
    return (vf)((vi)result & ~cut);
}

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
        block_scores(q, k, n, token_stride, G, D, scores);
        for (int g = 0; g < G; ++g) {
            float *restrict sg = scores + g * MAX_BLOCK_SIZE;
            for (int64_t t = n; t < padded; ++t) sg[t] = -INFINITY; /* exp -> 0 */
            float block_max = sg[0];
            for (int64_t t = 1; t < n; ++t) block_max = sg[t] > block_max ? sg[t] : block_max;
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

/* q [B, Hq, D], caches [num_blocks, block_size, Hkv, D], block_tables [B, table_stride],
 * seq_lens [B]: context length of each row, its new token included. out [B, Hq, D].
 * Returns 0, or -1 when a dimension exceeds the kernel's fixed limits (the caller
 * checks them first). */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
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
        const float *qi = q + row * D;
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
