/* Decode attention split by keys (flash-decoding's split-K), for calls with fewer rows than threads: attention.c
 * includes this file after attend_tile, once for each cache type.
 *
 * With few rows, attend_tile's items (a tile and a range of KV heads) leave threads idle or each read one head's
 * slice of every token row: a few cache lines a token, a page apart. Here every row attends alone, and its context
 * is cut into spans of SPLIT_SPAN_KEYS positions (rounded to whole blocks; a span starts where its absolute position
 * is a multiple of that, so the cut does not depend on the thread count). A work item is a row, a span and a range
 * of KV heads (up to MAX_GROUP query heads): its thread reads the span's blocks front to back, every head of a token
 * together (own_keys), into a partial maximum, softmax partial sums and accumulator of its own. A second pass merges
 * each row's spans in order: the largest maximum, each span rescaled by exp(its maximum - that), summed, normalized.
 * The spans' results depend only on the row's keys and queries, so a row's output is the same bits whatever its
 * rows and threads; they differ from attend_tile's (one softmax over the whole context) by float32 rounding, so a
 * row is not the same bits split as tiled, which the split path trades for the KV read at depth running on every
 * thread at the memory's speed.
 */

#define SPLIT_SPAN_KEYS 256 /* positions of a span, rounded down to whole blocks (at least one) */

#if KV_F32 /* once in the library: the float32-cache build defines what every build reads */
int attention_split = ATTENTION_SPLIT_AUTO;

/* Sets when paged_attention splits rows by keys: an ATTENTION_SPLIT_ value (tests, PAGED_ATTENTION_SPLIT). */
void attention_split_mode(int mode) { attention_split = mode; }
#endif

/* Whether paged_attention splits this call's rows by keys: always, never, or (auto) where it has fewer rows than
 * threads and one of them more than a span of keys. */
static int split_by_keys(const int64_t *seq_lens, int64_t num_rows, int64_t span) {
    if (attention_split != ATTENTION_SPLIT_AUTO) return attention_split == ATTENTION_SPLIT_ALWAYS;
    if (num_rows >= omp_get_max_threads()) return 0;
    for (int64_t i = 0; i < num_rows; ++i)
        if (seq_lens[i] > span) return 1;
    return 0;
}

/* Row i's first key: past its window where it has one. */
static inline int64_t split_row_start(const int64_t *seq_lens, int64_t i, int64_t window) {
    return window > 0 && seq_lens[i] > window ? seq_lens[i] - window : 0;
}

/* The spans of row i's keys [start, end): those holding a position of it. */
static inline int64_t split_row_spans(const int64_t *seq_lens, int64_t i, int64_t window, int64_t span) {
    return (seq_lens[i] - 1) / span - split_row_start(seq_lens, i, window) / span + 1;
}

/* One item: row i's keys of span s ([s * span, (s + 1) * span) within its keys) for KV heads [h0, h1), into the
 * span's state m[heads], sums[heads * RW] and acc[heads * D] (unnormalized). */
static inline __attribute__((always_inline)) void split_item(
    const float *restrict q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *restrict k_cache,
    const kv_t *restrict v_cache, const int32_t *restrict table, const int64_t *row, int64_t start, int64_t end,
    int64_t h0, int64_t h1, int64_t num_kv_heads, int64_t block_size, int G, const int D, const int specialized,
    float scale, float softcap, const float *restrict k_scales, const float *restrict v_scales, float *restrict m,
    float *restrict sums, float *restrict acc) {
    const int64_t token_stride = num_kv_heads * D;
    const int heads = (int)(h1 - h0) * G, RW = ROW_WIDTH(D);
    float qs[MAX_GROUP * MAX_HEAD_DIM];
    for (int64_t h = h0; h < h1; ++h)
        scaled_queries(q, q_row, q_head, q_col, row, G, G, h, D, scale, D, 1, qs + (h - h0) * G * D);
    for (int j = 0; j < heads; ++j) m[j] = -INFINITY;
    memset(sums, 0, sizeof(float) * (size_t)(heads * RW));
    memset(acc, 0, sizeof(float) * (size_t)(heads * D));
    prefetch_chunk(k_cache, v_cache, table, start, end, block_size, token_stride, h0, h1, D);
    own_keys(qs, k_cache, v_cache, table, start, end, block_size, token_stride, h0, h1, G, D, specialized, softcap,
             k_scales, v_scales, m, sums, acc);
}

#define SPLIT_ARGS                                                                                              \
    const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache, const kv_t *v_cache,     \
        const int32_t *table, const int64_t *row, int64_t start, int64_t end, int64_t h0, int64_t h1,           \
        int64_t num_kv_heads, int64_t block_size, int G, float scale, float softcap, const float *k_scales, \
        const float *v_scales, float *m, float *sums, float *acc
#define SPLIT_CALL(D, S)                                                                                         \
    split_item(q, q_row, q_head, q_col, k_cache, v_cache, table, row, start, end, h0, h1, num_kv_heads, block_size, \
               G, D, S, scale, softcap, k_scales, v_scales, m, sums, acc)
static void split_item_d64(SPLIT_ARGS) { SPLIT_CALL(64, 1); }
static void split_item_d128(SPLIT_ARGS) { SPLIT_CALL(128, 1); }
static void split_item_any(SPLIT_ARGS, int D) { SPLIT_CALL(D, 0); }
#undef SPLIT_CALL
#undef SPLIT_ARGS

/* paged_attention's rows split by keys (checked by paged_attention; tiles play no part). Returns 0, or -3 when out
 * of memory. */
static int split_attention(const float *q, int64_t q_row, int64_t q_head, int64_t q_col, const kv_t *k_cache,
                           const kv_t *v_cache, const int32_t *block_tables, int64_t table_stride,
                           const int64_t *seq_lens, int64_t num_rows, float *out, int64_t num_heads,
                           int64_t num_kv_heads, int D, int64_t block_size, int64_t span, float scale, int64_t window,
                           float softcap, const float *k_scales, const float *v_scales) {
    const int G = (int)(num_heads / num_kv_heads), RW = ROW_WIDTH(D);
    const int64_t item_heads = MAX_GROUP / G < num_kv_heads ? MAX_GROUP / G : num_kv_heads;
    const int64_t groups = (num_kv_heads + item_heads - 1) / item_heads;
    const int64_t state = (int64_t)MAX_GROUP * (1 + RW + D); /* an item's floats: maxima, partial sums, accumulators */
    /* row i's spans are items first[i] * groups ..: span s of head group g at (first[i] + s) * groups + g */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(num_rows + 1));
    if (first == NULL) return -3;
    first[0] = 0;
    for (int64_t i = 0; i < num_rows; ++i) first[i + 1] = first[i] + split_row_spans(seq_lens, i, window, span);
    const int64_t items = first[num_rows] * groups;
    float *scratch = malloc(sizeof(float) * (size_t)(items * state));
    if (scratch == NULL) {
        free(first);
        return -3;
    }
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t g = item % groups, at = item / groups;
            int64_t i = 0;
            while (first[i + 1] <= at) ++i; /* the row of span `at`: rows are few here */
            const int64_t row_start = split_row_start(seq_lens, i, window);
            const int64_t s = row_start / span + (at - first[i]);
            const int64_t start = s * span > row_start ? s * span : row_start;
            const int64_t end = (s + 1) * span < seq_lens[i] ? (s + 1) * span : seq_lens[i];
            const int64_t h0 = g * item_heads, h1 = h0 + item_heads < num_kv_heads ? h0 + item_heads : num_kv_heads;
            float *m = scratch + item * state, *sums = m + MAX_GROUP, *acc = sums + MAX_GROUP * RW;
            const int32_t *table = block_tables + i * table_stride;
            if (D == 64)
                split_item_d64(q, q_row, q_head, q_col, k_cache, v_cache, table, &i, start, end, h0, h1, num_kv_heads,
                               block_size, G, scale, softcap, k_scales, v_scales, m, sums, acc);
            else if (D == 128)
                split_item_d128(q, q_row, q_head, q_col, k_cache, v_cache, table, &i, start, end, h0, h1,
                                num_kv_heads, block_size, G, scale, softcap, k_scales, v_scales, m, sums, acc);
            else
                split_item_any(q, q_row, q_head, q_col, k_cache, v_cache, table, &i, start, end, h0, h1, num_kv_heads,
                               block_size, G, scale, softcap, k_scales, v_scales, m, sums, acc, D);
        }
        /* the merge: each row's spans in order, a row and head group at a time */
#pragma omp for schedule(static)
        for (int64_t rg = 0; rg < num_rows * groups; ++rg) {
            const int64_t i = rg / groups, g = rg % groups, h0 = g * item_heads;
            const int heads = (int)((h0 + item_heads < num_kv_heads ? item_heads : num_kv_heads - h0) * G);
            for (int j = 0; j < heads; ++j) {
                float top = -INFINITY, l = 0.0f;
                for (int64_t at = first[i]; at < first[i + 1]; ++at) {
                    const float mj = scratch[(at * groups + g) * state + j];
                    top = mj > top ? mj : top;
                }
                float *restrict o = out + (i * num_heads + h0 * G + j) * D;
                memset(o, 0, sizeof(float) * (size_t)D);
                for (int64_t at = first[i]; at < first[i + 1]; ++at) {
                    const float *m = scratch + (at * groups + g) * state, *sums = m + MAX_GROUP;
                    const float *acc = sums + MAX_GROUP * RW + j * D;
                    const float c = m[j] == -INFINITY ? 0.0f : expf(m[j] - top); /* a span no key of it reached */
                    float span_sum = 0.0f;
                    for (int t = 0; t < RW; ++t) span_sum += sums[j * RW + t];
                    l += c * span_sum;
                    for (int d = 0; d < D; ++d) o[d] += c * acc[d];
                }
                const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                for (int d = 0; d < D; ++d) o[d] *= inv;
            }
        }
    }
    free(scratch);
    free(first);
    return 0;
}
