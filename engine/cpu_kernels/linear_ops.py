"""The linear kernels' wrappers: weights packed once into panels (float32, bfloat16), quantized blocks
(int8, 4-bit, int8 products) and GGUF's own types (``linear.c``, ``linear_bf16.c``, ``linear_int8.c``,
``linear_ggml.c``), with the paths they run on this CPU."""

from __future__ import annotations

import ctypes

import torch

from engine.cpu_kernels import abi
from engine.cpu_kernels._operands import DTYPE_SUFFIX, as_int64, as_rows, check_float32_cpu
from engine.cpu_kernels.build import BF16_LINEAR_PATHS, GGML_LINEAR_PATHS, INT8_LINEAR_PATHS, loaded

LINEAR_PANEL = 16  # output columns of a packed weight's panel (PANEL in linear_layout.h)
QUANTIZED_FLOAT_ROWS = 6  # up to this many rows a quantized layer computes in float32 (TILE_ROWS in linear.c)
BF16_K_ALIGN = 32  # a packed bfloat16 weight's input features are padded to a multiple of this (linear_layout.h)


def bf16_linear_path(rows: int) -> str:
    """What a bfloat16 ``linear`` of ``rows`` rows runs on this CPU: one of ``BF16_LINEAR_PATHS``."""
    return BF16_LINEAR_PATHS[loaded().linear_bf16_path(rows)]


def int8_linear_path() -> str:
    """What a linear with int8 products (``quantization="w8a8"``) runs on this CPU: one of ``INT8_LINEAR_PATHS``."""
    return INT8_LINEAR_PATHS[loaded().linear_int8_path()]


def ggml_linear_path() -> str:
    """What a linear over GGUF-type weights (``linear_ggml``) runs on this CPU: one of ``GGML_LINEAR_PATHS``."""
    return GGML_LINEAR_PATHS[loaded().ggml_linear_path()]


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
    lib = loaded()
    for name, t in (("x", x), ("bias", bias if bias is not None else x)):
        check_float32_cpu(name, t)
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
    x, ld_x = as_rows(x)
    packed = packed.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty(rows, out_features)
    kernel = getattr(lib, f"linear_{DTYPE_SUFFIX[packed.dtype]}")
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
        check_float32_cpu(name, t)
    rows, in_features = x.shape
    if in_features != weight.in_features:
        raise ValueError(f"x [{rows}, {in_features}] for a weight of {weight.in_features} in_features")
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"bias must have shape [{weight.out_features}]; got {list(bias.shape)}")
    x, ld_x = as_rows(x)
    return x, ld_x, bias.contiguous() if bias is not None else None, torch.empty(rows, weight.out_features)


def linear_quantized(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x [M, K]`` (float32 CPU, any strides) and a quantized ``W``
    (``engine.layers.quantization.QuantizedWeight``; with its ``bf16_products`` and more than
    ``QUANTIZED_FLOAT_ROWS`` rows, x and the weights rounded to bfloat16 multiplied on ``bf16_linear_path(M)``
    where that is not ``"widened"``; with its ``int8_products``, x quantized to int8 blocks and int8 products,
    on ``int8_linear_path()``); returns ``[M, N]``, contiguous."""
    lib = loaded()
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


def ggml_parts(parts: list[tuple[int, torch.Tensor]]) -> ctypes.Array:
    """The C view of a weight's parts, each ``(ggml type id, uint8 rows [rows, row bytes])``; the tensors must
    outlive it."""
    array = (abi.GGMLPart * len(parts))()
    for entry, (type_id, data) in zip(array, parts):
        entry.data, entry.rows, entry.type = data.data_ptr(), data.shape[0], type_id
    return array


def ggml_repacked(type_id: int, data: torch.Tensor, in_features: int) -> tuple[int, torch.Tensor]:
    """A part ``(ggml type id, uint8 rows [rows, row bytes])`` in the layout this CPU's path multiplies fastest:
    Q4_0, Q8_0, Q4_K and Q6_K rows in groups of 16 (``ggml_x16.h``, a new tensor of the same bytes, under the x16 type
    id) on the AVX512-VNNI path; else the part as it is."""
    lib = loaded()
    x16 = lib.ggml_x16_type_for(type_id, data.shape[0])
    if x16 < 0:
        return type_id, data
    out = torch.empty_like(data)
    if lib.ggml_x16_pack(type_id, data.data_ptr(), data.shape[0], in_features, out.data_ptr()):
        raise ValueError(f"ggml type {type_id} with {in_features} features has no 16-row layout")
    return x16, out


def ggml_int8_panels(parts: list[tuple[int, torch.Tensor]], in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight of ggml ``parts`` (each ``(type id, uint8 rows)``, the kernels' layout: x16 types too) as the int8
    products' panels (``linear_int8.c``) of its dequantized rows, each block of 32 rotated and quantized to
    symmetric int8: codes ``[P, K / 32, 8, LINEAR_PANEL, 4]`` uint8 and scales ``[P, K / 32, LINEAR_PANEL]``
    float32, rows past the weight's zero (``quantization.pack``'s layout, ``int8_products``)."""
    rows = sum(data.shape[0] for _, data in parts)
    panels, blocks = -(-rows // LINEAR_PANEL), in_features // 32
    codes = torch.zeros(panels, blocks, 8, LINEAR_PANEL, 4, dtype=torch.uint8)
    scales = torch.zeros(panels, blocks, LINEAR_PANEL)
    first = 0
    for type_id, data in parts:
        status = loaded().ggml_int8_panels(type_id, data.data_ptr(), data.shape[0], in_features, first,
                                           codes.data_ptr(), scales.data_ptr())
        if status == -3:
            raise MemoryError("the ggml int8 panels could not allocate a row's scratch")
        if status:
            raise ValueError(f"ggml type {type_id} with {in_features} features has no int8 panels")
        first += data.shape[0]
    return codes, scales


def linear_ggml(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x [M, K]`` (float32 CPU, any strides) and ``W`` in ggml types
    (``engine.layers.ggml_weight.GGMLWeight``); returns ``[M, N]``, contiguous."""
    lib = loaded()
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
    index = as_int64(index)
    if len(index) and not 0 <= int(index.min()) <= int(index.max()) < data.shape[0]:
        raise IndexError(f"a row index outside [0, {data.shape[0]})")
    out = torch.empty(len(index), in_features)
    status = loaded().ggml_dequantize_rows(type_id, data.data_ptr(), in_features, index.data_ptr(), len(index),
                                         out.data_ptr())
    if status == -1:
        raise ValueError(f"ggml type {type_id} with {in_features} features is not served by the kernels")
    if status:
        raise MemoryError("the ggml row lookup could not allocate its scratch")
    return out
