/* Vector helpers shared by the CPU kernels: float32 vectors, and bfloat16 loads that widen to them.
 *
 * Vectors are GCC's generic vector type of 8 floats (one AVX register; two SSE or NEON
 * registers elsewhere), so the same source builds on any target.
 */

#ifndef PAGED_VEC_H
#define PAGED_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define VL 8 /* floats per vector; GCC lowers the vector type to what the target has */
#define PARALLEL_MIN (1 << 13) /* elements below which one thread is faster than waking the others */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
/* 16 floats: one AVX-512 register, two AVX ones elsewhere (GCC splits the operations) */
typedef float vf16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t vi16 __attribute__((vector_size(16 * sizeof(int32_t))));
typedef float vf_unaligned __attribute__((vector_size(VL * sizeof(float)), aligned(4)));
typedef uint16_t vh_unaligned __attribute__((vector_size(VL * sizeof(uint16_t)), aligned(2)));

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf x) { *(vf_unaligned *)p = x; }
/* bfloat16 is the upper half of a float32: widening is a 16-bit shift, exact. */
static inline vf load_bf16(const uint16_t *p) {
#ifdef __AVX2__ /* GCC lowers the generic widening to two half-width conversions */
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vh_unaligned *)p, vi) << 16);
#endif
}
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* float32 to bfloat16, rounded to nearest even as torch rounds; a NaN stays a quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += x[i];
    return s;
}

/* exp(x) for x <= 0: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2, degree-6 Taylor
 * polynomial (relative error under 2e-7). Exactly 0 below -30 (and for -inf): a weight
 * under exp(-30) of the row's maximum is far below float32's resolution of the sum, and
 * cutting there keeps denormals (slow on x86) out of the accumulators. DEFINE_VEXP makes it
 * for a float vector type F and its int32 twin I: vexp for vf, vexp16 for 16 lanes. */
#define DEFINE_VEXP(name, F, I)                                                                  \
    static inline F name(F x) {                                                                  \
        const F magic = (F){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */   \
        const I cut = x < -30.0f;                                                                \
        x = (F)(((I)x & ~cut) | ((I)((F){0} - 30.0f) & cut));                                    \
        const F shifted = x * 1.44269504088896341f + magic;                                      \
        const F n = shifted - magic;                                                             \
        const F r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln2 split in two for precision */ \
        F p = (F){0} + 1.0f / 720.0f;                                                            \
        p = p * r + 1.0f / 120.0f;                                                               \
        p = p * r + 1.0f / 24.0f;                                                                \
        p = p * r + 1.0f / 6.0f;                                                                 \
        p = p * r + 0.5f;                                                                        \
        p = p * r + 1.0f;                                                                        \
        p = p * r + 1.0f;                                                                        \
        const I bits = ((I)shifted - (I)magic) << 23; /* n in the exponent field */              \
        const F result = (F)((I)p + bits);                                                       \
        return (F)((I)result & ~cut);                                                            \
    }
DEFINE_VEXP(vexp, vf, vi)
DEFINE_VEXP(vexp16, vf16, vi16)

#endif
