"""The C library's structs as ctypes mirrors, and the check that a loaded library matches them.

``decoder.c`` exports every mirrored struct's size and field offsets (``paged_abi_layout``), its ABI version and
the instruction sets it was compiled for (``paged_build_features``). ``mismatch(lib)`` compares them with these
mirrors and with this CPU's features, so that a stale or foreign library in the cache is rebuilt instead of
being called with the wrong layout or crashing on an instruction the CPU lacks.
"""

from __future__ import annotations

import ctypes

ABI_VERSION = 3  # decoder.c's ABI_VERSION


class LinearPlan(ctypes.Structure):
    """decoder.c's ``linear_plan``."""

    _fields_ = [
        ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
        ("kind", ctypes.c_int32), ("bf16_products", ctypes.c_int32), ("num_parts", ctypes.c_int64),
    ]  # fmt: skip


class LayerPlan(ctypes.Structure):
    """decoder.c's ``layer_plan``."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("qkv", LinearPlan), ("o", LinearPlan), ("gate_up", LinearPlan), ("down", LinearPlan),
        ("router", ctypes.c_void_p), ("experts", ctypes.c_void_p),
    ]  # fmt: skip


class DecoderPlan(ctypes.Structure):
    """decoder.c's ``decoder_plan``."""

    _fields_ = [
        ("layers", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
        *[(name, ctypes.c_int64) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "rotary_dim",
            "max_positions", "block_size", "num_blocks", "window",
        )],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_bf16", ctypes.c_int32),
        ("renormalize", ctypes.c_int32), ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
        ("expert_intermediate", ctypes.c_int64),
    ]  # fmt: skip


class DecoderStep(ctypes.Structure):
    """decoder.c's ``decoder_step``."""

    _fields_ = [
        ("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p), ("tile_rows", ctypes.c_void_p), ("tile_starts", ctypes.c_void_p),
        ("tile_shared", ctypes.c_void_p),
        ("tokens", ctypes.c_int64), ("table_stride", ctypes.c_int64), ("num_tiles", ctypes.c_int64),
    ]  # fmt: skip


class GGMLPart(ctypes.Structure):
    """kernels.h's ``ggml_part``: one part of a weight in a ggml type, its rows, their count, the type id."""

    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("type", ctypes.c_int32), ("reserved", ctypes.c_int32)]


_MIRRORS = {
    "linear_plan": LinearPlan, "layer_plan": LayerPlan, "decoder_plan": DecoderPlan, "decoder_step": DecoderStep,
    "ggml_part": GGMLPart,
}  # fmt: skip


class _Entry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def expected_layout() -> dict[str, int]:
    """Every mirrored struct's size and field offsets as the C side names them (``struct``, ``struct.field``)."""
    layout = {}
    for c_name, mirror in _MIRRORS.items():
        layout[c_name] = ctypes.sizeof(mirror)
        for field, *_ in mirror._fields_:
            if field != "reserved":
                layout[f"{c_name}.{field}"] = getattr(mirror, field).offset
    return layout


def library_layout(lib: ctypes.CDLL) -> dict[str, int]:
    """The sizes and offsets the library was compiled with."""
    lib.paged_abi_layout.argtypes, lib.paged_abi_layout.restype = [ctypes.POINTER(ctypes.POINTER(_Entry))], ctypes.c_int64
    entries = ctypes.POINTER(_Entry)()
    count = lib.paged_abi_layout(ctypes.byref(entries))
    return {entries[i].name.decode(): entries[i].value for i in range(count)}


def build_features(lib: ctypes.CDLL) -> set[str]:
    """The instruction sets the library was compiled for (``/proc/cpuinfo``'s names)."""
    lib.paged_build_features.restype = ctypes.c_char_p
    return set(lib.paged_build_features().decode().split())


def mismatch(lib: ctypes.CDLL, cpu_flags: set[str] | None) -> str | None:
    """Why ``lib`` must not be used here (a different ABI version, struct layout, or an instruction set this CPU
    lacks; ``cpu_flags`` None skips the last check), or None where it matches."""
    try:
        lib.paged_abi_version.restype = ctypes.c_int
        version = lib.paged_abi_version()
    except AttributeError:
        return "it exports no ABI version"
    if version != ABI_VERSION:
        return f"ABI version {version}, expected {ABI_VERSION}"
    got, expected = library_layout(lib), expected_layout()
    differing = sorted(name for name in got.keys() | expected.keys() if got.get(name) != expected.get(name))
    if differing:
        name = differing[0]
        return f"struct layout differs at {name} (library {got.get(name)}, Python {expected.get(name)})"
    if cpu_flags is not None and (missing := build_features(lib) - cpu_flags):
        return f"built for {', '.join(sorted(missing))}, which this CPU lacks"
    return None
