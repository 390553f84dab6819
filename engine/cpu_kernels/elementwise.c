/* The element-wise parts of a decoder layer for the CPU, float32: RMSNorm (with the
 * residual add before it), rotary embedding, SiLU-and-multiply.
 *
 * At decode sizes (tens of rows) each of these is a few microseconds of arithmetic, so
 * what they replace is mostly per-operator overhead: PyTorch runs RMSNorm as seven ops
 * and rotary as a dozen. A tensor [T, F] is row-major with a leading dimension (element
 * (t, f) at t * ld + f), so a slice of a fused projection's output is read in place, and
 * the loops run along its contiguous rows.
 */

#include "vec.h"
#include "kernels.h"

/* residual_out = x + residual (when residual is not NULL); out = rms_norm(that) * weight.
 * x, residual, out, residual_out: [T, n], leading dimensions ld_x, ld_r, ld_out. */
void rms_norm_f32(const float *x, int64_t ld_x, const float *residual, int64_t ld_r, const float *weight,
                  int64_t num_rows, int64_t n, float eps, float *out, float *residual_out, int64_t ld_out) {
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
}

/* silu(g) * u with silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) so that it never overflows; for a float
 * vector type F, its int32 twin I and their exp. Each lane's arithmetic is the same at any width, so are its bits. */
#define DEFINE_SILU_MUL(name, F, I, EXP)                                                   \
    static inline void name(const float *gate, const float *up, float *out) {             \
        F g, u;                                                                            \
        memcpy(&g, gate, sizeof g);                                                        \
        memcpy(&u, up, sizeof u);                                                          \
        const I negative = g < 0.0f;                                                       \
        const F e = EXP((F)((I)g | ((I){0} + INT32_MIN))); /* exp(-|g|): the sign bit set */ \
        const F numerator = (F)(((I)e & negative) | ((I)((F){0} + 1.0f) & ~negative));    \
        const F y = g * (numerator / (1.0f + e)) * u;                                      \
        memcpy(out, &y, sizeof y);                                                         \
    }
DEFINE_SILU_MUL(silu_mul8, vf, vi, vexp)
DEFINE_SILU_MUL(silu_mul16, vf16, vi16, vexp16)

static inline float silu_mul_scalar(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* x: [T, 2I] = [gate | up]; out: [T, I] = silu(gate) * up: 16 lanes a step where the build has AVX-512, then 8. */
void silu_and_mul_f32(const float *x, int64_t ld_x, int64_t num_rows, int64_t inter, float *out, int64_t ld_out) {
#pragma omp parallel for schedule(static) if (num_rows * inter >= PARALLEL_MIN)
    for (int64_t t = 0; t < num_rows; ++t) {
        const float *restrict gate = x + t * ld_x, *restrict up = gate + inter;
        float *restrict o = out + t * ld_out;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inter; i += 16) silu_mul16(gate + i, up + i, o + i);
#endif
        for (; i + VL <= inter; i += VL) silu_mul8(gate + i, up + i, o + i);
        for (; i < inter; ++i) o[i] = silu_mul_scalar(gate[i], up[i]);
    }
}

/* Rotary embedding, "rotate half" form, of the first rot columns of every head of
 * x [T, H * D] into out; the other columns are copied. cos_sin: [P, rot], the cos of the
 * rot / 2 frequencies, then their sin. */
static void rotary_one(const float *x, int64_t ld_x, float *out, int64_t ld_out, const int64_t *positions,
                       const float *cos_sin, int64_t num_rows, int64_t num_heads, int64_t head_dim, int64_t rot) {
    const int64_t half = rot / 2;
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
}

/* Rotary embedding of q [T, Hq * D] and k [T, Hkv * D] at positions [T] into q_out and
 * k_out. Returns -1, writing nothing, when a position is outside [0, num_positions), the
 * rows of cos_sin. */
int rotary_f32(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const int64_t *positions,
               const float *cos_sin, int64_t num_positions, int64_t num_rows, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t rot, float *q_out, int64_t ld_q_out, float *k_out,
               int64_t ld_k_out) {
    for (int64_t t = 0; t < num_rows; ++t)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    rotary_one(q, ld_q, q_out, ld_q_out, positions, cos_sin, num_rows, num_heads, head_dim, rot);
    rotary_one(k, ld_k, k_out, ld_k_out, positions, cos_sin, num_rows, num_kv_heads, head_dim, rot);
    return 0;
}
