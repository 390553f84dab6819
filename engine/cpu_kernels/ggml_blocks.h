/* GGUF's tensor types as the file stores them (ggml's block layouts), and the int8 blocks that
 * activations are quantized into to multiply them (linear_ggml.c).
 *
 * A weight row of K input features is K / QK blocks of its type, one after another; a tensor is
 * its rows one after another. The types, by ggml's type id:
 *   F32 (0), F16 (1), BF16 (30): one value an element.
 *   Q8_0 (8): d (f16), 32 int8 q: w = d q.
 *   Q4_0 (2): d, 16 bytes of 4-bit q (byte j: q_j low nibble, q_{j+16} high): w = d (q - 8).
 *   Q4_1 (3): d, m (f16), 16 bytes of q as Q4_0: w = d q + m.
 *   Q5_0 (6), Q5_1 (7): as Q4_0 / Q4_1 with a fifth bit per weight in a 32-bit qh (bit j: weight j):
 *     w = d (q - 16), w = d q + m.
 *   Q4_K (12): super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min
 *     (packed in 12 bytes), d and dmin (f16) scaling them: w = d sc_j q - dmin m_j, q 4-bit (byte l
 *     of the 32-byte group g: weight l of sub-block 2g low nibble, of sub-block 2g + 1 high).
 *   Q5_K (13): Q4_K with a fifth bit per weight: qh[32], bit 2g (2g + 1) of byte l for weight l of
 *     sub-block 2g (2g + 1).
 *   Q6_K (14): 16 sub-blocks of 16 with int8 scales, d (f16): w = d sc_s (q - 32), q 6-bit: the low 4
 *     bits in ql[128], the high 2 in qh[64] (ggml's dequantize_row_q6_K gives the order).
 */

#ifndef PAGED_GGML_BLOCKS_H
#define PAGED_GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>

/* A weight's blocks are read in one stream, but a tile's dot-product chains fill the core's window before loads
 * far enough ahead are issued: the hardware's prefetchers alone left one row's decode at half the memory's speed
 * (one thread read a Q4_K weight at 20 GB/s from memory, 38 with this). So each 64-byte load of a weight asks for
 * the line PREFETCH_BYTES on (two Q4_K super-blocks of a 16-row group); past a tensor's end the hint is dropped,
 * never faulted. */
#define PREFETCH_BYTES 4608

static inline void prefetch_ahead(const uint8_t *p) { __builtin_prefetch(p + PREFETCH_BYTES, 0, 3); }

#define QK 32   /* weights of a legacy block */
#define QK_K 256 /* weights of a K-quant super-block */

enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30,
    GGML_X16 = 1000, /* + a type: its rows repacked in groups of 16 (ggml_x16.h), the same bytes a row */
};

typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_K;

_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0");
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "block_q5_1");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K");

/* Activations for the legacy types: a row's blocks of 32 as int8 (x ~ d q, d = max |x| / 127), with
 * s = d sum(q) for the types whose weights carry an offset, and start = -128 sum(q), where the sum of an x16
 * Q8_0 block's codes (stored as q + 128) starts. */
typedef struct { int8_t qs[QK]; float d, s; int32_t start; } act_q8;

/* Activations for the K-quants: a row's super-blocks of 256 as int8 (one d), the int sums of each 16
 * (Q6_K's offset), and d times the sums of each 32 (Q4_K's and Q5_K's mins). 352 bytes: the codes of
 * every block start on a 32-byte boundary. */
typedef struct { int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; float dsums[QK_K / 32]; float d; uint8_t pad[28]; } act_q8_K;
_Static_assert(sizeof(act_q8_K) == 352, "act_q8_K");

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) bits = sign | 0x7f800000u | (mant << 13); /* inf, NaN */
    else if (exp != 0) bits = sign | ((exp + 112u) << 23) | (mant << 13);
    else if (mant == 0) bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 8 scales and 8 mins of a Q4_K / Q5_K super-block from its 12 packed bytes (6 bits each), four at a time:
 * sc[0..3] and mn[0..3] are the low 6 bits of bytes 0..3 and 4..7; sc[4..7] and mn[4..7] the low and high nibbles
 * of bytes 8..11 below the top 2 bits of bytes 0..3 and 4..7. */
static inline void k4_scales(const uint8_t *q, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a, b, c, word[4];
    memcpy(&a, q, 4), memcpy(&b, q + 4, 4), memcpy(&c, q + 8, 4);
    word[0] = a & 0x3f3f3f3fu;
    word[1] = (c & 0x0f0f0f0fu) | ((a >> 6) & 0x03030303u) << 4;
    word[2] = b & 0x3f3f3f3fu;
    word[3] = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 6) & 0x03030303u) << 4;
    memcpy(sc, word, 8), memcpy(mn, word + 2, 8);
}

/* Bytes per row of K features of a type (an x16 type: its file type's), 0 for a type not served here or K not a multiple of its block. */
static inline int64_t ggml_row_bytes(int type, int64_t K) {
    if (type == GGML_X16 + GGML_Q4_0 || type == GGML_X16 + GGML_Q8_0 || type == GGML_X16 + GGML_Q4_K ||
        type == GGML_X16 + GGML_Q5_K || type == GGML_X16 + GGML_Q6_K)
        type -= GGML_X16;
    switch (type) {
    case GGML_F32: return 4 * K;
    case GGML_F16: case GGML_BF16: return 2 * K;
    case GGML_Q8_0: return K % QK ? 0 : K / QK * (int64_t)sizeof(block_q8_0);
    case GGML_Q4_0: return K % QK ? 0 : K / QK * (int64_t)sizeof(block_q4_0);
    case GGML_Q4_1: return K % QK ? 0 : K / QK * (int64_t)sizeof(block_q4_1);
    case GGML_Q5_0: return K % QK ? 0 : K / QK * (int64_t)sizeof(block_q5_0);
    case GGML_Q5_1: return K % QK ? 0 : K / QK * (int64_t)sizeof(block_q5_1);
    case GGML_Q4_K: return K % QK_K ? 0 : K / QK_K * (int64_t)sizeof(block_q4_K);
    case GGML_Q5_K: return K % QK_K ? 0 : K / QK_K * (int64_t)sizeof(block_q5_K);
    case GGML_Q6_K: return K % QK_K ? 0 : K / QK_K * (int64_t)sizeof(block_q6_K);
    default: return 0;
    }
}

/* Which activations a type multiplies: float rows, act_q8 blocks or act_q8_K super-blocks. */
enum { ACT_FLOAT = 0, ACT_Q8 = 1, ACT_Q8_K = 2 };
static inline int ggml_act(int type) {
    if (type >= GGML_X16) type -= GGML_X16;
    switch (type) {
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return ACT_Q8_K;
    case GGML_F32: case GGML_F16: case GGML_BF16: return ACT_FLOAT;
    default: return ACT_Q8;
    }
}

#endif
