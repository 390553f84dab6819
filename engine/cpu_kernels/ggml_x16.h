/* Weights of Q4_0, Q8_0, Q4_K, Q5_K and Q6_K repacked at load into groups of 16 rows ("x16"), so that one 512-bit vector
 * holds the same 4 bytes of 16 rows and a dot product yields 16 output columns at once (ggml_avx512.h), with
 * the 16 rows' scales side by side for one conversion (llama.cpp's repacked "Q4_0_8x8" idea, 16 rows wide).
 *
 * A group is 16 rows of the file's type in the same bytes, block after block (block i of the 16 rows, then
 * block i + 1); within a block, each 4-byte unit of the file's block is stored as 16 units side by side (row
 * r's at 4 r), and the f16 scales as 16 f16. x16_offset gives where byte j of row r's block lands:
 *   Q4_0 (288 bytes a block): d[16], then qs in 4 units of [16 rows][4 bytes];
 *   Q8_0 (544): d[16], then qs in 8 units of [16][4], each code stored as q + 128 (its top bit flipped), the
 *     unsigned operand VPDPBUSD takes;
 *   Q4_K (2304): d[16], dmin[16], the 12 scale bytes as 3 units of [16][4], then qs in 32 units of [16][4];
 *   Q5_K (2816): Q4_K's d, dmin and scales, then qh in 8 units of [16][4] (from 256), then qs in 32 (from 768);
 *   Q6_K (3360): d[16], the 16 int8 scales as [16 scales][16 rows], then the codes in the order the kernel reads
 *     them: for each half h and unit c of 8, ql's units 16 h + c and 16 h + 8 + c and qh's unit 8 h + c.
 * A part keeps its rows' count and bytes; its type id becomes the x16 one (GGML_X16 + the file's type), which
 * every path serves (the ones without 16-row kernels unpack a row to the file's layout first).
 */

#ifndef PAGED_GGML_X16_H
#define PAGED_GGML_X16_H

#include "ggml_blocks.h"

#define X16 16            /* rows of a group */

static inline int ggml_is_x16(int type) { return type >= GGML_X16; }
static inline int ggml_base_type(int type) { return type >= GGML_X16 ? type - GGML_X16 : type; }

/* The type's x16 id, or -1 where it has no x16 layout. */
static inline int ggml_x16_type(int type) {
    return type == GGML_Q4_0 || type == GGML_Q8_0 || type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K
               ? GGML_X16 + type
               : -1;
}

/* Bytes of one block of the (file's) type, and its features. */
static inline int64_t ggml_block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return sizeof(block_q4_0);
    case GGML_Q8_0: return sizeof(block_q8_0);
    case GGML_Q4_K: return sizeof(block_q4_K);
    case GGML_Q5_K: return sizeof(block_q5_K);
    case GGML_Q6_K: return sizeof(block_q6_K);
    default: return 0;
    }
}

/* Where byte j of row r's block lands in the group's block of 16 (type: the file's). */
static inline int64_t x16_offset(int type, int r, int j) {
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q8_0:
        if (j < 2) return 2 * r + j;
        j -= 2;
        return 32 + 64 * (j / 4) + 4 * r + j % 4;
    case GGML_Q4_K:
    case GGML_Q5_K: /* Q5_K: qh's 32 bytes between the scales and qs */
        if (j < 4) return 32 * (j / 2) + 2 * r + j % 2;
        if (j < 16) return 64 + 64 * ((j - 4) / 4) + 4 * r + (j - 4) % 4;
        j -= 16;
        return 256 + 64 * (j / 4) + 4 * r + j % 4;
    default: /* GGML_Q6_K: ql[128], qh[64], scales[16], d */
        if (j >= 208) return 2 * r + j - 208;
        if (j >= 192) return 32 + 16 * (j - 192) + r;
        if (j < 128) return 288 + 64 * (3 * (8 * (j / 64) + j % 32 / 4) + j % 64 / 32) + 4 * r + j % 4;
        j -= 128;
        return 288 + 64 * (3 * (8 * (j / 32) + j % 32 / 4) + 2) + 4 * r + j % 4;
    }
}

/* Features of a block of the (file's) type. */
static inline int64_t x16_block_features(int type) { return type == GGML_Q4_0 || type == GGML_Q8_0 ? QK : QK_K; }

/* What byte j of a block is XORed with in the x16 layout: Q8_0's codes get their top bit flipped (q + 128). */
static inline uint8_t x16_flip(int type, int j) { return type == GGML_Q8_0 && j >= 2 ? 0x80 : 0; }

/* Rows [16 g, 16 g + 16) of a tensor of the file's `type` (rows of K features) into group g of dst. */
static void x16_pack_group(int type, const uint8_t *src, int64_t K, uint8_t *dst) {
    const int64_t bb = ggml_block_bytes(type), nb = K / x16_block_features(type), row_bytes = nb * bb;
    for (int r = 0; r < X16; ++r)
        for (int64_t i = 0; i < nb; ++i)
            for (int j = 0; j < bb; ++j)
                dst[i * X16 * bb + x16_offset(type, r, j)] = src[r * row_bytes + i * bb + j] ^ x16_flip(type, j);
}

/* Row r of a group (x16 `type`) back in the file's layout, into row (its row bytes). */
static void x16_unpack_row(int type, const uint8_t *group, int r, int64_t K, uint8_t *row) {
    const int base = ggml_base_type(type);
    const int64_t bb = ggml_block_bytes(base), nb = K / x16_block_features(base);
    for (int64_t i = 0; i < nb; ++i)
        for (int j = 0; j < bb; ++j) row[i * bb + j] = group[i * X16 * bb + x16_offset(base, r, j)] ^ x16_flip(base, j);
}

#endif
