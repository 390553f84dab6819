/* Structured output's token masks for the CPU, float32: -inf on every token a row's bitmask
 * does not allow.
 *
 * A bitmask row holds ceil(V / 32) words; bit t % 32 of word t / 32 set = token t allowed.
 * Most words of a constrained row are 0 (nothing allowed in those 32 tokens) and a few are
 * all ones, so a whole word is written (or skipped) at once and only mixed words go bit by bit.
 */

#include <math.h>
#include <stdint.h>

/* logits: [R, V] with leading dimension ld; bitmask: [B, words] (row rows[i] of the logits
 * takes bitmask row rows[i]); rows: the num_rows constrained rows. */
void apply_token_bitmask_f32(float *logits, int64_t ld, const int32_t *bitmask, int64_t words, const int64_t *rows,
                             int64_t num_rows, int64_t vocab) {
#pragma omp parallel for schedule(static) if (num_rows >= 8)
    for (int64_t i = 0; i < num_rows; ++i) {
        float *restrict row = logits + rows[i] * ld;
        const int32_t *restrict mask = bitmask + rows[i] * words;
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t m = (uint32_t)mask[w];
            if (m == UINT32_MAX) continue;
            const int64_t start = w * 32, end = start + 32 < vocab ? start + 32 : vocab;
            if (m == 0) {
                for (int64_t t = start; t < end; ++t) row[t] = -INFINITY;
                continue;
            }
            for (int64_t t = start; t < end; ++t)
                if (!((m >> (t - start)) & 1u)) row[t] = -INFINITY;
        }
    }
}
