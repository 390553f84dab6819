"""Forward time of a random Mixtral-shaped model against a dense Llama of the same active size.

Both are random-weight models of ``--layers`` layers and ``--hidden`` features: the MoE one has ``--experts``
experts of ``--expert-intermediate`` a layer, ``--top-k`` a token; the dense one an MLP of ``top_k x
expert-intermediate``, so a token multiplies as many weights in each. Each model runs twice: on the
one-C-call decoder plan (as it serves) and on the modules (``enforce_eager``). All runners are loaded first and
each step is timed on them in turn, round after round: ``forward ms`` is the median of the rounds, ``vs dense``
the median over rounds of the dense plan's time over the runner's in the same round, so a change of load between
rounds does not move it; the load average before and after and the CPU's vector flags are printed with it.

    python benchmarks/bench_moe.py                       # hidden 1024, 8 experts top-2 of 1024, 8 layers
    python benchmarks/bench_moe.py --batches 1,16,64 --formats float32,bfloat16,float32:int8
    python benchmarks/bench_moe.py --threads 1          # on a shared machine: no thread waits at a barrier
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from bench_forward import _decode_step, _prefill_step, _save_random, _time_rounds

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner

_CPU_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--formats", default="float32", help="comma-separated dtype[:quantization]")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=256, help="context length of every decode sequence")
    parser.add_argument("--prefill", type=int, default=256, help="tokens of the prefill step (0: skip)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (the kernels' too)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import transformers

    shape = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    needed = max(batches) * -(-args.context // block_size) + -(-args.prefill // block_size)
    cpuinfo = Path("/proc/cpuinfo")
    flags = sorted(_CPU_FLAGS & set(cpuinfo.read_text().split())) if cpuinfo.exists() else []
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) before; CPU flags: {' '.join(flags)}")
    print(
        f"threads={torch.get_num_threads()} hidden={args.hidden} layers={args.layers} experts={args.experts} "
        f"top_k={args.top_k} expert_intermediate={args.expert_intermediate} vocab={args.vocab} "
        f"context={args.context} repeats={args.repeats}"
    )
    print("| format | model | step | forward ms | tokens/s | vs dense |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir = _save_random(
            transformers.MixtralConfig(
                **shape, intermediate_size=args.expert_intermediate, num_local_experts=args.experts,
                num_experts_per_tok=args.top_k, sliding_window=None,
            ),
            Path(tmp) / "moe",
        )  # fmt: skip
        dense_dir = _save_random(
            transformers.LlamaConfig(**shape, intermediate_size=args.top_k * args.expert_intermediate),
            Path(tmp) / "dense",
        )
        names, runners = [], []
        for fmt in args.formats.split(","):
            dtype, _, quantization = fmt.partition(":")
            for model, path, eager in (("dense", dense_dir, False), ("dense modules", dense_dir, True),
                                       ("moe", moe_dir, False), ("moe modules", moe_dir, True)):
                config = EngineConfig(
                    dtype=dtype, block_size=block_size, num_blocks=needed, quantization=quantization or None,
                    enforce_eager=eager,
                )  # fmt: skip
                names.append((fmt, model))
                runners.append(ModelRunner(config, path))
        steps = [(f"decode x{b}", b, _decode_step(b, args.context, block_size, 0)) for b in batches]
        if args.prefill:
            steps.append((f"prefill {args.prefill}", args.prefill, _prefill_step(args.prefill, block_size)))
        for label, tokens, step in steps:
            rounds = _time_rounds(runners, step, args.repeats)
            for i, ((fmt, model), spent) in enumerate(zip(names, rounds)):
                dense = rounds[i - i % 4]  # the format's dense runner on the decoder plan
                seconds = statistics.median(spent)
                ratio = statistics.median(d / t for d, t in zip(dense, spent))
                print(f"| {fmt} | {model} | {label} | {seconds * 1e3:.1f} | {tokens / seconds:.0f} | {ratio:.2f}x |")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) after")


if __name__ == "__main__":
    main()
