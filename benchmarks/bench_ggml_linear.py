"""GGUF block weights against ``w8a8``'s int8 panels of the same shape, by rows of x: what a step of that many
sequences pays for keeping a file's blocks.

For Q4_K and Q6_K on AVX512-VNNI, two ways that give the same bits: the group tiles (16 columns, 4 rows of x a
tile, scales unpacked each tile) and the pairs of groups unpacked once a call (``ggml_unpacked.h``, from 4 rows),
the first timed by raising the rows the pairs start from. Weights are random valid blocks (speed does not depend
on their values). The least CPU time of ``--repeats`` calls (one thread by default: CPU time holds on a busy
machine, where wall time does not), in microseconds, with the ratio to ``w8a8``.

    python benchmarks/bench_ggml_linear.py                           # 2048x2048 and 2048x8192, Q4_K and Q6_K
    python benchmarks/bench_ggml_linear.py --types Q4_K --shape 8192x2048 --rows 1,16,64 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine import cpu_kernels
from engine.layers.ggml_weight import GGMLWeight
from engine.model_files.gguf import GGML_TYPES, TYPE_IDS

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_int8")
# where a block's f16 scales sit: (byte offsets, in the block) of d (and dmin)
SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}


def random_blocks(type_name: str, rows: int, features: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of ``type_name``: random codes, f16 scales near 0.01."""
    _, block, block_bytes = GGML_TYPES[TYPE_IDS[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, features // block, block_bytes), dtype=np.uint8)
    for offset in SCALE_BYTES[type_name]:
        scales = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _least_cpu_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--shape", default="2048x2048,2048x8192", help="out x in features, comma-separated")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    lib = cpu_kernels.library()
    if lib is None:
        raise SystemExit("the CPU kernels are not available on this machine")
    torch.set_num_threads(args.threads)
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    print(f"threads={args.threads} ggml path={cpu_kernels.ggml_linear_path()} int8 path="
          f"{cpu_kernels.int8_linear_path()} flags: " + " ".join(f for f in FLAGS if f in flags))  # fmt: skip
    print("| type | shape | rows | group tiles us | x w8a8 | unpacked pairs us | x w8a8 | w8a8 us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shape.split(","):
        out_features, in_features = (int(n) for n in shape.split("x"))
        for type_name in args.types.split(","):
            weight = GGMLWeight.from_numpy([(type_name, random_blocks(type_name, out_features, in_features))], in_features)
            w8a8 = weight.int8_panels()
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                int8_us = _least_cpu_us(lambda: cpu_kernels.linear_quantized(x, w8a8), args.repeats)
                lib.ggml_unpacked_rows(1 << 40)
                tiles_us = _least_cpu_us(lambda: weight.matmul(x, None), args.repeats)
                lib.ggml_unpacked_rows(4)
                pairs_us = _least_cpu_us(lambda: weight.matmul(x, None), args.repeats) if rows >= 4 else None
                pairs = f"{pairs_us:.0f} | {pairs_us / int8_us:.2f}" if pairs_us is not None else "- | -"
                print(f"| {type_name} | {shape} | {rows} | {tiles_us:.0f} | {tiles_us / int8_us:.2f} | {pairs} "
                      f"| {int8_us:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
