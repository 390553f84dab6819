/* The attention kernel and cache writes for a bfloat16 KV cache (float32 queries and
 * arithmetic): attention.c built with KV_BF16 set, as paged_attention_bf16 and store_kv_bf16. */

#define KV_BF16 1
#include "attention.c"
