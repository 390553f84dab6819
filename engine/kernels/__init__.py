"""Triton kernels for the paged KV cache: KV store, paged decode attention, prefill attention.

Importing this package compiles nothing but decorates the kernels, and Triton decides at
decoration time whether they run on the GPU or in its CPU interpreter (``TRITON_INTERPRET=1``).
So nothing in the engine imports it at module import time: the runner imports the Triton
backend only when it picks it.
"""

from engine.kernels.paged_attention import choose_num_splits, paged_decode_attention
from engine.kernels.prefill_attention import prefill_attention
from engine.kernels.store_kv import store_kv

__all__ = ["choose_num_splits", "paged_decode_attention", "prefill_attention", "store_kv"]
