/* The element-wise parts of a decoder layer for the CPU, float32: RMSNorm (with the
 * residual add before it), rotary embedding, SiLU-and-multiply.
 *
 * At decode sizes (tens of rows) each of these is a few microseconds of arithmetic, so
 * what they replace is mostly per-operator overhead: PyTorch runs RMSNorm as seven ops
 * and rotary as a dozen. A tensor [T, F] comes either row-major (element (t, f) at
 * t * ld + f) or column-major (at f * ld + t: the transposed views the CPU linear layer
 * returns for small batches); every tensor of one call has the same layout, and the
 * loops run along the contiguous axis either way, so they vectorize.
 */

#include "vec.h"

#define TILE 16 /* rows per tile of the column-major loops: two vectors, and work for two threads at 32 rows */

/* residual_out = x + residual (when residual is not NULL); out = rms_norm(that) * weight.
 * x, residual, out, residual_out: [T, n] in one layout, leading dimensions ld_x, ld_r, ld_out. */
void rms_norm_f32(const float *x, int64_t ld_x, const float *residual, int64_t ld_r, const float *weight,
                  int64_t num_rows, int64_t n, float eps, int col_major, float *out, float *residual_out,
                  int64_t ld_out) {
    if (!col_major) {
#pragma omp parallel for schedule(static) if (num_rows * n >= PARALLEL_MIN)
        for (int64_t t = 0; t < num_rows; ++t) {
            const float *restrict h = x + t * ld_x;
            if (residual != NULL) {
                const float *restrict r = residual + t * ld_r;
                float *restrict ro = residual_out + t * ld_out;
                for (int64_t i = 0; i < n; ++i) ro[i] = h[i] + r[i];
                h = ro;
            }
            vf acc = {0};
            int64_t i = 0;
            for (; i + VL <= n; i += VL) acc += load(h + i) * load(h + i);
            float sum = hsum(acc);
            for (; i < n; ++i) sum += h[i] * h[i];
            const float inv = 1.0f / sqrtf(sum / (float)n + eps);
            float *restrict o = out + t * ld_out;
            for (i = 0; i < n; ++i) o[i] = weight[i] * (h[i] * inv);
        }
        return;
    }
#pragma omp parallel for schedule(static) if (num_rows * n >= PARALLEL_MIN)
    for (int64_t t0 = 0; t0 < num_rows; t0 += TILE) {
        const int64_t m = num_rows - t0 < TILE ? num_rows - t0 : TILE;
        float sum[TILE] = {0}, inv[TILE];
        const float *h = x + t0;
        int64_t ld_h = ld_x;
        if (residual != NULL) {
            for (int64_t i = 0; i < n; ++i) {
                const float *restrict xi = x + i * ld_x + t0, *restrict ri = residual + i * ld_r + t0;
                float *restrict ro = residual_out + i * ld_out + t0;
                for (int64_t t = 0; t < m; ++t) ro[t] = xi[t] + ri[t];
            }
            h = residual_out + t0;
            ld_h = ld_out;
        }
        for (int64_t i = 0; i < n; ++i) {
            const float *restrict hi = h + i * ld_h;
            for (int64_t t = 0; t < m; ++t) sum[t] += hi[t] * hi[t];
        }
        for (int64_t t = 0; t < m; ++t) inv[t] = 1.0f / sqrtf(sum[t] / (float)n + eps);
        for (int64_t i = 0; i < n; ++i) {
            const float *restrict hi = h + i * ld_h;
            float *restrict oi = out + i * ld_out + t0;
            const float w = weight[i];
            for (int64_t t = 0; t < m; ++t) oi[t] = w * (hi[t] * inv[t]);
        }
    }
}

/* silu(g) * u with silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) so that it never overflows. */
static inline vf silu_mul(vf g, vf u) {
    const vi negative = g < 0.0f;
    const vf e = vexp((vf)((vi)g | ((vi){0} + INT32_MIN))); /* exp(-|g|): the sign bit set */
    const vf numerator = (vf)(((vi)e & negative) | ((vi)splat(1.0f) & ~negative));
    return g * (numerator / (1.0f + e)) * u;
}

static inline float silu_mul_scalar(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* x: [T, 2I] = [gate | up]; out: [T, I] = silu(gate) * up, both in one layout. */
void silu_and_mul_f32(const float *x, int64_t ld_x, int64_t num_rows, int64_t inter, int col_major, float *out,
                      int64_t ld_out) {
    /* A row-major row is one contiguous run of I; a column-major feature one run of T. */
    const int64_t lines = col_major ? inter : num_rows, len = col_major ? num_rows : inter;
    const int64_t up_offset = col_major ? inter * ld_x : inter;
#pragma omp parallel for schedule(static) if (num_rows * inter >= PARALLEL_MIN)
    for (int64_t line = 0; line < lines; ++line) {
        const float *restrict gate = x + line * ld_x, *restrict up = gate + up_offset;
        float *restrict o = out + line * ld_out;
        int64_t i = 0;
        for (; i + VL <= len; i += VL) store(o + i, silu_mul(load(gate + i), load(up + i)));
        for (; i < len; ++i) o[i] = silu_mul_scalar(gate[i], up[i]);
    }
}

/* Rotary embedding, "rotate half" form, of the first rot columns of every head of
 * x [T, H * D] into out (same layout); the other columns are copied. cos_sin: [P, rot],
 * the cos of the rot / 2 frequencies, then their sin. */
static void rotary_one(const float *x, int64_t ld_x, float *out, int64_t ld_out, const int64_t *positions,
                       const float *cos_sin, int64_t num_rows, int64_t num_heads, int64_t head_dim, int64_t rot,
                       int col_major) {
    const int64_t half = rot / 2;
    if (!col_major) {
#pragma omp parallel for schedule(static) if (num_rows * num_heads * head_dim >= PARALLEL_MIN)
        for (int64_t t = 0; t < num_rows; ++t) {
            const float *restrict cos = cos_sin + positions[t] * rot, *restrict sin = cos + half;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *restrict v = x + t * ld_x + h * head_dim;
                float *restrict o = out + t * ld_out + h * head_dim;
                for (int64_t i = 0; i < half; ++i) {
                    o[i] = v[i] * cos[i] - v[i + half] * sin[i];
                    o[i + half] = v[i + half] * cos[i] + v[i] * sin[i];
                }
                for (int64_t i = rot; i < head_dim; ++i) o[i] = v[i];
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) if (num_rows * num_heads * head_dim >= PARALLEL_MIN)
    for (int64_t t0 = 0; t0 < num_rows; t0 += TILE) {
        const int64_t m = num_rows - t0 < TILE ? num_rows - t0 : TILE;
        float cos[TILE], sin[TILE];
        for (int64_t i = 0; i < half; ++i) {
            for (int64_t t = 0; t < m; ++t) {
                cos[t] = cos_sin[positions[t0 + t] * rot + i];
                sin[t] = cos_sin[positions[t0 + t] * rot + half + i];
            }
            for (int64_t h = 0; h < num_heads; ++h) {
                const int64_t f = h * head_dim + i;
                const float *restrict a = x + f * ld_x + t0, *restrict b = a + half * ld_x;
                float *restrict oa = out + f * ld_out + t0, *restrict ob = oa + half * ld_out;
                for (int64_t t = 0; t < m; ++t) {
                    oa[t] = a[t] * cos[t] - b[t] * sin[t];
                    ob[t] = b[t] * cos[t] + a[t] * sin[t];
                }
            }
        }
        for (int64_t h = 0; h < num_heads; ++h)
            for (int64_t i = rot; i < head_dim; ++i) {
                const int64_t f = h * head_dim + i;
                memcpy(out + f * ld_out + t0, x + f * ld_x + t0, sizeof(float) * (size_t)m);
            }
    }
}

/* Rotary embedding of q [T, Hq * D] and k [T, Hkv * D] at positions [T] into q_out and
 * k_out; all four in one layout. Returns -1, writing nothing, when a position is outside
 * [0, num_positions), the rows of cos_sin. */
int rotary_f32(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const int64_t *positions,
               const float *cos_sin, int64_t num_positions, int64_t num_rows, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t rot, int col_major, float *q_out, int64_t ld_q_out,
               float *k_out, int64_t ld_k_out) {
    for (int64_t t = 0; t < num_rows; ++t)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    rotary_one(q, ld_q, q_out, ld_q_out, positions, cos_sin, num_rows, num_heads, head_dim, rot, col_major);
    rotary_one(k, ld_k, k_out, ld_k_out, positions, cos_sin, num_rows, num_kv_heads, head_dim, rot, col_major);
    return 0;
}
