/* The attention kernel and cache writes for an int8 KV cache with a scale per block and KV head (float32 queries
 * and arithmetic): attention.c built with KV_I8 set, as paged_attention_i8 and store_kv_i8. */

#define KV_I8 1
#include "attention.c"
