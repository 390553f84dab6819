/* A row's own keys, the second phase of attention.c's work items, ROW_W float lanes a vector:
 * attention.c includes this file with ROW_W 8 and, where the build has AVX-512, with ROW_W 16 (one
 * register; for head_dim a multiple of 16).
 *
 * own_keys continues the online softmax of a row's query heads of KV heads [h0, h1) over its
 * context positions [start, end), in chunks of up to ROW_W keys within one block. The KV heads of
 * a chunk take their turns one after another, so a row reads each block of the cache front to back
 * (a token's Hkv * D elements together) rather than one head's slice of it per pass. For each:
 *   scores   the G queries times each key as vectors of ROW_W partial sums, which transpose_sum
 *            folds into one vector per query: the chunk's ROW_W scores, no horizontal sum per key;
 *   softmax  on that vector: the chunk's maximum, its weights, the rescaling of what came before;
 *   values   the weights times the value rows into accumulators held in registers over the chunk.
 * The next chunk's rows are fetched as this chunk's same rows are reached, spread over the work.
 */

#if ROW_W == 16
#define RF vf16
#define RI vi16
#define RVEXP vexp16
#define ROWS(name) name##_w16
#elif ROW_W == 8
#define RF vf
#define RI vi
#define RVEXP vexp
#define ROWS(name) name##_w8
#else
#error "ROW_W is 16 or 8"
#endif

typedef uint16_t ROWS(rh) __attribute__((vector_size(ROW_W * sizeof(uint16_t)), aligned(2)));

/* a * b + c, rounded once where the build has FMA: spelled out, not left to the compiler's contraction (which
 * it may apply in one loop and not another), so attention.c's shared_phase rounds every lane as this file does. */
static inline RF ROWS(fma)(RF a, RF b, RF c) {
#if ROW_W == 16
    return (RF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX2__)
    return (RF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline RF ROWS(load)(const float *p) {
    RF x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* ROW_W cache elements as float32 (a bfloat16 widens exactly: a 16-bit shift; an int8 code is its value). */
static inline RF ROWS(load_kv)(const kv_t *p) {
#if KV_I8 && ROW_W == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif KV_I8
    typedef int8_t codes __attribute__((vector_size(ROW_W), aligned(1)));
    return __builtin_convertvector(*(const codes *)p, RF);
#elif !KV_BF16
    return ROWS(load)(p);
#elif ROW_W == 16 && defined(__AVX512F__)
    return (RF)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif ROW_W == 8
    return load_bf16(p);
#else
    return (RF)(__builtin_convertvector(*(const ROWS(rh) *)p, RI) << 16);
#endif
}

/* The largest lane of x, in every lane: log2(ROW_W) swaps of halves. */
static inline RF ROWS(allmax)(RF x) {
#if ROW_W == 16
    const RI swaps[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                         {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                         {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                         {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#else
    const RI swaps[3] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
#endif
    for (int i = 0; i < (int)(sizeof swaps / sizeof swaps[0]); ++i) {
        const RF y = __builtin_shuffle(x, swaps[i]);
        const RI larger = x > y;
        x = (RF)(((RI)x & larger) | ((RI)y & ~larger));
    }
    return x;
}

/* The halves of every segment of a and of b added, a's segments first, then b's (lo and hi pick each
 * segment's halves). */
static inline RF ROWS(fold)(RF a, RF b, RI lo, RI hi) { return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi); }

/* v[t] holds ROW_W partial sums of score t: returns the vector whose lane t is their total. Each level
 * folds pairs of vectors, halving their segments and interleaving them, so after the last one
 * segment t (one lane) is v[t]'s: ROW_W - 1 folds, where one horizontal sum per score takes log2(ROW_W).
 * v is overwritten. */
static inline RF ROWS(transpose_sum)(RF *v) {
#if ROW_W == 16
    for (int i = 0; i < 8; ++i)
        v[i] = ROWS(fold)(v[2 * i], v[2 * i + 1], (RI){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                          (RI){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; ++i)
        v[i] = ROWS(fold)(v[2 * i], v[2 * i + 1], (RI){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                          (RI){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; ++i)
        v[i] = ROWS(fold)(v[2 * i], v[2 * i + 1], (RI){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                          (RI){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return ROWS(fold)(v[0], v[1], (RI){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
                      (RI){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
#else
    for (int i = 0; i < 4; ++i)
        v[i] = ROWS(fold)(v[2 * i], v[2 * i + 1], (RI){0, 1, 2, 3, 8, 9, 10, 11}, (RI){4, 5, 6, 7, 12, 13, 14, 15});
    for (int i = 0; i < 2; ++i)
        v[i] = ROWS(fold)(v[2 * i], v[2 * i + 1], (RI){0, 1, 4, 5, 8, 9, 12, 13}, (RI){2, 3, 6, 7, 10, 11, 14, 15});
    return ROWS(fold)(v[0], v[1], (RI){0, 2, 4, 6, 8, 10, 12, 14}, (RI){1, 3, 5, 7, 9, 11, 13, 15});
#endif
}

/* cap * tanh(s / cap) in every lane, as cap - 2 cap / (exp(2 s / cap) + 1); the exponent is clamped to
 * [-20, 20], past which tanh is +-1 in float32 (and vexp would overflow). */
static inline RF ROWS(soft_cap)(RF s, float cap) {
    RF x = s * (2.0f / cap);
    const RI high = x > 20.0f, low = x < -20.0f;
    x = (RF)(((RI)x & ~high) | ((RI)((RF){0} + 20.0f) & high));
    x = (RF)(((RI)x & ~low) | ((RI)((RF){0} - 20.0f) & low));
    return cap - (2.0f * cap) / (RVEXP(x) + 1.0f);
}

/* Continues the online softmax of one row's query heads of KV heads [h0, h1) over its context positions
 * [start, end). q: the row's scaled queries of those heads, [(h1 - h0) * G][D]; for each query head j
 * of them, the running maximum m[j], the softmax sum as ROW_W partial sums sums[j * ROW_W + t] (key t of
 * every chunk: the caller adds them up, lane by lane, at the end) and the accumulator acc[j * D ..]. G and
 * D are constants in the callers, so the accumulators live in registers. softcap > 0 soft-caps the scores
 * (soft_cap). In an int8 cache the scales of each chunk's block (k_scales, v_scales: [num_blocks, Hkv]) scale its
 * scores and, past the sums, its weights. attention.c's shared_phase takes a tile's shared keys by these same steps. */
static inline __attribute__((always_inline)) void ROWS(own_keys)(const float *restrict q, const kv_t *restrict k_cache,
                                                               const kv_t *restrict v_cache,
                                                               const int32_t *restrict table, int64_t start,
                                                               int64_t end, int64_t block_size, int64_t token_stride,
                                                               int64_t h0, int64_t h1, const int G, const int D,
                                                               float softcap, const float *restrict k_scales,
                                                               const float *restrict v_scales, float *restrict m,
                                                               float *restrict sums_io, float *restrict acc) {
    (void)k_scales, (void)v_scales;
    RF part[MAX_GROUP][ROW_W], sums[MAX_GROUP]; /* sums: each query head's softmax sum, spread over the lanes */
    float weights[MAX_GROUP][ROW_W], correction[MAX_GROUP];
    for (int j = 0; j < (int)(h1 - h0) * G; ++j) sums[j] = ROWS(load)(sums_io + j * ROW_W);
    RI lane;
    for (int i = 0; i < ROW_W; ++i) lane[i] = i;
    const RF minus_inf = (RF){0} - INFINITY;
    for (int64_t pos = start; pos < end;) {
        const int64_t n = chunk_len(pos, end, block_size, ROW_W), base = chunk_base(table, pos, block_size, token_stride);
        const int64_t next = pos + n, next_n = next < end ? chunk_len(next, end, block_size, ROW_W) : 0;
        const int64_t next_base = next_n > 0 ? chunk_base(table, next, block_size, token_stride) : base;
        const RI valid = lane < (int32_t)n;
        for (int64_t h = h0; h < h1; ++h) {
            const kv_t *restrict k = k_cache + base + h * D, *restrict v = v_cache + base + h * D;
            const kv_t *next_k = k_cache + next_base + h * D, *next_v = v_cache + next_base + h * D;
            const float *restrict qh = q + (h - h0) * G * D;
            const float k_scale = KV_SCALE(k_scales, table, pos, block_size, token_stride / D, h);
            const float v_scale = KV_SCALE(v_scales, table, pos, block_size, token_stride / D, h);
            (void)k_scale, (void)v_scale;
            float *restrict mh = m + (h - h0) * G, *restrict ah = acc + (h - h0) * G * D;
            RF *restrict sh = sums + (h - h0) * G;
            for (int64_t t = 0; t < n; ++t) {
                if (t < next_n) prefetch_row(next_k + t * token_stride, D);
                const kv_t *restrict kt = k + t * token_stride;
                RF a[MAX_GROUP];
                for (int g = 0; g < G; ++g) a[g] = (RF){0};
                for (int c = 0; c < D; c += ROW_W) {
                    const RF x = ROWS(load_kv)(kt + c);
                    for (int g = 0; g < G; ++g) a[g] = ROWS(fma)(ROWS(load)(qh + g * D + c), x, a[g]);
                }
                for (int g = 0; g < G; ++g) part[g][t] = a[g];
            }
            for (int g = 0; g < G; ++g) {
                for (int64_t t = n; t < ROW_W; ++t) part[g][t] = (RF){0};
                RF raw = ROWS(transpose_sum)(part[g]);
#if KV_I8
                raw = raw * k_scale;
#endif
                if (softcap > 0.0f) raw = ROWS(soft_cap)(raw, softcap);
                const RI s = (RI)raw;
                const RF scores = (RF)((s & valid) | ((RI)minus_inf & ~valid)); /* lanes past n weigh 0 */
                const float chunk_max = ROWS(allmax)(scores)[0];
                correction[g] = 1.0f;
                if (chunk_max > mh[g]) { /* the running maximum moves: what came before is rescaled */
                    correction[g] = RVEXP((mh[g] - chunk_max) - (RF){0})[0]; /* 0 while mh is -inf */
                    mh[g] = chunk_max;
                }
                const RF p = RVEXP(scores - mh[g]);
                sh[g] = ROWS(fma)(sh[g], correction[g] - (RF){0}, p);
#if KV_I8
                const RF w = p * v_scale; /* the weights of the codes */
                memcpy(weights[g], &w, sizeof w);
#else
                memcpy(weights[g], &p, sizeof p);
#endif
            }
            /* values: up to FUSED_GROUP query heads and four vectors of D at a time, each value vector loaded once */
            for (int g0 = 0; g0 < G; g0 += FUSED_GROUP) {
                const int gn = G - g0 < FUSED_GROUP ? G - g0 : FUSED_GROUP;
                for (int c0 = 0; c0 < D; c0 += 4 * ROW_W) {
                    const int cn = (D - c0) / ROW_W < 4 ? (D - c0) / ROW_W : 4;
                    RF a[FUSED_GROUP][4];
                    for (int g = 0; g < gn; ++g)
                        for (int c = 0; c < cn; ++c)
                            a[g][c] = ROWS(load)(ah + (g0 + g) * D + c0 + c * ROW_W) * correction[g0 + g];
                    for (int64_t t = 0; t < n; ++t) {
                        if (g0 == 0 && c0 == 0 && t < next_n) prefetch_row(next_v + t * token_stride, D);
                        const kv_t *restrict vt = v + t * token_stride + c0;
                        for (int c = 0; c < cn; ++c) {
                            const RF x = ROWS(load_kv)(vt + c * ROW_W);
                            for (int g = 0; g < gn; ++g) a[g][c] = ROWS(fma)(weights[g0 + g][t] - (RF){0}, x, a[g][c]);
                        }
                    }
                    for (int g = 0; g < gn; ++g)
                        for (int c = 0; c < cn; ++c) memcpy(ah + (g0 + g) * D + c0 + c * ROW_W, &a[g][c], sizeof(RF));
                }
            }
        }
        pos += n;
    }
    for (int j = 0; j < (int)(h1 - h0) * G; ++j) memcpy(sums_io + j * ROW_W, &sums[j], sizeof(RF));
}

#undef RF
#undef RI
#undef RVEXP
#undef ROWS
