"""C kernels for the CPU, compiled on first use and loaded with ctypes.

The source ships with the package; the first process that needs a kernel compiles it
with the system C compiler (``$CC``, else ``cc``) for this machine (``-march=native``)
into ``$PAGED_CACHE/cpu_kernels/``, keyed by a digest of the source, the flags, the
compiler's version and the CPU's feature flags, so a later process only loads it. The
library is linked against OpenMP and shares torch's thread pool (torch ships the same
``libgomp.so.1``), so ``torch.set_num_threads`` governs it too.

Without a working compiler, or with ``PAGED_CPU_KERNELS=0``, ``decode_attention_library``
returns None and the attention backend keeps its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from engine.loader import cache_root

logger = logging.getLogger(__name__)

_SOURCE = "decode_attention.c"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# Fixed-size scratch of the kernel (see MAX_* in the source).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 256


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(source: bytes, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    key = hashlib.blake2b(
        b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu_flags().encode()]), digest_size=12
    ).hexdigest()
    target = cache_root() / "cpu_kernels" / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / _SOURCE, Path(tmp) / target.name
        src.write_bytes(source)
        subprocess.run(
            [compiler, *_FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, check=True, timeout=300
        )
        os.replace(out, target)  # atomic: a concurrent builder's identical file may be replaced, never torn
    logger.info("compiled %s", target)
    return target


@functools.cache
def decode_attention_library() -> ctypes.CDLL | None:
    """The compiled decode-attention library, or None when it cannot be built here."""
    if os.environ.get("PAGED_CPU_KERNELS", "1") == "0":
        return None
    source = resources.files(__package__).joinpath(_SOURCE).read_bytes()
    compiler = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(_build(source, compiler)))
    except (OSError, subprocess.SubprocessError) as exc:  # no compiler, a failed or hung build, a bad library
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("CPU attention kernel unavailable (%s); using the PyTorch path", str(detail).strip()[:500])
        return None
    fn = lib.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    # q, k_cache, v_cache, block_tables, table_stride, seq_lens, out, the five sizes, scale
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    return lib


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles these shapes and dtype: float32, head_dim a multiple of 8, its scratch sizes."""
    return (
        dtype == torch.float32
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
        and block_size <= MAX_BLOCK_SIZE
    )


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int64: context length of each row, its new token included
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query token per row over its whole context, read in place from the paged cache."""
    lib = decode_attention_library()
    if lib is None:
        raise RuntimeError("the CPU decode attention kernel is not available on this machine")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not supports(num_heads, num_kv_heads, head_dim, block_size, q.dtype):
        raise ValueError(
            f"unsupported by the CPU kernel: {num_heads} query / {num_kv_heads} KV heads, head_dim {head_dim}, "
            f"block_size {block_size}, {q.dtype}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    lib.paged_decode_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
    )
    return out
