"""Building the C kernels: compiled on first use, loaded with ctypes, their signatures bound.

The sources ship with the package; the first process that needs a kernel compiles them
into one library with the system C compiler (``$CC``, else ``cc``) for this machine
(``-march=native``) into ``$PAGED_CACHE/cpu_kernels/``, keyed by a digest of the sources,
the flags, the compiler's version and the CPU's feature flags, so a later process only
loads it. A cached library that does not load, or whose struct layout, ABI version or instruction
sets do not match (``abi.mismatch``), is rebuilt once, with one log line. The library is linked
against OpenMP and shares torch's thread pool (torch ships the same ``libgomp.so.1``), so
``torch.set_num_threads`` governs it too.

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

from engine.cpu_kernels import abi
from engine.paths import cache_root

logger = logging.getLogger(__name__)

_SOURCES = (
    "vec.h", "kernels.h", "linear.h", "linear_layout.h", "linear_path.h", "linear_tiles16.h", "bf16_kernels.h",
    "attention_amx.h", "attention_dot.h", "attention_rows.h", "attention_split.h", "attention.c", "attention_bf16.c", "attention_i8.c",
    "encoder_attention.c", "elementwise.c", "memory_read.c",
    "linear.c", "linear_path.c", "linear_bf16.c", "linear_int8.c", "token_mask.c", "argmax.c", "decoder.c",
    "ggml_blocks.h", "ggml_generic.h", "ggml_avx2.h", "ggml_x16.h", "ggml_avx512.h", "ggml_unpacked.h", "linear_ggml.c",
)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# What linear_bf16 runs, by the C enum's value: widened to float32, AVX512-BF16 dot products, AMX tiles.
BF16_LINEAR_PATHS = ("widened", "avx512-bf16", "amx")
# What a multi-row tile's shared keys in a bfloat16 cache run, by the C enum's value: float32 vectors over the
# widened cache, AVX512-BF16 dot products (attention_dot.h), AMX tiles (attention_amx.h).
BF16_ATTENTION_PATHS = ("widened", "avx512-bf16", "amx")
# What an encoder's bidirectional attention of bfloat16 inputs runs on, by the C enum's value (encoder_attention.c):
# float32 vectors over the widened inputs, AVX512-BF16 dot products; as a cap, "auto" is the dot products where
# they out-run the widened FMAs, and capping at "avx512-bf16" takes them wherever the CPU has them.
BF16_ENCODER_ATTENTION_PATHS = ("widened", "avx512-bf16")
ENCODER_ATTENTION_CAPS = (*BF16_ENCODER_ATTENTION_PATHS, "auto")
# What linear_w8a8 multiplies on, by the C enum's value: int8 sums in plain C, AVX512-VNNI.
INT8_LINEAR_PATHS = ("generic", "avx512-vnni")
# What linear_ggml runs on, by the C enum's value: plain C, AVX2, AVX512-VNNI (Q4_0, Q8_0, Q4_K, Q5_K and Q6_K repacked in
# groups of 16 rows at load, ggml_x16.h; the other types on AVX2).
GGML_LINEAR_PATHS = ("generic", "avx2", "avx512-vnni")
# Where attention fetches the cache lines of the next chunk, by attention_fetch_into's level: the machine's
# default (L2 where the L1 data cache holds under 48 KiB, else L1), L1, L2 only.
ATTENTION_FETCH = ("auto", "l1", "l2")
# When attention splits its rows by keys across the threads, by the C enum's value (attention_split.h): never, with
# fewer rows than threads and a context longer than a span, always.
ATTENTION_SPLIT = ("off", "auto", "always")


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
    # q, its row stride, k, its, v, its, cu_seqlens, number of sequences, heads, head_dim, scale, out, its row stride
    "encoder_attention_f32": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, *[_I64] * 3, _F32, _PTR, _I64],
    "encoder_attention_bf16_path": [_I64],  # head_dim
    "encoder_attention_bf16_limit": [ctypes.c_int],
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
    "attention_split_mode": [ctypes.c_int],  # an ATTENTION_SPLIT index
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
    "ggml_unpacked_rows": [_I64],
    "memory_read": [_PTR, _I64],  # data, bytes
    "ggml_x16_type_for": [ctypes.c_int32, _I64],  # ggml type, rows
    "ggml_x16_pack": [ctypes.c_int32, _PTR, _I64, _I64, _PTR],  # ggml type, data, rows, in features, out
    # ggml type, data, rows, in features, first output row, codes, scales
    "ggml_int8_panels": [ctypes.c_int32, _PTR, _I64, _I64, _I64, _PTR, _PTR],
    # plan, tokens (decoder.c)
    "decoder_scratch": [_PTR, _I64],
    # plan, step, x, out, scratch, the failing kernel (out)
    "decoder_forward": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR],
}
# The kernels built for a bfloat16 cache or weight take the float32 ones' arguments.
_SIGNATURES |= {
    f"{name}_bf16": _SIGNATURES[f"{name}_f32"] for name in ("paged_attention", "store_kv", "linear", "encoder_attention")
}
# An int8 cache's kernels: the float32 ones' arguments and the scales (k_scales, v_scales: [num_blocks, Hkv]).
_SIGNATURES |= {
    "paged_attention_i8": [*_SIGNATURES["paged_attention_f32"], _PTR, _PTR],
    # k and its two strides, v and its two strides, slots, rows, KV heads, head_dim, block_size, k_cache, v_cache,
    # k_scales, v_scales, number of slots
    "store_kv_i8": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, *[_I64] * 4, _PTR, _PTR, _PTR, _PTR, _I64],
}
# 0, or < 0 on bad arguments
_RETURN_STATUS = {
    "paged_attention_f32", "paged_attention_bf16", "paged_attention_i8", "store_kv_f32", "store_kv_bf16", "store_kv_i8", "rotary_f32", "linear_q8_f32",
    "linear_w8a8_f32", "linear_int8_path", "linear_bf16", "linear_bf16_path", "attention_bf16_path", "attention_max_lanes",
    "attention_fetch_level", "encoder_attention_f32", "encoder_attention_bf16", "encoder_attention_bf16_path",
    "decoder_forward", "linear_ggml_f32", "ggml_dequantize_rows", "ggml_linear_path",
    "ggml_x16_type_for", "ggml_x16_pack", "ggml_int8_panels",
}
_RESTYPES = {name: ctypes.c_int for name in _RETURN_STATUS} | {
    "decoder_scratch": ctypes.c_int64, "ggml_type_row_bytes": ctypes.c_int64, "memory_read": ctypes.c_uint64,
}  # else void


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here (or ``PAGED_CPU_KERNELS=0``).

    ``PAGED_BF16_LINEAR`` (one of ``BF16_LINEAR_PATHS``) caps the bfloat16 linear path, e.g.
    ``widened`` to compute bfloat16 weights in float32 on a CPU with bfloat16 arithmetic;
    ``PAGED_BF16_ATTENTION`` (one of ``BF16_ATTENTION_PATHS``) the path of shared keys in a bfloat16 cache;
    ``PAGED_BF16_ENCODER_ATTENTION`` (one of ``ENCODER_ATTENTION_CAPS``) that of an encoder's bfloat16 attention;
    ``PAGED_INT8_LINEAR`` (one of ``INT8_LINEAR_PATHS``) the path of int8 products;
    ``PAGED_GGML_LINEAR`` (one of ``GGML_LINEAR_PATHS``) the path of GGUF-type weights;
    ``PAGED_ATTENTION_FETCH`` (one of ``ATTENTION_FETCH``) the cache level attention fetches ahead into;
    ``PAGED_ATTENTION_SPLIT`` (one of ``ATTENTION_SPLIT``) when attention splits its rows by keys.
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
        ("PAGED_BF16_ENCODER_ATTENTION", ENCODER_ATTENTION_CAPS, lib.encoder_attention_bf16_limit, "auto"),
        ("PAGED_INT8_LINEAR", INT8_LINEAR_PATHS, lib.linear_int8_limit, INT8_LINEAR_PATHS[-1]),
        ("PAGED_GGML_LINEAR", GGML_LINEAR_PATHS, lib.ggml_linear_limit, GGML_LINEAR_PATHS[-1]),
        ("PAGED_ATTENTION_FETCH", ATTENTION_FETCH, lib.attention_fetch_into, "auto"),
        ("PAGED_ATTENTION_SPLIT", ATTENTION_SPLIT, lib.attention_split_mode, "auto"),
    ):
        value = os.environ.get(variable, default)
        if value not in paths:
            raise ValueError(f"{variable} must be one of {', '.join(paths)}; got {value!r}")
        choose(paths.index(value))
    return lib


def loaded() -> ctypes.CDLL:
    """``library()``, which an op needs: RuntimeError where the kernels cannot be built here."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return lib
