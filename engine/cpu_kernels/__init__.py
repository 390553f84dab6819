"""C kernels for the CPU, compiled on first use and loaded with ctypes (``build``: ``library()`` is None where
they cannot be built, and every caller keeps its pure-PyTorch path).

- ``attention``: paged attention of query-token rows (decode tokens and prefill tokens
  alike), and ``store_kv``, the new tokens' cache writes, over a float32 or bfloat16 cache
  (``attention.c``, ``attention_bf16.c``), for the CPU attention backend (``attention_ops``);
- ``encoder_attention``: an encoder's bidirectional attention over a packed variable-length batch, float32 or
  bfloat16 (AVX512-BF16 dot products where the CPU has them) (``encoder_attention.c``, ``encoder_ops``);
- ``rms_norm``, ``rotary``, ``silu_and_mul``: a decoder layer's element-wise parts
  (``elementwise.c``), which the layers call for float32 CPU tensors (``row_ops``);
- ``linear``: linear layers over a weight (float32 or bfloat16) packed once into panels of
  ``LINEAR_PANEL`` output columns by ``pack_linear_weight`` (``linear.c``), for the CPU ``Linear``;
  a bfloat16 weight runs with the CPU's bfloat16 dot products or AMX tiles where it has them
  (``linear_bf16.c``; the path chosen in ``linear_path.c``, ``bf16_linear_path``);
  ``linear_quantized`` over int8 or 4-bit blocks packed by ``engine.layers.quantization.pack`` (``linear_ops``);
- ``linear_ggml``: linear layers over weights in GGUF's own types (ggml's blocks, ``engine.layers.ggml_weight``),
  x quantized to int8 blocks and integer products (``linear_ggml.c``); ``ggml_rows`` dequantizes rows of them,
  ``ggml_int8_panels`` makes int8-products panels of them (a GGUF model's layout for large steps);
- ``apply_token_bitmask``: structured output's token masks on a step's logits (``token_mask.c``, ``row_ops``);
- ``argmax_rows``: greedy sampling's argmax of each row of a step's logits (``argmax.c``, ``row_ops``);
- ``decoder_forward``: a Llama-family model's decoder layers in one call, chaining the kernels above
  (``decoder.c``), for ``engine.worker.decoder_plan``, over the structs of ``abi``.
"""

from engine.cpu_kernels.attention_ops import (
    MAX_BLOCK_SIZE, MAX_GROUP, MAX_HEAD_DIM, AttentionTiles, attention, attention_error, attention_fetch,
    bf16_attention_path, slot_error, store_kv, supports, tile_lanes,
)  # fmt: skip
from engine.cpu_kernels.build import (
    ATTENTION_FETCH, ATTENTION_SPLIT, BF16_ATTENTION_PATHS, BF16_ENCODER_ATTENTION_PATHS, BF16_LINEAR_PATHS, GGML_LINEAR_PATHS, INT8_LINEAR_PATHS,
    library,
)  # fmt: skip
from engine.cpu_kernels.encoder_ops import (
    bf16_encoder_attention_path, encoder_attention, encoder_supports,
)  # fmt: skip
from engine.cpu_kernels.linear_ops import (
    LINEAR_PANEL, QUANTIZED_FLOAT_ROWS, bf16_linear_path, ggml_int8_panels, ggml_linear_path, ggml_parts, ggml_repacked,
    ggml_rows, int8_linear_path, linear, linear_ggml, linear_quantized, pack_linear_weight, packed_rows,
)  # fmt: skip
from engine.cpu_kernels.row_ops import (
    apply_token_bitmask, argmax_rows, position_error, rms_norm, rotary, serves, silu_and_mul,
)  # fmt: skip

__all__ = [
    "ATTENTION_FETCH", "ATTENTION_SPLIT", "BF16_ATTENTION_PATHS", "BF16_ENCODER_ATTENTION_PATHS", "BF16_LINEAR_PATHS", "GGML_LINEAR_PATHS", "INT8_LINEAR_PATHS",
    "LINEAR_PANEL", "MAX_BLOCK_SIZE", "MAX_GROUP", "MAX_HEAD_DIM", "QUANTIZED_FLOAT_ROWS", "AttentionTiles",
    "apply_token_bitmask", "argmax_rows", "attention", "attention_error", "attention_fetch", "bf16_attention_path",
    "bf16_encoder_attention_path", "bf16_linear_path", "encoder_attention", "encoder_supports", "ggml_int8_panels", "ggml_linear_path", "ggml_parts", "ggml_repacked", "ggml_rows", "int8_linear_path", "library",
    "linear", "linear_ggml", "linear_quantized", "pack_linear_weight", "packed_rows", "position_error", "rms_norm",
    "rotary", "serves", "silu_and_mul", "slot_error", "store_kv", "supports", "tile_lanes",
]  # fmt: skip
