/* A Llama-family decoder's step in one call: every layer's
 *   rms_norm (+ residual) -> qkv -> [q/k head norms] -> rotary -> store_kv -> attention -> o
 *   -> rms_norm (+ residual) -> gate_up -> silu_and_mul -> down
 *      (or a mixture of experts: router -> softmax top-k -> each chosen expert's gate_up, silu, down on its tokens),
 * then the final norm. Each step is the kernel the Python module calls, with the same arguments, so the
 * outputs are the same bits (but for a router's matmul: the packed kernel here, F.linear in its module); what
 * goes is the Python between them (about 100 us a layer: a module call, argument checks and a ctypes call per
 * operator): on the bundled model a 64-row decode step is 1.1-1.2x faster, a one-row step 1.4-2x
 * (docs/performance.md, "The decoder layers in one C call").
 *
 * The plan (weights, caches, sizes) is built once per model; a step passes its tokens' positions and
 * cache slots, the rows' block tables and the attention tiles. Intermediates live in one scratch of
 * decoder_scratch() floats.
 */

#include <math.h>
#include <omp.h>
#include <stddef.h>

#include "kernels.h"

/* A linear layer as the kernels take it; kind picks the kernel. */
enum { LINEAR_F32 = 0, LINEAR_BF16 = 1, LINEAR_Q8 = 2, LINEAR_W8A8 = 3, LINEAR_GGML = 4 };

typedef struct {
    const void *weight;  /* packed panels (float32, bfloat16), codes, or LINEAR_GGML's ggml_part array */
    const float *scales; /* the int8 kinds' */
    const float *bias;   /* or NULL */
    int64_t out_features, in_features;
    int32_t kind, bf16_products;
    int64_t num_parts; /* LINEAR_GGML's */
} linear_plan;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] each, or NULL */
    void *k_cache, *v_cache;             /* [num_blocks, block_size, Hkv, D], float32 or bfloat16 */
    linear_plan qkv, o, gate_up, down; /* gate_up and down unused in a mixture-of-experts layer */
    const float *router;               /* a mixture-of-experts layer's [num_experts, hidden] packed float32, or NULL */
    const linear_plan *experts;        /* [num_experts][2]: each expert's gate_up and down */
} layer_plan;

typedef struct {
    const layer_plan *layers;
    const float *final_norm; /* [hidden] */
    const float *cos_sin;    /* [max_positions, rotary_dim] */
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, rotary_dim, max_positions;
    int64_t block_size, num_blocks;
    int64_t window; /* every layer's sliding window, or 0 */
    float eps, scale;
    int32_t kv_bf16;
    int32_t renormalize;                          /* the top-k weights divided by their sum */
    int64_t num_experts, top_k, expert_intermediate; /* the mixture-of-experts layers', or 0 */
} decoder_plan;

typedef struct {
    const int64_t *positions, *slots;                        /* [tokens] */
    const int32_t *block_tables;                             /* [tokens, table_stride]: each token row's table */
    const int64_t *seq_lens;                                 /* [tokens] */
    const int64_t *tile_rows, *tile_starts, *tile_shared;    /* paged_attention's tiles */
    int64_t tokens, table_stride, num_tiles;
} decoder_step;

/* Which kernel a failing status came from (decoder_forward's *failed). */
enum { FAILED_LINEAR = 1, FAILED_ROTARY = 2, FAILED_STORE_KV = 3, FAILED_ATTENTION = 4 };

static int run_linear(const linear_plan *w, const float *x, int64_t ld_x, int64_t M, float *y) {
    const int64_t N = w->out_features, K = w->in_features;
    switch (w->kind) {
    case LINEAR_F32: linear_f32(x, ld_x, M, w->weight, N, K, w->bias, y, N); return 0;
    case LINEAR_BF16: return linear_bf16(x, ld_x, M, w->weight, N, K, w->bias, y, N);
    case LINEAR_Q8: return linear_q8_f32(x, ld_x, M, w->weight, w->scales, N, K, w->bias, y, N, w->bf16_products);
    case LINEAR_W8A8: return linear_w8a8_f32(x, ld_x, M, w->weight, w->scales, N, K, w->bias, y, N);
    case LINEAR_GGML: return linear_ggml_f32(x, ld_x, M, w->weight, w->num_parts, K, w->bias, y, N);
    default: return -1;
    }
}

/* The scratch's parts for T tokens, in floats, laid out one after another. */
typedef struct {
    float *residual[2], *normed, *out, *qkv, *q_normed, *k_normed, *q, *k, *attn, *gate_up, *act;
    /* a mixture-of-experts layer's: router probabilities [T, E]; each token's top-k weights [T, k]; the (token,
     * pick) pairs' rows [T * k, hidden] by expert, their gate_up, activation and output */
    float *probs, *pick_weights, *expert_rows, *expert_gate_up, *expert_act, *expert_out;
    int32_t *moe_ints; /* each token's picks, each pair's token, each pick's pair, each expert's first pair */
} scratch_parts;

static int64_t layout(const decoder_plan *p, int64_t T, float *base, scratch_parts *s) {
    const int64_t q_width = p->num_heads * p->head_dim, kv_width = p->num_kv_heads * p->head_dim;
    const int has_qk_norm = p->num_layers > 0 && p->layers[0].q_norm != NULL;
    float *ints;
    const int64_t sizes[] = {
        T * p->hidden, T * p->hidden, T * p->hidden, T * p->hidden, T * (q_width + 2 * kv_width),
        has_qk_norm ? T * q_width : 0, has_qk_norm ? T * kv_width : 0, T * q_width, T * kv_width, T * q_width,
        T * 2 * p->intermediate, T * p->intermediate,
        T * p->num_experts, T * p->top_k, T * p->top_k * p->hidden, T * p->top_k * 2 * p->expert_intermediate,
        T * p->top_k * p->expert_intermediate, T * p->top_k * p->hidden,
        p->num_experts > 0 ? 3 * T * p->top_k + p->num_experts + 1 : 0, /* int32s, as many as floats */
    };
    float **parts[] = {&s->residual[0], &s->residual[1], &s->normed, &s->out, &s->qkv, &s->q_normed,
                       &s->k_normed, &s->q, &s->k, &s->attn, &s->gate_up, &s->act, &s->probs, &s->pick_weights,
                       &s->expert_rows, &s->expert_gate_up, &s->expert_act, &s->expert_out, &ints};
    int64_t used = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
        *parts[i] = base == NULL ? NULL : base + used;
        used += (sizes[i] + 15) / 16 * 16; /* each part on its own 64-byte lines */
    }
    s->moe_ints = (int32_t *)ints;
    return used;
}

/* The floats of scratch decoder_forward needs for T tokens. */
int64_t decoder_scratch(const decoder_plan *p, int64_t T) {
    scratch_parts s;
    return layout(p, T, NULL, &s);
}

/* One layer's attention half: x normed -> qkv -> rotary -> the cache -> attention -> o into s->out. */
static int attention_half(const decoder_plan *p, const layer_plan *L, const decoder_step *st, scratch_parts *s,
                          int *failed) {
    const int64_t T = st->tokens, H = p->num_heads, Hkv = p->num_kv_heads, D = p->head_dim;
    const int64_t q_width = H * D, kv_width = Hkv * D, qkv_width = q_width + 2 * kv_width;
    int status = run_linear(&L->qkv, s->normed, p->hidden, T, s->qkv);
    if (status) return *failed = FAILED_LINEAR, status;
    const float *q = s->qkv, *k = s->qkv + q_width, *v = s->qkv + q_width + kv_width;
    int64_t ld_q = qkv_width, ld_k = qkv_width;
    if (L->q_norm != NULL) { /* per head, as RMSNorm over [T * H, D] rows */
        for (int64_t t = 0; t < T; ++t) {
            rms_norm_f32(q + t * qkv_width, D, NULL, 0, L->q_norm, H, D, p->eps, s->q_normed + t * q_width, NULL, D);
            rms_norm_f32(k + t * qkv_width, D, NULL, 0, L->k_norm, Hkv, D, p->eps, s->k_normed + t * kv_width, NULL,
                         D);
        }
        q = s->q_normed, k = s->k_normed, ld_q = q_width, ld_k = kv_width;
    }
    status = rotary_f32(q, ld_q, k, ld_k, st->positions, p->cos_sin, p->max_positions, T, H, Hkv, D, p->rotary_dim,
                        s->q, q_width, s->k, kv_width);
    if (status) return *failed = FAILED_ROTARY, status;
    const int64_t num_slots = p->num_blocks * p->block_size;
    status = p->kv_bf16 ? store_kv_bf16(s->k, kv_width, 1, v, qkv_width, 1, st->slots, T, kv_width, L->k_cache,
                                        L->v_cache, num_slots)
                        : store_kv_f32(s->k, kv_width, 1, v, qkv_width, 1, st->slots, T, kv_width, L->k_cache,
                                       L->v_cache, num_slots);
    if (status) return *failed = FAILED_STORE_KV, status;
    status = p->kv_bf16
                 ? paged_attention_bf16(s->q, q_width, D, 1, L->k_cache, L->v_cache, st->block_tables, st->table_stride,
                                        st->seq_lens, T, st->tile_rows, st->tile_starts, st->tile_shared, st->num_tiles,
                                        s->attn, H, Hkv, D, p->block_size, p->num_blocks, p->scale, p->window, 0.0f)
                 : paged_attention_f32(s->q, q_width, D, 1, L->k_cache, L->v_cache, st->block_tables, st->table_stride,
                                       st->seq_lens, T, st->tile_rows, st->tile_starts, st->tile_shared, st->num_tiles,
                                       s->attn, H, Hkv, D, p->block_size, p->num_blocks, p->scale, p->window, 0.0f);
    if (status) return *failed = FAILED_ATTENTION, status;
    status = run_linear(&L->o, s->attn, q_width, T, s->out);
    if (status) return *failed = FAILED_LINEAR, status;
    return 0;
}

/* Each token's top-k experts (largest router probability first; the lower index on a tie) and their weights,
 * renormalized to sum to 1 where the plan says, from the softmax of its router logits `probs` [T, E]. */
static void route(const decoder_plan *p, int64_t T, float *probs, int32_t *picks, float *weights) {
    const int64_t E = p->num_experts, k = p->top_k;
    for (int64_t t = 0; t < T; ++t) {
        float *row = probs + t * E;
        float top = row[0], sum = 0.0f;
        for (int64_t e = 1; e < E; ++e) top = row[e] > top ? row[e] : top;
        for (int64_t e = 0; e < E; ++e) sum += row[e] = expf(row[e] - top);
        for (int64_t e = 0; e < E; ++e) row[e] /= sum;
        float picked = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                int taken = 0;
                for (int64_t i = 0; i < j; ++i) taken |= picks[t * k + i] == e;
                if (!taken && (best < 0 || row[e] > row[best])) best = e;
            }
            picks[t * k + j] = (int32_t)best, weights[t * k + j] = row[best];
            picked += row[best];
        }
        if (p->renormalize)
            for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= picked;
    }
}

/* One expert's SwiGLU on its `count` gathered rows of s->expert_rows from `first` on. */
static int run_expert(const decoder_plan *p, const layer_plan *L, int64_t e, int64_t first, int64_t count,
                      const scratch_parts *s) {
    const int64_t n = p->hidden, I = p->expert_intermediate;
    float *gate_up = s->expert_gate_up + first * 2 * I, *act = s->expert_act + first * I;
    int status = run_linear(&L->experts[2 * e], s->expert_rows + first * n, n, count, gate_up);
    if (status) return status;
    silu_and_mul_f32(gate_up, 2 * I, count, I, act, I);
    return run_linear(&L->experts[2 * e + 1], act, I, count, s->expert_out + first * n);
}

/* A mixture-of-experts MLP of x [T, hidden] (ld hidden) into out [T, hidden]. The (token, pick) pairs are
 * ordered by expert, then token (the modules' stable sort), and each expert that a token chose runs its gate_up,
 * silu_and_mul and down once on all of its rows; a token's output is the sum, experts in ascending order, of its
 * rows times their weights. An expert no token chose costs nothing. With at least as many chosen experts as
 * threads, each thread runs whole experts (the linear kernels inside then run on one thread: fewer barriers, as
 * one decoding row per expert has little to split); with fewer, the experts run in turn, each on every thread. */
static int moe_mlp(const decoder_plan *p, const layer_plan *L, int64_t T, const float *x, scratch_parts *s,
                   float *out) {
    const int64_t n = p->hidden, E = p->num_experts, k = p->top_k, pairs = T * k;
    int32_t *picks = s->moe_ints, *pair_token = picks + pairs, *pair_of_pick = pair_token + pairs;
    int32_t *first = pair_of_pick + pairs; /* [E + 1]: each expert's first pair, then the end */
    linear_f32(x, n, T, L->router, E, n, NULL, s->probs, E);
    route(p, T, s->probs, picks, s->pick_weights);
    for (int64_t e = 0; e <= E; ++e) first[e] = 0;
    for (int64_t i = 0; i < pairs; ++i) ++first[picks[i] + 1];
    int64_t active = 0;
    for (int64_t e = 0; e < E; ++e) active += first[e + 1] > 0, first[e + 1] += first[e];
    for (int64_t i = 0; i < pairs; ++i) { /* token order within an expert: i runs over tokens in order */
        const int32_t slot = first[picks[i]]++;
        pair_token[slot] = (int32_t)(i / k), pair_of_pick[i] = slot;
    }
    for (int64_t e = E; e > 0; --e) first[e] = first[e - 1]; /* the fill moved each start to the next's */
    first[0] = 0;
#pragma omp parallel for schedule(static) if (pairs * n >= 1 << 16)
    for (int64_t r = 0; r < pairs; ++r) {
        const float *src = x + (int64_t)pair_token[r] * n;
        float *dst = s->expert_rows + r * n;
        for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
    }
    int failed = 0;
    if (active >= omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
        for (int64_t e = 0; e < E; ++e)
            if (first[e + 1] > first[e]) failed |= run_expert(p, L, e, first[e], first[e + 1] - first[e], s);
    } else {
        for (int64_t e = 0; e < E && !failed; ++e)
            if (first[e + 1] > first[e]) failed = run_expert(p, L, e, first[e], first[e + 1] - first[e], s);
    }
    if (failed) return failed;
#pragma omp parallel for schedule(static) if (pairs * n >= 1 << 16)
    for (int64_t t = 0; t < T; ++t) {
        float *o = out + t * n;
        for (int64_t i = 0; i < n; ++i) o[i] = 0.0f;
        for (int64_t e = 0, done = 0; done < k; ++e) /* the picks in ascending expert order */
            for (int64_t j = 0; j < k; ++j) {
                if (picks[t * k + j] != e) continue;
                const float w = s->pick_weights[t * k + j], *y = s->expert_out + (int64_t)pair_of_pick[t * k + j] * n;
                for (int64_t i = 0; i < n; ++i) o[i] += y[i] * w;
                ++done;
            }
    }
    return 0;
}

/* The residual buffer that is not `residual`, for the next sum (a norm never writes the residual it reads). */
static float *spare(const scratch_parts *s, const float *residual) {
    return residual == s->residual[0] ? s->residual[1] : s->residual[0];
}

/* x [T, hidden]: the tokens' embeddings; out [T, hidden]: the final norm of the last layer's output.
 * num_layers >= 1. Returns 0, or the status of the first kernel that failed, which *failed names (a FAILED_
 * value); the caches of the layers before it then hold this step's keys and values. */
int decoder_forward(const decoder_plan *p, const decoder_step *st, const float *x, float *out, float *scratch,
                    int32_t *failed) {
    const int64_t T = st->tokens, n = p->hidden;
    scratch_parts s;
    layout(p, T, scratch, &s);
    int which = 0;
    const float *residual = x; /* the first layer's residual is its input */
    for (int64_t i = 0; i < p->num_layers; ++i) {
        const layer_plan *L = &p->layers[i];
        if (i == 0)
            rms_norm_f32(x, n, NULL, 0, L->input_norm, T, n, p->eps, s.normed, NULL, n);
        else { /* the previous layer's output in s.out, plus its residual */
            float *sum = spare(&s, residual);
            rms_norm_f32(s.out, n, residual, n, L->input_norm, T, n, p->eps, s.normed, sum, n);
            residual = sum;
        }
        int status = attention_half(p, L, st, &s, &which);
        if (status) return *failed = which, status;
        float *sum = spare(&s, residual);
        rms_norm_f32(s.out, n, residual, n, L->post_norm, T, n, p->eps, s.normed, sum, n);
        residual = sum;
        if (L->router != NULL)
            status = moe_mlp(p, L, T, s.normed, &s, s.out);
        else if ((status = run_linear(&L->gate_up, s.normed, n, T, s.gate_up)) == 0) {
            silu_and_mul_f32(s.gate_up, 2 * p->intermediate, T, p->intermediate, s.act, p->intermediate);
            status = run_linear(&L->down, s.act, p->intermediate, T, s.out);
        }
        if (status) return *failed = FAILED_LINEAR, status;
    }
    rms_norm_f32(s.out, n, residual, n, p->final_norm, T, n, p->eps, out, spare(&s, residual), n);
    return 0;
}

/* ------------------------------------------------------------------------------------------ the ABI
 *
 * The structs above and ggml_part are mirrored in Python (engine/cpu_kernels/abi.py), which checks its copy
 * against these sizes and offsets, and the features this library was compiled for against the CPU's, when it
 * loads the library. */

#define ABI_VERSION 3
#define ABI_SIZE(T) {#T, (int64_t)sizeof(T)}
#define ABI_FIELD(T, f) {#T "." #f, (int64_t)offsetof(T, f)}

typedef struct {
    const char *name;
    int64_t value;
} abi_entry;

static const abi_entry abi_entries[] = {
    ABI_SIZE(linear_plan), ABI_FIELD(linear_plan, weight), ABI_FIELD(linear_plan, scales),
    ABI_FIELD(linear_plan, bias), ABI_FIELD(linear_plan, out_features), ABI_FIELD(linear_plan, in_features),
    ABI_FIELD(linear_plan, kind), ABI_FIELD(linear_plan, bf16_products), ABI_FIELD(linear_plan, num_parts),
    ABI_SIZE(layer_plan), ABI_FIELD(layer_plan, input_norm), ABI_FIELD(layer_plan, post_norm),
    ABI_FIELD(layer_plan, q_norm), ABI_FIELD(layer_plan, k_norm), ABI_FIELD(layer_plan, k_cache),
    ABI_FIELD(layer_plan, v_cache), ABI_FIELD(layer_plan, qkv), ABI_FIELD(layer_plan, o),
    ABI_FIELD(layer_plan, gate_up), ABI_FIELD(layer_plan, down), ABI_FIELD(layer_plan, router),
    ABI_FIELD(layer_plan, experts),
    ABI_SIZE(decoder_plan), ABI_FIELD(decoder_plan, layers), ABI_FIELD(decoder_plan, final_norm),
    ABI_FIELD(decoder_plan, cos_sin), ABI_FIELD(decoder_plan, num_layers), ABI_FIELD(decoder_plan, hidden),
    ABI_FIELD(decoder_plan, num_heads), ABI_FIELD(decoder_plan, num_kv_heads), ABI_FIELD(decoder_plan, head_dim),
    ABI_FIELD(decoder_plan, intermediate), ABI_FIELD(decoder_plan, rotary_dim),
    ABI_FIELD(decoder_plan, max_positions), ABI_FIELD(decoder_plan, block_size),
    ABI_FIELD(decoder_plan, num_blocks), ABI_FIELD(decoder_plan, window), ABI_FIELD(decoder_plan, eps),
    ABI_FIELD(decoder_plan, scale), ABI_FIELD(decoder_plan, kv_bf16), ABI_FIELD(decoder_plan, renormalize),
    ABI_FIELD(decoder_plan, num_experts), ABI_FIELD(decoder_plan, top_k),
    ABI_FIELD(decoder_plan, expert_intermediate),
    ABI_SIZE(decoder_step), ABI_FIELD(decoder_step, positions), ABI_FIELD(decoder_step, slots),
    ABI_FIELD(decoder_step, block_tables), ABI_FIELD(decoder_step, seq_lens), ABI_FIELD(decoder_step, tile_rows),
    ABI_FIELD(decoder_step, tile_starts), ABI_FIELD(decoder_step, tile_shared), ABI_FIELD(decoder_step, tokens),
    ABI_FIELD(decoder_step, table_stride), ABI_FIELD(decoder_step, num_tiles),
    ABI_SIZE(ggml_part), ABI_FIELD(ggml_part, data), ABI_FIELD(ggml_part, rows), ABI_FIELD(ggml_part, type),
};

int paged_abi_version(void) { return ABI_VERSION; }

/* The struct sizes and field offsets ("struct" and "struct.field" names); returns how many. */
int64_t paged_abi_layout(const abi_entry **entries) {
    *entries = abi_entries;
    return (int64_t)(sizeof abi_entries / sizeof abi_entries[0]);
}

/* The instruction sets this library was compiled for, as /proc/cpuinfo names them, space-separated. */
const char *paged_build_features(void) {
    return ""
#ifdef __AVX2__
           " avx2"
#endif
#ifdef __FMA__
           " fma"
#endif
#ifdef __F16C__
           " f16c"
#endif
#ifdef __AVX512F__
           " avx512f"
#endif
#ifdef __AVX512BW__
           " avx512bw"
#endif
#ifdef __AVX512VL__
           " avx512vl"
#endif
#ifdef __AVX512VNNI__
           " avx512_vnni"
#endif
#ifdef __AVX512BF16__
           " avx512_bf16"
#endif
#ifdef __AVXVNNI__
           " avx_vnni"
#endif
#ifdef __AMX_TILE__
           " amx_tile"
#endif
#ifdef __AMX_BF16__
           " amx_bf16"
#endif
#ifdef __ARM_NEON
           " neon"
#endif
        ;
}
