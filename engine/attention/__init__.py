"""Attention over the paged KV cache: one interface, a backend per device, the selector, and the forward
context (``forward_context``) that hands a step's metadata to the attention layers.

The Triton backend is not exported here: ``engine.attention.triton_backend`` imports Triton
and binds its kernels to the device, so only ``get_attention_backend`` imports it, when it
picks it.
"""

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.selector import get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "TorchAttentionBackend",
    "get_attention_backend",
]
