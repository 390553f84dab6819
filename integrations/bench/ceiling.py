"""The machine's own ceilings for a model: matmul throughput at its linear-layer shapes, and memory-read speed.

A decode step of ``batch`` sequences multiplies a ``[batch, in]`` activation by every
linear layer's ``[in, out]`` weight once per token, so a token costs
``2 * params_in_matmuls`` FLOPs. Timing exactly those matmuls at the run's dtype gives the
best tokens/s the machine can reach for this model if everything else (attention,
norms, sampling, Python) were free; the engine's throughput is reported as a fraction of it.
At batch 1 a decode step reads every weight byte and the KV cache once: ``read_bandwidth``
measures how fast this machine reads memory, which bounds that step (``batch1``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine import cpu_kernels


def linear_shapes(config: dict[str, Any]) -> Counter[tuple[int, int]]:
    """``(in_features, out_features) -> count`` of every matmul one token goes through.

    Covers the Llama family (Llama, Mistral, Qwen2/3, SmolLM): q/k/v/o projections, the
    gated MLP and the LM head (tied or not, it is one more matmul).
    """
    hidden = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    intermediate = config["intermediate_size"]
    layers = config["num_hidden_layers"]
    shapes: Counter[tuple[int, int]] = Counter()
    shapes[(hidden, num_heads * head_dim)] += layers  # q
    shapes[(hidden, num_kv_heads * head_dim)] += 2 * layers  # k, v
    shapes[(num_heads * head_dim, hidden)] += layers  # o
    shapes[(hidden, intermediate)] += 2 * layers  # gate, up
    shapes[(intermediate, hidden)] += layers  # down
    shapes[(hidden, config["vocab_size"])] += 1  # lm head
    return shapes


def _time_linear(
    batch: int, in_features: int, out_features: int, dtype: torch.dtype, weight_dtype: torch.dtype, min_time_s: float
) -> float:
    """Seconds per ``[batch, in] x [in, out]`` product: the best of a few timed rounds, and the fastest
    way this machine has: BLAS's two orientations, ``x W^T`` and ``(W x^T)^T`` (they differ by up to
    2x at decode sizes), and the engine's C kernel over a packed weight where it serves these dtypes."""
    x = torch.randn(batch, in_features, dtype=dtype)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    candidates = [lambda: F.linear(x, weight), lambda: torch.mm(weight, x.t())] if weight_dtype == dtype else []
    if weight_dtype == torch.bfloat16 != dtype:  # BLAS in bfloat16 (oneDNN's AMX kernels where the CPU has them)
        x16, weight16 = x.to(weight_dtype), weight.to(weight_dtype)
        candidates.append(lambda: F.linear(x16, weight16))
    if dtype == torch.float32 and cpu_kernels.library() is not None:
        packed = cpu_kernels.pack_linear_weight(weight.to(weight_dtype))
        candidates.append(lambda: cpu_kernels.linear(x, packed, out_features))
    return min(_best_seconds(fn, min_time_s / len(candidates)) for fn in candidates)


def _best_seconds(fn: Callable[[], Any], min_time_s: float) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn()
        best = float("inf")
        deadline = time.perf_counter() + min_time_s
        while True:
            reps = 0
            start = time.perf_counter()
            while reps < 8 or time.perf_counter() - start < min_time_s / 4:
                fn()
                reps += 1
            best = min(best, (time.perf_counter() - start) / reps)
            if time.perf_counter() >= deadline:
                return best


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes a second this machine reads from memory on the run's threads: the best of ``repeats`` reads of a
    buffer of ``nbytes`` (far past the caches), 64 bytes a load (``memory_read.c``; torch's sum without the
    kernels)."""
    buffer = torch.ones(nbytes // 4)
    lib = cpu_kernels.library()
    read = (lambda: lib.memory_read(buffer.data_ptr(), buffer.nbytes)) if lib is not None else buffer.sum
    read()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


def measure_ceiling(
    model_dir: Path, dtype: torch.dtype, weight_dtype: torch.dtype | None = None, batch: int = 64,
    min_time_s: float = 0.3,
) -> dict[str, Any]:
    """Matmul GFLOP/s at the model's shapes and the tokens/s ceiling it implies.

    Args:
        model_dir: Hugging Face model directory (its ``config.json`` gives the shapes).
        dtype: the dtype the products are computed in.
        weight_dtype: the dtype the weights are stored in (default ``dtype``): bfloat16 weights
            computed in float32 are timed only through the kernel that widens them.
        batch: rows of the activation (the number of sequences decoded together).
        min_time_s: timing budget per distinct shape.

    Returns:
        ``{"dtype", "weight_dtype", "batch", "params_in_matmuls", "flops_per_token", "step_s", "gflops",
        "tokens_per_s", "threads", "shapes": [{"in", "out", "count", "gflops"}]}``.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = linear_shapes(config)
    step_s, per_shape = 0.0, []
    for (in_features, out_features), count in sorted(shapes.items()):
        seconds = _time_linear(batch, in_features, out_features, dtype, weight_dtype or dtype, min_time_s)
        step_s += count * seconds
        per_shape.append(
            {
                "in": in_features,
                "out": out_features,
                "count": count,
                "gflops": 2 * batch * in_features * out_features / seconds / 1e9,
            }
        )
    params = sum(i * o * c for (i, o), c in shapes.items())
    flops_per_token = 2 * params
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "weight_dtype": str(weight_dtype or dtype).removeprefix("torch."),
        "batch": batch,
        "params_in_matmuls": params,
        "flops_per_token": flops_per_token,
        "step_s": step_s,
        "gflops": flops_per_token * batch / step_s / 1e9,
        "tokens_per_s": batch / step_s,
        "threads": torch.get_num_threads(),
        "shapes": per_shape,
    }
