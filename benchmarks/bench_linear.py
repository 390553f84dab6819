"""The CPU linear kernels per path: float32, each bfloat16 path this CPU has, int8 weights alone and with int8
products (``w8a8``), and PyTorch's bfloat16 F.linear.

The bfloat16 paths (``cpu_kernels.BF16_LINEAR_PATHS``: widened to float32, AVX512-BF16 dot products,
AMX tiles) read the same packed weight; each is timed by capping the kernels' choice at it, so a
path shows only from the row counts where the kernels take it (AMX from 16 rows). Best of
``--repeats`` hot calls, in microseconds, with the CPU's flags.

    python benchmarks/bench_linear.py                          # the bundled model's gate/up shape
    python benchmarks/bench_linear.py --shape 1536x576 --rows 1,64,512
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.layers import quantization

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _best_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="3072x576", help="out x in features")
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    lib = cpu_kernels.library()
    if lib is None:
        raise SystemExit("the CPU kernels are not available on this machine")
    out_features, in_features = (int(n) for n in args.shape.split("x"))
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    print(f"threads={torch.get_num_threads()} shape={out_features}x{in_features} flags: "
          + " ".join(f for f in FLAGS if f in flags))  # fmt: skip
    weight = torch.randn(out_features, in_features)
    packed = cpu_kernels.pack_linear_weight(weight)
    packed16 = cpu_kernels.pack_linear_weight(weight.bfloat16())
    weight16 = weight.bfloat16()
    int8 = quantization.pack(quantization.quantize_int8(weight))
    w8a8 = quantization.pack(quantization.quantize_symmetric_int8(quantization.hadamard_blocks(weight)), int8_products=True)
    paths = cpu_kernels.BF16_LINEAR_PATHS
    print(
        "| rows | float32 | " + " | ".join(f"bfloat16 {p}" for p in paths)
        + f" | torch bfloat16 | bfloat16 best vs float32 | int8 | w8a8 ({cpu_kernels.int8_linear_path()}) | w8a8 vs float32 |"
    )
    print("| ---: " * (len(paths) + 7) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, in_features)
        f32 = _best_us(lambda: cpu_kernels.linear(x, packed, out_features), args.repeats)
        cells, best = [], f32
        for i, path in enumerate(paths):
            lib.linear_bf16_limit(i)
            if cpu_kernels.bf16_linear_path(rows) != path:
                cells.append("-")
                continue
            us = _best_us(lambda: cpu_kernels.linear(x, packed16, out_features), args.repeats)
            best = min(best, us)
            cells.append(f"{us:.1f}")
        lib.linear_bf16_limit(len(paths) - 1)
        x16 = x.bfloat16()
        torch_us = _best_us(lambda: F.linear(x16, weight16), args.repeats)
        int8_us = _best_us(lambda: cpu_kernels.linear_quantized(x, int8), args.repeats)
        w8a8_us = _best_us(lambda: cpu_kernels.linear_quantized(x, w8a8), args.repeats)
        print(
            f"| {rows} | {f32:.1f} | " + " | ".join(cells) + f" | {torch_us:.1f} | {f32 / best:.2f}x"
            f" | {int8_us:.1f} | {w8a8_us:.1f} | {f32 / w8a8_us:.2f}x |"
        )


if __name__ == "__main__":
    main()
