/* The library's entry points that decoder.c calls, and the fetch setting both attention builds read,
 * declared once: each defining file includes this header too, so a signature that drifts fails the build. */

#ifndef PAGED_KERNELS_H
#define PAGED_KERNELS_H

#include <stdint.h>

void rms_norm_f32(const float *x, int64_t ld_x, const float *residual, int64_t ld_r, const float *weight,
                  int64_t num_rows, int64_t n, float eps, float *out, float *residual_out, int64_t ld_out);
void silu_and_mul_f32(const float *x, int64_t ld_x, int64_t num_rows, int64_t inter, float *out, int64_t ld_out);
int rotary_f32(const float *q, int64_t ld_q, const float *k, int64_t ld_k, const int64_t *positions,
               const float *cos_sin, int64_t num_positions, int64_t num_rows, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t rot, float *q_out, int64_t ld_q_out, float *k_out,
               int64_t ld_k_out);

void linear_f32(const float *x, int64_t ld_x, int64_t M, const float *packed, int64_t N, int64_t K,
                const float *bias, float *y, int64_t ld_y);
int linear_bf16(const float *x, int64_t ld_x, int64_t M, const uint16_t *packed, int64_t N, int64_t K,
                const float *bias, float *y, int64_t ld_y);
int linear_q8_f32(const float *x, int64_t ld_x, int64_t M, const uint8_t *codes, const float *scales, int64_t N,
                  int64_t K, const float *bias, float *y, int64_t ld_y, int bf16_products);
/* One part of a weight in a ggml type (linear_ggml.c): `rows` consecutive output columns, each a row of K
 * features as the GGUF file stores it. */
typedef struct {
    const uint8_t *data;
    int64_t rows;
    int32_t type;
    int32_t reserved;
} ggml_part;
int linear_ggml_f32(const float *x, int64_t ld_x, int64_t M, const ggml_part *parts, int64_t num_parts, int64_t K,
                    const float *bias, float *y, int64_t ld_y);
int linear_w8a8_f32(const float *x, int64_t ld_x, int64_t M, const uint8_t *codes, const float *scales, int64_t N,
                    int64_t K, const float *bias, float *y, int64_t ld_y);

#define PAGED_ATTENTION_ARGS(kv_t)                                                                                   \
    const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache, const kv_t *v_cache,          \
        const int32_t *block_tables, int64_t table_stride, const int64_t *seq_lens, int64_t num_rows,                \
        const int64_t *tile_rows, const int64_t *tile_starts, const int64_t *tile_shared, int64_t num_tiles,         \
        float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, \
        float scale, int64_t window, float softcap
#define STORE_KV_ARGS(kv_t)                                                                                           \
    const float *k, int64_t k_row, int64_t k_col, const float *v, int64_t v_row, int64_t v_col, const int64_t *slots, \
        int64_t num_rows, int64_t width, kv_t *k_cache, kv_t *v_cache, int64_t num_slots
/* When paged_attention splits rows by keys (attention_split.h): never, with fewer rows than threads and a long
 * context, always. */
enum { ATTENTION_SPLIT_OFF = 0, ATTENTION_SPLIT_AUTO = 1, ATTENTION_SPLIT_ALWAYS = 2 };
extern int attention_split; /* attention_split.h: an ATTENTION_SPLIT_ value */
void attention_split_mode(int mode);
extern int attention_fetch_l2; /* attention.c: whether its kernels fetch ahead into L2 only */
void attention_fetch_into(int level);
int attention_fetch_level(void);
int paged_attention_f32(PAGED_ATTENTION_ARGS(float));
int paged_attention_bf16(PAGED_ATTENTION_ARGS(uint16_t));
int store_kv_f32(STORE_KV_ARGS(float));
int store_kv_bf16(STORE_KV_ARGS(uint16_t));
int paged_attention_i8(PAGED_ATTENTION_ARGS(int8_t), const float *k_scales, const float *v_scales);
int store_kv_i8(const float *k, int64_t k_row, int64_t k_col, const float *v, int64_t v_row, int64_t v_col,
                const int64_t *slots, int64_t num_rows, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int8_t *k_cache, int8_t *v_cache, float *k_scales, float *v_scales, int64_t num_slots);

#endif
