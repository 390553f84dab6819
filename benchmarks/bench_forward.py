"""Forward time of one engine step on the model runner: decode batches and a prefill, per dtype.

Decode steps run at a fixed context length over a KV cache whose content is irrelevant to
the timing (contexts are addressed, not prefilled), so large batches are cheap to set up.

    python benchmarks/bench_forward.py                       # bundled SmolLM2, float32 and bfloat16
    python benchmarks/bench_forward.py --batches 64 --context 1024 --dtypes float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.loader import resolve_model
from engine.worker.model_runner import ModelRunner


def _decode_step(batch: int, context: int, block_size: int) -> SchedulerOutput:
    blocks_per_seq = -(-context // block_size)
    scheduled = [
        ScheduledRequest(
            req_id=str(i),
            token_ids=[100 + i],
            num_computed_tokens=context - 1,
            block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            needs_logits=True,
        )
        for i in range(batch)
    ]
    return SchedulerOutput(scheduled=scheduled)


def _prefill_step(num_tokens: int, block_size: int) -> SchedulerOutput:
    blocks = list(range(-(-num_tokens // block_size)))
    tokens = [(7 * i) % 20000 + 100 for i in range(num_tokens)]
    return SchedulerOutput(scheduled=[ScheduledRequest("p", tokens, 0, blocks, True)])


def _time(runner: ModelRunner, step: SchedulerOutput, repeats: int) -> float:
    runner.execute_model(step)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute_model(step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _attention_share(runner: ModelRunner, step: SchedulerOutput, repeats: int) -> float:
    backend = runner.attn_backend
    spent = [0.0]
    forward = backend.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    backend.forward = timed
    try:
        total = _time(runner, step, repeats)
        spent[0] = 0.0
        runner.execute_model(step)
    finally:
        del backend.forward
    return spent[0] / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf; default: the bundled SmolLM2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=350, help="context length of every decode sequence")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the prefill step (0: skip)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"threads={torch.get_num_threads()} context={args.context} prefill={args.prefill} repeats={args.repeats}")
    print("| dtype | step | forward ms | tokens/s | attention share |")
    print("| --- | --- | ---: | ---: | ---: |")
    for dtype in args.dtypes.split(","):
        block_size = 16
        needed = max(batches) * -(-args.context // block_size) + -(-args.prefill // block_size)
        config = EngineConfig(dtype=dtype, device=args.device, block_size=block_size, num_blocks=needed)
        runner = ModelRunner(config, model_dir)
        for batch in batches:
            step = _decode_step(batch, args.context, block_size)
            seconds = _time(runner, step, args.repeats)
            share = _attention_share(runner, step, max(1, args.repeats // 2))
            print(f"| {dtype} | decode x{batch} | {seconds * 1e3:.1f} | {batch / seconds:.0f} | {share:.0%} |")
        if args.prefill:
            seconds = _time(runner, _prefill_step(args.prefill, block_size), max(1, args.repeats // 2))
            print(f"| {dtype} | prefill {args.prefill} | {seconds * 1e3:.1f} | {args.prefill / seconds:.0f} | |")
        del runner


if __name__ == "__main__":
    main()
