"""C kernels for the CPU, compiled on first use and loaded with ctypes.

- ``attention``: paged attention of query-token rows (decode tokens and prefill tokens
  alike), and ``store_kv``, the new tokens' cache writes, over a float32 or bfloat16 cache
  (``attention.c``, ``attention_bf16.c``), for the CPU attention backend;
- ``rms_norm``, ``rotary``, ``silu_and_mul``: a decoder layer's element-wise parts
  (``elementwise.c``), which the layers call for float32 CPU tensors;
- ``linear``: linear layers over a weight (float32 or bfloat16) packed once into panels of
  ``LINEAR_PANEL`` output columns by ``pack_linear_weight`` (``linear.c``), for the CPU ``Linear``;
  a bfloat16 weight runs with the CPU's bfloat16 dot products or AMX tiles where it has them
  (``linear_bf16.c``; the path chosen in ``linear_path.c``, ``bf16_linear_path``);
  ``linear_quantized`` over int8 or 4-bit blocks packed by ``engine.layers.quantization.pack``;
- ``linear_ggml``: linear layers over weights in GGUF's own types (ggml's blocks, ``engine.layers.ggml_weight``),
  x quantized to int8 blocks and integer products (``linear_ggml.c``); ``ggml_rows`` dequantizes rows of them;
- ``apply_token_bitmask``: structured output's token masks on a step's logits (``token_mask.c``);
- ``argmax_rows``: greedy sampling's argmax of each row of a step's logits (``argmax.c``);
- ``decoder_forward``: a Llama-family model's decoder layers in one call, chaining the kernels above
  (``decoder.c``), for ``engine.worker.decoder_plan``.

The sources ship with the package; the first process that needs a kernel compiles them
into one library with the system C compiler (``$CC``, else ``cc``) for this machine
(``-march=native``) into ``$PAGED_CACHE/cpu_kernels/``, keyed by a digest of the sources,
the flags, the compiler's version and the CPU's feature flags, so a later process only
loads it. A cached library that does not load, or whose struct layout, ABI version or instruction
sets do not match (``abi.mismatch``), is rebuilt once, with one log line. The library is linked against OpenMP and shares torch's thread pool (torch
ships the same ``libgomp.so.1``), so ``torch.set_num_threads`` governs it too.

Without a working compiler, or with ``PAGED_CPU_KERNELS=0``, ``library()`` returns None
and every caller keeps its pure-PyTorch path.
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
from typing import NamedTuple

import torch

from engine.cpu_kernels import abi
from engine.paths import cache_root

logger = logging.getLogger(__name__)

_SOURCES = (
    "vec.h", "kernels.h", "linear.h", "linear_layout.h", "linear_path.h", "linear_tiles16.h", "bf16_kernels.h",
    "attention_amx.h", "attention_dot.h", "attention_rows.h", "attention.c", "attention_bf16.c", "elementwise.c",
    "linear.c", "linear_path.c", "linear_bf16.c", "linear_int8.c", "token_mask.c", "argmax.c", "decoder.c",
    "ggml_blocks.h", "ggml_generic.h", "ggml_avx2.h", "ggml_x16.h", "ggml_avx512.h", "linear_ggml.c",
)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# Fixed-size scratch of the kernels (see MAX_* in the sources).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 256
AMX_TILE_LANES = 24  # queries of a tile whose shared keys take AMX tiles
LINEAR_PANEL = 16  # output columns of a packed weight's panel (PANEL in linear_layout.h)
QUANTIZED_FLOAT_ROWS = 6  # up to this many rows a quantized layer computes in float32 (TILE_ROWS in linear.c)
BF16_K_ALIGN = 32  # a packed bfloat16 weight's input features are padded to a multiple of this (linear_layout.h)
# What linear_bf16 runs, by the C enum's value: widened to float32, AVX512-BF16 dot products, AMX tiles.
BF16_LINEAR_PATHS = ("widened", "avx512-bf16", "amx")
# What a multi-row tile's shared keys in a bfloat16 cache run, by the C enum's value: float32 vectors over the
# widened cache, AVX512-BF16 dot products (attention_dot.h), AMX tiles (attention_amx.h).
BF16_ATTENTION_PATHS = ("widened", "avx512-bf16", "amx")
# What linear_w8a8 multiplies on, by the C enum's value: int8 sums in plain C, AVX512-VNNI.
INT8_LINEAR_PATHS = ("generic", "avx512-vnni")
# What linear_ggml runs on, by the C enum's value: plain C, AVX2, AVX512-VNNI (Q4_0, Q4_K and Q6_K repacked in
# groups of 16 rows at load, ggml_x16.h; the other types on AVX2).
GGML_LINEAR_PATHS = ("generic", "avx2", "avx512-vnni")
# Where attention fetches the cache lines of the next chunk, by attention_fetch_into's level: the machine's
# default (L2 where the L1 data cache holds under 48 KiB, else L1), L1, L2 only.
ATTENTION_FETCH = ("auto", "l1", "l2")


def _cpu_flags() -> str:
    """This CPU's features as the OS lists them (Linux's /proc/cpuinfo flags, macOS's sysctl), for the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(
                ["sysctl", "machdep.cpu", "hw.optional"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    return f"{platform.machine()} {platform.processor()}"


def _cpu_flag_set() -> set[str] | None:
    """The feature names of /proc/cpuinfo (which ``abi.build_features`` uses), or None where there is none."""
    line = _cpu_flags()
    return set(line.partition(":")[2].split()) if line.startswith(("flags", "Features")) else None


def _build(sources: dict[str, bytes], compiler: str, rebuild: bool = False) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    key = hashlib.blake2b(
        b"\0".join([*sources.values(), " ".join(_FLAGS).encode(), version.encode(), _cpu_flags().encode()]),
        digest_size=12,
    ).hexdigest()
    target = cache_root() / "cpu_kernels" / f"paged_cpu-{key}.so"
    if target.exists() and not rebuild:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
        out = Path(tmp) / target.name
        units = [str(Path(tmp) / name) for name in sources if name.endswith(".c")]
        subprocess.run(
            [compiler, *_FLAGS, *units, "-o", str(out)], capture_output=True, text=True, check=True, timeout=300
        )
        os.replace(out, target)  # atomic: a concurrent builder's identical file may be replaced, never torn
    logger.info("compiled %s", target)
    return target


def _load(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``path`` and None, or None and why it cannot be used (it does not load, or its ABI or
    instruction sets do not match: ``abi.mismatch``); a library that loaded but does not match is unloaded."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"it does not load ({exc})"
    why = abi.mismatch(lib, _cpu_flag_set())
    if why is not None:
        import _ctypes

        _ctypes.dlclose(lib._handle)  # so that the rebuilt file at the same path is loaded afresh
        return None, why
    return lib, None


_PTR, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    # q and its three strides, k_cache, v_cache, block_tables, table_stride, seq_lens, rows, tile rows,
    # tile starts, tile shared keys, number of tiles, out, five sizes, scale, window (or 0), soft cap (or 0)
    "paged_attention_f32": [
        _PTR, *[_I64] * 3, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, *[_I64] * 5, _F32, _I64,
        _F32,
    ],
    # k and its two strides, v and its two strides, slots, rows, width, k_cache, v_cache, number of slots
    "store_kv_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64],
    # x, ld, residual, ld, weight, rows, width, eps, out, residual_out, their ld
    "rms_norm_f32": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _PTR, _I64],
    # x, ld, rows, intermediate size, out, ld
    "silu_and_mul_f32": [_PTR, _I64, _I64, _I64, _PTR, _I64],
    # x, ld, rows, packed weight, out features, in features, bias (or NULL), y, ld
    "linear_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64],
    # q, ld, k, ld, positions, cos_sin, its rows, rows, heads, KV heads, head_dim, rotary dim, q_out, ld, k_out, ld
    "rotary_f32": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, *[_I64] * 6, _PTR, _I64, _PTR, _I64],
    # x, ld, rows, codes, scales, out features, in features, bias (or NULL), y, ld, bfloat16 products
    "linear_q8_f32": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, ctypes.c_int],
    # x, ld, rows, codes (int8-products layout), scales, out features, in features, bias (or NULL), y, ld
    "linear_w8a8_f32": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64],
    "linear_int8_path": [],
    "linear_int8_limit": [ctypes.c_int],
    "attention_max_lanes": [],
    "linear_bf16_path": [_I64],  # rows
    "linear_bf16_limit": [ctypes.c_int],  # the highest path it may take
    "attention_bf16_path": [_I64],  # head_dim
    "attention_bf16_limit": [ctypes.c_int],
    "attention_fetch_into": [ctypes.c_int],  # 0 the machine's default, 1 into L1, 2 into L2 only
    "attention_fetch_level": [],
    # logits, ld, bitmask, words per row, rows, number of rows, vocabulary size
    "apply_token_bitmask_f32": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64],
    # logits, ld, rows, vocabulary size, out
    "argmax_rows_f32": [_PTR, _I64, _I64, _I64, _PTR],
    # x, ld, rows, parts, number of parts, in features, bias (or NULL), y, ld
    "linear_ggml_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64],
    # ggml type, data, in features, index, number of rows, out
    "ggml_dequantize_rows": [ctypes.c_int32, _PTR, _I64, _PTR, _I64, _PTR],
    "ggml_type_row_bytes": [ctypes.c_int32, _I64],
    "ggml_linear_path": [],
    "ggml_linear_limit": [ctypes.c_int],
    "ggml_x16_type_for": [ctypes.c_int32, _I64],  # ggml type, rows
    "ggml_x16_pack": [ctypes.c_int32, _PTR, _I64, _I64, _PTR],  # ggml type, data, rows, in features, out
    # plan, tokens (decoder.c)
    "decoder_scratch": [_PTR, _I64],
    # plan, step, x, out, scratch, the failing kernel (out)
    "decoder_forward": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR],
}
# The kernels built for a bfloat16 cache or weight take the float32 ones' arguments.
_SIGNATURES |= {f"{name}_bf16": _SIGNATURES[f"{name}_f32"] for name in ("paged_attention", "store_kv", "linear")}
# 0, or < 0 on bad arguments
_RETURN_STATUS = {
    "paged_attention_f32", "paged_attention_bf16", "store_kv_f32", "store_kv_bf16", "rotary_f32", "linear_q8_f32",
    "linear_w8a8_f32", "linear_int8_path", "linear_bf16", "linear_bf16_path", "attention_bf16_path", "attention_max_lanes",
    "attention_fetch_level", "decoder_forward", "linear_ggml_f32", "ggml_dequantize_rows", "ggml_linear_path",
    "ggml_x16_type_for", "ggml_x16_pack",
}
_RESTYPES = {name: ctypes.c_int for name in _RETURN_STATUS} | {
    "decoder_scratch": ctypes.c_int64, "ggml_type_row_bytes": ctypes.c_int64,
}  # else void
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here (or ``PAGED_CPU_KERNELS=0``).

    ``PAGED_BF16_LINEAR`` (one of ``BF16_LINEAR_PATHS``) caps the bfloat16 linear path, e.g.
    ``widened`` to compute bfloat16 weights in float32 on a CPU with bfloat16 arithmetic;
    ``PAGED_BF16_ATTENTION`` (one of ``BF16_ATTENTION_PATHS``) the path of shared keys in a bfloat16 cache;
    ``PAGED_INT8_LINEAR`` (one of ``INT8_LINEAR_PATHS``) the path of int8 products;
    ``PAGED_GGML_LINEAR`` (one of ``GGML_LINEAR_PATHS``) the path of GGUF-type weights;
    ``PAGED_ATTENTION_FETCH`` (one of ``ATTENTION_FETCH``) the cache level attention fetches ahead into.
    """
    if os.environ.get("PAGED_CPU_KERNELS", "1") == "0":
        return None
    sources = {name: resources.files(__package__).joinpath(name).read_bytes() for name in _SOURCES}
    compiler = os.environ.get("CC", "cc")
    try:
        path = _build(sources, compiler)
        lib, why = _load(path)
        if why is not None:  # a stale, foreign or damaged file in the cache: build it again, once
            logger.warning("the cached CPU kernel library %s cannot be used (%s); rebuilding it", path.name, why)
            lib, why = _load(_build(sources, compiler, rebuild=True))
            if why is not None:
                raise OSError(f"the rebuilt library cannot be used: {why}")
    except (OSError, subprocess.SubprocessError) as exc:  # no compiler, a failed or hung build, a bad library
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("CPU kernels unavailable (%s); using the PyTorch path", str(detail).strip()[:500])
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _RESTYPES.get(name), argtypes
    for variable, paths, choose, default in (
        ("PAGED_BF16_LINEAR", BF16_LINEAR_PATHS, lib.linear_bf16_limit, BF16_LINEAR_PATHS[-1]),
        ("PAGED_BF16_ATTENTION", BF16_ATTENTION_PATHS, lib.attention_bf16_limit, BF16_ATTENTION_PATHS[-1]),
        ("PAGED_INT8_LINEAR", INT8_LINEAR_PATHS, lib.linear_int8_limit, INT8_LINEAR_PATHS[-1]),
        ("PAGED_GGML_LINEAR", GGML_LINEAR_PATHS, lib.ggml_linear_limit, GGML_LINEAR_PATHS[-1]),
        ("PAGED_ATTENTION_FETCH", ATTENTION_FETCH, lib.attention_fetch_into, "auto"),
    ):
        value = os.environ.get(variable, default)
        if value not in paths:
            raise ValueError(f"{variable} must be one of {', '.join(paths)}; got {value!r}")
        choose(paths.index(value))
    return lib


def attention_fetch() -> str:
    """The cache level the attention kernels fetch keys and values ahead into on this CPU: ``l1`` or ``l2``."""
    return ATTENTION_FETCH[_lib().attention_fetch_level()]


def bf16_linear_path(rows: int) -> str:
    """What a bfloat16 ``linear`` of ``rows`` rows runs on this CPU: one of ``BF16_LINEAR_PATHS``."""
    return BF16_LINEAR_PATHS[_lib().linear_bf16_path(rows)]


def int8_linear_path() -> str:
    """What a linear with int8 products (``quantization="w8a8"``) runs on this CPU: one of ``INT8_LINEAR_PATHS``."""
    return INT8_LINEAR_PATHS[_lib().linear_int8_path()]


def ggml_linear_path() -> str:
    """What a linear over GGUF-type weights (``linear_ggml``) runs on this CPU: one of ``GGML_LINEAR_PATHS``."""
    return GGML_LINEAR_PATHS[_lib().ggml_linear_path()]


def tile_lanes(head_dim: int, dtype: torch.dtype) -> int:
    """The most queries (rows x query heads of a KV group) a multi-row tile of ``attention`` should hold over a
    cache of this head_dim and dtype: 48 where the kernels have AVX-512 (three 16-lane vectors), 24 without, and 24
    where a bfloat16 cache's shared keys take AMX tiles (``AMX_QUERIES`` columns at most, measured no faster
    at 32)."""
    if dtype == torch.bfloat16 and bf16_attention_path(head_dim) == "amx":
        return AMX_TILE_LANES
    return _lib().attention_max_lanes()


def bf16_attention_path(head_dim: int) -> str:
    """What the shared keys of a multi-row tile in a bfloat16 cache run on this CPU: one of ``BF16_ATTENTION_PATHS``."""
    return BF16_ATTENTION_PATHS[_lib().attention_bf16_path(head_dim)]


def serves(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels take ``x``: a float32 CPU tensor, with the library built."""
    return x.dtype == torch.float32 and x.is_cpu and library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
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


class AttentionTiles(NamedTuple):
    """Rows of an attention call grouped for the kernel: tile ``t`` is ``rows[starts[t]:starts[t + 1]]``,
    at most ``tile_lanes() // group`` rows whose block tables agree over their first ``shared[t]``
    keys (every row of the tile sees them). A tile of one row has nothing to share."""

    rows: torch.Tensor  # [B] int64, every row once
    starts: torch.Tensor  # [num_tiles + 1] int64
    shared: torch.Tensor  # [num_tiles] int64


def attention(
    q: torch.Tensor,  # [B, Hq, D] float32, any strides: one query token per row
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 or bfloat16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32: each row's table
    seq_lens: torch.Tensor,  # [B] int64: keys each row attends over (a token at position p: p + 1)
    scale: float,
    tiles: AttentionTiles | None = None,  # None: each row alone
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query token per row over the first ``seq_lens`` keys of its table, read in place
    from the paged cache; the rows of a multi-row tile attend over their shared keys together.

    With a ``window`` each row attends over the last ``window`` of its keys only (the blocks before are not
    read); ``softcap`` c turns each scaled score s into ``c * tanh(s / c)``. Tiles then share no keys
    past a row's window, and none at all with a soft cap."""
    lib = _lib()
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not supports(num_heads, num_kv_heads, head_dim, block_size, q.dtype):
        raise ValueError(
            f"unsupported by the CPU kernel: {num_heads} query / {num_kv_heads} KV heads, head_dim {head_dim}, "
            f"block_size {block_size}, {q.dtype}"
        )
    _check_caches(k_cache, v_cache)
    if tiles is None:
        tiles = AttentionTiles(
            torch.arange(num_rows), torch.arange(num_rows + 1), torch.zeros(num_rows, dtype=torch.int64)
        )
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = _int64(seq_lens)
    out = torch.empty(q.shape)
    kernel = getattr(lib, f"paged_attention_{_SUFFIX[k_cache.dtype]}")
    status = kernel(
        q.data_ptr(), *q.stride(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), num_rows, tiles.rows.data_ptr(), tiles.starts.data_ptr(),
        tiles.shared.data_ptr(), len(tiles.shared), out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size,
        k_cache.shape[0], scale, window or 0, softcap or 0.0,
    )
    if status:
        raise attention_error(status, num_rows, num_heads // num_kv_heads, k_cache.shape[0], block_tables.shape[1])
    return out


def attention_error(status: int, num_rows: int, group: int, num_blocks: int, table_width: int) -> Exception:
    """The error of ``paged_attention``'s status (-1, -2 or -3) for ``num_rows`` rows of ``group`` query heads
    per KV head, ``num_blocks`` cache blocks and tables of ``table_width`` entries."""
    if status == -1:
        return ValueError(
            f"invalid tiles: not every one of the {num_rows} rows in exactly one tile, a tile of more than "
            f"{_lib().attention_max_lanes() // group} rows, or shared keys beyond a row's context or window, where "
            "the rows' tables differ, or with a soft cap"
        )
    if status == -2:
        return IndexError(
            f"a row's context needs a block id outside [0, {num_blocks}) or past its table's {table_width} entries"
        )
    return MemoryError("the CPU attention kernel could not allocate its scratch")


def slot_error(num_slots: int) -> IndexError:
    """The error of ``store_kv``'s status: a slot outside the cache."""
    return IndexError(f"a slot of slot_mapping is outside the cache's {num_slots} slots")


def position_error(num_positions: int) -> IndexError:
    """The error of ``rotary``'s status: a position outside its table."""
    return IndexError(f"a position is outside the rotary table's {num_positions} positions")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes ``k``/``v`` [T, Hkv, D] (float32, any strides) at cache slots ``slot_mapping`` [T] of the
    contiguous caches [num_blocks, block_size, Hkv, D], float32 or bfloat16 (rounded to nearest even)."""
    lib = _lib()
    for name, t in (("k", k), ("v", v)):
        _check_float32_cpu(name, t)
    _check_caches(k_cache, v_cache)
    k2, v2 = _heads_side_by_side(k), _heads_side_by_side(v)
    slots = _int64(slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    kernel = getattr(lib, f"store_kv_{_SUFFIX[k_cache.dtype]}")
    status = kernel(k2.data_ptr(), k2.stride(0), k2.stride(2), v2.data_ptr(), v2.stride(0), v2.stride(2),
                    slots.data_ptr(), k2.shape[0], k2.shape[1] * k2.shape[2], k_cache.data_ptr(), v_cache.data_ptr(),
                    num_slots)
    if status:
        raise slot_error(num_slots)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(f"{name} must be a contiguous float32 or bfloat16 CPU tensor; got {t.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")


def _check_float32_cpu(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU tensor; got {t.dtype} on {t.device}")


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` [R, F] or [R, H, D] as (tensor, leading dimension) of rows of F = H * D elements: kept when
    each row is one contiguous run, else copied. (No views are made: a step calls this hundreds of times.)"""
    rows, cols = t.shape[0], t.shape[1] * t.shape[2] if t.dim() == 3 else t.shape[1]
    inner = t.stride(-1) == 1 and (t.dim() == 2 or t.shape[1] == 1 or t.stride(1) == t.shape[2])
    if inner and (rows == 1 or t.stride(0) >= cols):
        return t, max(t.stride(0), cols)
    return t.contiguous(), cols


def _heads_side_by_side(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] itself when each token's heads sit side by side (one stride apart), else a contiguous copy."""
    return t if t.stride(1) == t.shape[2] * t.stride(2) else t.contiguous()


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual) * weight, x + residual)`` of ``[T, N]`` rows; without a residual,
    ``(rms_norm(x) * weight, None)``. Outputs are contiguous."""
    lib = _lib()
    for name, t in (("x", x), ("weight", weight), ("residual", residual if residual is not None else x)):
        _check_float32_cpu(name, t)
    rows, n = x.shape
    x, ld_x = _rows(x)
    out = torch.empty(rows, n)
    if residual is None:
        residual_out = None
        residual_ptr = residual_out_ptr = ld_r = 0
    else:
        residual, ld_r = _rows(residual)
        residual_out = torch.empty(rows, n)
        residual_ptr, residual_out_ptr = residual.data_ptr(), residual_out.data_ptr()
    lib.rms_norm_f32(
        x.data_ptr(), ld_x, residual_ptr, ld_r, weight.contiguous().data_ptr(), rows, n, eps, out.data_ptr(),
        residual_out_ptr, n,
    )
    return out, residual_out


def rotary(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin: torch.Tensor,  # [max_position, rot]: cos of the rot / 2 frequencies, then their sin
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding ("rotate half" form) of the first ``rot`` columns of each head; contiguous outputs.

    Raises:
        IndexError: a position outside ``cos_sin``'s rows (nothing is written).
    """
    lib = _lib()
    rows, num_heads, head_dim = q.shape
    num_kv_heads, rot = k.shape[1], cos_sin.shape[1]
    if rot > head_dim or rot % 2:
        raise ValueError(f"rotary needs an even rotary dim <= head_dim; got {rot} and {head_dim}")
    for name, t in (("q", q), ("k", k), ("cos_sin", cos_sin)):
        _check_float32_cpu(name, t)
    q2, ld_q = _rows(q)
    k2, ld_k = _rows(k)
    q_out, k_out = torch.empty(rows, num_heads, head_dim), torch.empty(rows, num_kv_heads, head_dim)
    status = lib.rotary_f32(
        q2.data_ptr(), ld_q, k2.data_ptr(), ld_k, _int64(positions).data_ptr(),
        cos_sin.contiguous().data_ptr(), cos_sin.shape[0], rows, num_heads, num_kv_heads, head_dim, rot,
        q_out.data_ptr(), num_heads * head_dim, k_out.data_ptr(), num_kv_heads * head_dim,
    )
    if status:
        raise position_error(cos_sin.shape[0])
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` rows ``[T, 2I]``; the output is contiguous."""
    lib = _lib()
    _check_float32_cpu("x", x)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even width; got {width}")
    x, ld_x = _rows(x)
    out = torch.empty(rows, width // 2)
    lib.silu_and_mul_f32(x.data_ptr(), ld_x, rows, width // 2, out.data_ptr(), width // 2)
    return out


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ``[N, K]`` weight in the layout ``linear`` reads (linear_layout.h), panels of ``LINEAR_PANEL`` output
    columns, zero past row ``N``. float32: ``[P, K, LINEAR_PANEL]`` with ``packed[p, k, j] =
    weight[p * LINEAR_PANEL + j, k]``. bfloat16: ``[P, Kp // 2, LINEAR_PANEL, 2]`` with ``packed[p, k // 2,
    j, k % 2]`` the same element, ``K`` padded with zeros to ``Kp``, a multiple of ``BF16_K_ALIGN``."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_cpu or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float32 or bfloat16 CPU tensor; got {weight.dtype} {list(weight.shape)}")
    out_features, in_features = weight.shape
    panels = -(-out_features // LINEAR_PANEL)
    width = in_features if weight.dtype == torch.float32 else -(-in_features // BF16_K_ALIGN) * BF16_K_ALIGN
    padded = torch.zeros(panels * LINEAR_PANEL, width, dtype=weight.dtype)
    padded[:out_features, :in_features] = weight
    if weight.dtype == torch.float32:
        return padded.view(panels, LINEAR_PANEL, width).transpose(1, 2).contiguous()
    return padded.view(panels, LINEAR_PANEL, width // 2, 2).transpose(1, 2).contiguous()


def _packed_shape(packed: torch.Tensor, in_features: int) -> tuple[int, ...]:
    panels = packed.shape[0]
    if packed.dtype == torch.float32:
        return (panels, in_features, LINEAR_PANEL)
    return (panels, -(-in_features // BF16_K_ALIGN) * BF16_K_ALIGN // 2, LINEAR_PANEL, 2)


def packed_rows(packed: torch.Tensor, index: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``weight[index]`` ``[len(index), in_features]`` of a packed weight (an embedding lookup in a
    tied LM head)."""
    if packed.dtype == torch.float32:
        return packed[index // LINEAR_PANEL, :, index % LINEAR_PANEL]
    rows = packed[index // LINEAR_PANEL, :, index % LINEAR_PANEL, :]  # [len, Kp // 2, 2]
    return rows.reshape(len(index), -1)[:, :in_features]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x [M, K]`` (float32 CPU, any strides) and ``W [out_features, K]`` as
    ``pack_linear_weight`` packed it; returns ``[M, out_features]``, contiguous. A bfloat16 weight runs
    the ``bf16_linear_path(M)`` of this CPU."""
    lib = _lib()
    for name, t in (("x", x), ("bias", bias if bias is not None else x)):
        _check_float32_cpu(name, t)
    rows, in_features = x.shape
    panels = -(-out_features // LINEAR_PANEL)
    if packed.dtype not in (torch.float32, torch.bfloat16) or packed.shape != _packed_shape(packed, in_features) \
            or packed.shape[0] != panels:
        raise ValueError(
            f"x [{rows}, {in_features}] needs a weight packed by pack_linear_weight for {out_features} outputs "
            f"({panels} panels); got {packed.dtype} {list(packed.shape)}"
        )
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must have shape [{out_features}]; got {list(bias.shape)}")
    x, ld_x = _rows(x)
    packed = packed.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty(rows, out_features)
    kernel = getattr(lib, f"linear_{_SUFFIX[packed.dtype]}")
    status = kernel(
        x.data_ptr(), ld_x, rows, packed.data_ptr(), out_features, in_features,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), out_features,
    )
    if status:
        raise MemoryError("the bfloat16 linear kernel could not allocate its copy of x")
    return y


def _linear_operands(x: torch.Tensor, weight, bias: torch.Tensor | None):
    """A linear kernel's checked operands: x's rows and leading dimension, bias contiguous (or None), and the
    output ``[M, weight.out_features]``."""
    for name, t in (("x", x), ("bias", bias if bias is not None else x)):
        _check_float32_cpu(name, t)
    rows, in_features = x.shape
    if in_features != weight.in_features:
        raise ValueError(f"x [{rows}, {in_features}] for a weight of {weight.in_features} in_features")
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"bias must have shape [{weight.out_features}]; got {list(bias.shape)}")
    x, ld_x = _rows(x)
    return x, ld_x, bias.contiguous() if bias is not None else None, torch.empty(rows, weight.out_features)


def linear_quantized(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x [M, K]`` (float32 CPU, any strides) and a quantized ``W``
    (``engine.layers.quantization.QuantizedWeight``; with its ``bf16_products`` and more than
    ``QUANTIZED_FLOAT_ROWS`` rows, x and the weights rounded to bfloat16 multiplied on ``bf16_linear_path(M)``
    where that is not ``"widened"``; with its ``int8_products``, x quantized to int8 blocks and int8 products,
    on ``int8_linear_path()``); returns ``[M, N]``, contiguous."""
    lib = _lib()
    x, ld_x, bias, y = _linear_operands(x, weight, bias)
    rows, in_features = x.shape
    args = (
        x.data_ptr(), ld_x, rows, weight.codes.data_ptr(), weight.scales.data_ptr(), weight.out_features,
        in_features, bias.data_ptr() if bias is not None else None, y.data_ptr(), weight.out_features,
    )
    if weight.int8_products:
        status = lib.linear_w8a8_f32(*args)
    else:
        status = getattr(lib, f"linear_{weight.kind}_f32")(*args, int(weight.bf16_products))
    if status:
        raise MemoryError("the quantized linear kernel could not allocate its scratch")
    return y


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The int64 index of each row's first largest value (a NaN counting as the largest, as in
    ``torch.argmax``) of ``logits`` ``[R, V]``: float32 CPU rows, any leading dimension, ``V >= 1``."""
    _check_float32_cpu("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with vocab >= 1; got {list(logits.shape)}")
    logits, ld = _rows(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _lib().argmax_rows_f32(logits.data_ptr(), ld, logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to ``-inf``, in place, the logits of ``rows`` whose bit in ``bitmask`` is 0.

    Args:
        logits: ``[R, V]`` float32 CPU rows (row-major, any leading dimension).
        bitmask: ``[R', ceil(V / 32)]`` int32, contiguous; row ``r`` of the logits takes row ``r``.
        rows: The rows to mask, each below ``min(R, R')``.
    """
    _check_float32_cpu("logits", logits)
    num_rows, vocab = logits.shape
    words = (vocab + 31) // 32
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[1] != words:
        raise ValueError(f"bitmask must be a contiguous int32 tensor of {words} words a row; got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows and not 0 <= min(rows) <= max(rows) < min(num_rows, bitmask.shape[0]):
        raise IndexError(f"rows must be in [0, {min(num_rows, bitmask.shape[0])})")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    index = torch.tensor(rows, dtype=torch.int64)
    _lib().apply_token_bitmask_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), words, index.data_ptr(), len(rows), vocab
    )


def ggml_parts(parts: list[tuple[int, torch.Tensor]]) -> ctypes.Array:
    """The C view of a weight's parts, each ``(ggml type id, uint8 rows [rows, row bytes])``; the tensors must
    outlive it."""
    array = (abi.GGMLPart * len(parts))()
    for entry, (type_id, data) in zip(array, parts):
        entry.data, entry.rows, entry.type = data.data_ptr(), data.shape[0], type_id
    return array


def ggml_repacked(type_id: int, data: torch.Tensor, in_features: int) -> tuple[int, torch.Tensor]:
    """A part ``(ggml type id, uint8 rows [rows, row bytes])`` in the layout this CPU's path multiplies fastest:
    Q4_0, Q4_K and Q6_K rows in groups of 16 (``ggml_x16.h``, a new tensor of the same bytes, under the x16 type
    id) on the AVX512-VNNI path; else the part as it is."""
    lib = _lib()
    x16 = lib.ggml_x16_type_for(type_id, data.shape[0])
    if x16 < 0:
        return type_id, data
    out = torch.empty_like(data)
    if lib.ggml_x16_pack(type_id, data.data_ptr(), data.shape[0], in_features, out.data_ptr()):
        raise ValueError(f"ggml type {type_id} with {in_features} features has no 16-row layout")
    return x16, out


def linear_ggml(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x [M, K]`` (float32 CPU, any strides) and ``W`` in ggml types
    (``engine.layers.ggml_weight.GGMLWeight``); returns ``[M, N]``, contiguous."""
    lib = _lib()
    x, ld_x, bias, y = _linear_operands(x, weight, bias)
    rows, in_features = x.shape
    status = lib.linear_ggml_f32(
        x.data_ptr(), ld_x, rows, ctypes.addressof(weight.c_parts), len(weight.c_parts), in_features,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), weight.out_features,
    )
    if status == -1:
        raise ValueError(f"a weight part's type does not divide {in_features} features into its blocks")
    if status:
        raise MemoryError("the ggml linear kernel could not allocate its scratch")
    return y


def ggml_rows(type_id: int, data: torch.Tensor, index: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``index`` of a weight of ggml type ``type_id`` (``data`` uint8 ``[rows, row bytes]``, contiguous),
    dequantized to float32 ``[len(index), in_features]``."""
    index = _int64(index)
    if len(index) and not 0 <= int(index.min()) <= int(index.max()) < data.shape[0]:
        raise IndexError(f"a row index outside [0, {data.shape[0]})")
    out = torch.empty(len(index), in_features)
    status = _lib().ggml_dequantize_rows(type_id, data.data_ptr(), in_features, index.data_ptr(), len(index),
                                         out.data_ptr())
    if status == -1:
        raise ValueError(f"ggml type {type_id} with {in_features} features is not served by the kernels")
    if status:
        raise MemoryError("the ggml row lookup could not allocate its scratch")
    return out
