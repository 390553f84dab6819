/* The GGUF types' dot products in plain C, for any CPU: one weight row against one activation row.
 * Each sums its integer products exactly and scales them in float per block; linear_ggml.c runs these
 * where the CPU has no AVX2 (or where ggml_linear_limit caps it), and dequantize_row gives a row's
 * float weights (embedding lookups). */

#ifndef PAGED_GGML_GENERIC_H
#define PAGED_GGML_GENERIC_H

#include "ggml_blocks.h"
#include "vec.h"

/* --------------------------------------------------------------------------------- dequantization */

static void dequantize_row(int type, const uint8_t *row, int64_t K, float *out) {
    switch (type) {
    case GGML_F32: memcpy(out, row, K * sizeof(float)); return;
    case GGML_F16:
        for (int64_t k = 0; k < K; ++k) out[k] = f16_to_f32(((const uint16_t *)row)[k]);
        return;
    case GGML_BF16:
        for (int64_t k = 0; k < K; ++k) out[k] = bf16_to_f32(((const uint16_t *)row)[k]);
        return;
    case GGML_Q8_0:
        for (int64_t i = 0; i < K / QK; ++i) {
            const block_q8_0 *b = (const block_q8_0 *)row + i;
            const float d = f16_to_f32(b->d);
            for (int l = 0; l < QK; ++l) out[i * QK + l] = d * b->qs[l];
        }
        return;
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1:
        for (int64_t i = 0; i < K / QK; ++i) {
            float d, m;
            const uint8_t *qs;
            uint32_t qh = 0;
            int offset = 0; /* the code subtracted: 8 (Q4_0), 16 (Q5_0), 0 with an m */
            if (type == GGML_Q4_0) {
                const block_q4_0 *b = (const block_q4_0 *)row + i;
                d = f16_to_f32(b->d), m = 0.0f, qs = b->qs, offset = 8;
            } else if (type == GGML_Q4_1) {
                const block_q4_1 *b = (const block_q4_1 *)row + i;
                d = f16_to_f32(b->d), m = f16_to_f32(b->m), qs = b->qs;
            } else if (type == GGML_Q5_0) {
                const block_q5_0 *b = (const block_q5_0 *)row + i;
                d = f16_to_f32(b->d), m = 0.0f, qs = b->qs, offset = 16;
                memcpy(&qh, b->qh, 4);
            } else {
                const block_q5_1 *b = (const block_q5_1 *)row + i;
                d = f16_to_f32(b->d), m = f16_to_f32(b->m), qs = b->qs;
                memcpy(&qh, b->qh, 4);
            }
            for (int l = 0; l < QK / 2; ++l) {
                const int lo = (qs[l] & 15) | ((qh >> l) & 1) << 4, hi = (qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4;
                out[i * QK + l] = d * (lo - offset) + m;
                out[i * QK + l + QK / 2] = d * (hi - offset) + m;
            }
        }
        return;
    case GGML_Q4_K: case GGML_Q5_K:
        for (int64_t i = 0; i < K / QK_K; ++i) {
            const int q5 = type == GGML_Q5_K;
            const block_q4_K *b4 = (const block_q4_K *)row + i;
            const block_q5_K *b5 = (const block_q5_K *)row + i;
            const float d = f16_to_f32(q5 ? b5->d : b4->d), dmin = f16_to_f32(q5 ? b5->dmin : b4->dmin);
            const uint8_t *qs = q5 ? b5->qs : b4->qs;
            uint8_t sc[8], mn[8];
            k4_scales(q5 ? b5->scales : b4->scales, sc, mn);
            float *y = out + i * QK_K;
            for (int g = 0; g < 4; ++g) {
                for (int l = 0; l < 32; ++l) {
                    int lo = qs[32 * g + l] & 15, hi = qs[32 * g + l] >> 4;
                    if (q5) lo |= ((b5->qh[l] >> (2 * g)) & 1) << 4, hi |= ((b5->qh[l] >> (2 * g + 1)) & 1) << 4;
                    y[64 * g + l] = d * sc[2 * g] * lo - dmin * mn[2 * g];
                    y[64 * g + 32 + l] = d * sc[2 * g + 1] * hi - dmin * mn[2 * g + 1];
                }
            }
        }
        return;
    case GGML_Q6_K:
        for (int64_t i = 0; i < K / QK_K; ++i) {
            const block_q6_K *b = (const block_q6_K *)row + i;
            const float d = f16_to_f32(b->d);
            for (int h = 0; h < 2; ++h) { /* halves of 128 */
                const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
                const int8_t *sc = b->scales + 8 * h;
                float *y = out + i * QK_K + 128 * h;
                for (int l = 0; l < 32; ++l) {
                    const int s = l / 16;
                    y[l] = d * sc[s] * ((int)((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32);
                    y[l + 32] = d * sc[s + 2] * ((int)((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
                    y[l + 64] = d * sc[s + 4] * ((int)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
                    y[l + 96] = d * sc[s + 6] * ((int)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
                }
            }
        }
        return;
    }
}

/* ---------------------------------------------------------------------------- dot products, plain C */

/* Weight row w (K features, a legacy type) times one row of act_q8 blocks. */
static float dot_q8_generic(int type, const uint8_t *w, const act_q8 *a, int64_t K) {
    float acc = 0.0f;
    for (int64_t i = 0; i < K / QK; ++i) {
        int32_t sum = 0;
        float d, m = 0.0f;
        if (type == GGML_Q8_0) {
            const block_q8_0 *b = (const block_q8_0 *)w + i;
            for (int l = 0; l < QK; ++l) sum += b->qs[l] * a[i].qs[l];
            d = f16_to_f32(b->d);
        } else {
            const uint8_t *qs;
            uint32_t qh = 0;
            if (type == GGML_Q4_0) {
                const block_q4_0 *b = (const block_q4_0 *)w + i;
                qs = b->qs, d = f16_to_f32(b->d), m = -8.0f * d;
            } else if (type == GGML_Q4_1) {
                const block_q4_1 *b = (const block_q4_1 *)w + i;
                qs = b->qs, d = f16_to_f32(b->d), m = f16_to_f32(b->m);
            } else if (type == GGML_Q5_0) {
                const block_q5_0 *b = (const block_q5_0 *)w + i;
                qs = b->qs, d = f16_to_f32(b->d), m = -16.0f * d;
                memcpy(&qh, b->qh, 4);
            } else {
                const block_q5_1 *b = (const block_q5_1 *)w + i;
                qs = b->qs, d = f16_to_f32(b->d), m = f16_to_f32(b->m);
                memcpy(&qh, b->qh, 4);
            }
            for (int l = 0; l < QK / 2; ++l) {
                const int lo = (qs[l] & 15) | ((qh >> l) & 1) << 4, hi = (qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4;
                sum += lo * a[i].qs[l] + hi * a[i].qs[l + QK / 2];
            }
        }
        acc += d * a[i].d * (float)sum + m * a[i].s;
    }
    return acc;
}

/* Weight row w (K features, a K-quant type) times one row of act_q8_K super-blocks. */
static float dot_q8_K_generic(int type, const uint8_t *w, const act_q8_K *a, int64_t K) {
    float acc = 0.0f;
    for (int64_t i = 0; i < K / QK_K; ++i) {
        int32_t sum = 0;
        if (type == GGML_Q6_K) {
            const block_q6_K *b = (const block_q6_K *)w + i;
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
                const int8_t *sc = b->scales + 8 * h, *x = a[i].qs + 128 * h;
                for (int part = 0; part < 4; ++part) { /* 32 weights of two scales each */
                    int32_t s0 = 0, s1 = 0;
                    for (int l = 0; l < 32; ++l) {
                        const int low = part & 1 ? ql[l + 32] : ql[l];
                        const int q = ((part < 2 ? low & 15 : low >> 4) | ((qh[l] >> (2 * part)) & 3) << 4) - 32;
                        *(l < 16 ? &s0 : &s1) += q * x[32 * part + l];
                    }
                    sum += sc[2 * part] * s0 + sc[2 * part + 1] * s1;
                }
            }
            acc += f16_to_f32(b->d) * a[i].d * (float)sum;
        } else {
            const int q5 = type == GGML_Q5_K;
            const block_q4_K *b4 = (const block_q4_K *)w + i;
            const block_q5_K *b5 = (const block_q5_K *)w + i;
            const uint8_t *qs = q5 ? b5->qs : b4->qs;
            uint8_t sc[8], mn[8];
            k4_scales(q5 ? b5->scales : b4->scales, sc, mn);
            float mins = 0.0f;
            for (int g = 0; g < 4; ++g) {
                int32_t s0 = 0, s1 = 0;
                for (int l = 0; l < 32; ++l) {
                    int lo = qs[32 * g + l] & 15, hi = qs[32 * g + l] >> 4;
                    if (q5) lo |= ((b5->qh[l] >> (2 * g)) & 1) << 4, hi |= ((b5->qh[l] >> (2 * g + 1)) & 1) << 4;
                    s0 += lo * a[i].qs[64 * g + l];
                    s1 += hi * a[i].qs[64 * g + 32 + l];
                }
                sum += sc[2 * g] * s0 + sc[2 * g + 1] * s1;
                mins += mn[2 * g] * a[i].dsums[2 * g] + mn[2 * g + 1] * a[i].dsums[2 * g + 1];
            }
            acc += f16_to_f32(q5 ? b5->d : b4->d) * a[i].d * (float)sum - f16_to_f32(q5 ? b5->dmin : b4->dmin) * mins;
        }
    }
    return acc;
}

/* Weight row w (K features, F32 / F16 / BF16) times a float row. */
static float dot_float_generic(int type, const uint8_t *w, const float *x, int64_t K) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
        const float wk = type == GGML_F32   ? ((const float *)w)[k]
                         : type == GGML_F16 ? f16_to_f32(((const uint16_t *)w)[k])
                                            : bf16_to_f32(((const uint16_t *)w)[k]);
        acc += wk * x[k];
    }
    return acc;
}

#endif
