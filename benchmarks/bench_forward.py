"""Forward time of one engine step on the model runner: decode batches and a prefill, per weight format.

Each format is a dtype, optionally with a quantization (``float32:gguf``, ``float32:int8``); on a GGUF model
(the default, the bundled one) the formats without ``:gguf`` run on the file's float32 dequantization. All
formats' runners are loaded first, and each step is timed on them in turn, round after round,
so that the ratios to the first format (the ``vs first`` column) compare them under the same load.

Decode steps run at a fixed context length over a KV cache whose content is irrelevant to
the timing (contexts are addressed, not prefilled), so large batches are cheap to set up.
With ``--shared N`` every decode sequence's table starts with the same N // block_size
blocks, as a common system prompt cached once gives; ``--compare`` (with
``--attention-backend torch``) then also times the PyTorch backend without cascade
attention, interleaved with it, and prints the ratio.

    python benchmarks/bench_forward.py                       # bundled SmolLM2, float32 and bfloat16
    python benchmarks/bench_forward.py --formats float32,float32:int8,float32:gguf --batches 1,4,16,64
    python benchmarks/bench_forward.py --batches 64 --context 1024 --formats float32
    python benchmarks/bench_forward.py --batches 64 --context 354 --shared 288 --prefill 0 --formats float32 \
        --attention-backend torch --compare
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.layers.linear import Linear
from engine.loader import gguf_source, resolve_model
from engine.model_files.dequantized import dequantized_hf_directory
from engine.worker.input_batch import prepare_inputs
from engine.worker.model_runner import ModelRunner


def _save_random(config, out: Path) -> Path:
    """A random-weight float32 model of ``config`` saved to ``out`` (seed 0)."""
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _decode_step(batch: int, context: int, block_size: int, shared: int) -> SchedulerOutput:
    num_shared = shared // block_size
    own = -(-context // block_size) - num_shared
    scheduled = [
        ScheduledRequest(
            req_id=str(i),
            token_ids=[100 + i],
            num_computed_tokens=context - 1,
            block_ids=(list(range(num_shared)) + list(range(num_shared + i * own, num_shared + (i + 1) * own)),),
            needs_logits=True,
        )
        for i in range(batch)
    ]
    return SchedulerOutput(scheduled=scheduled)


def _prefill_step(num_tokens: int, block_size: int) -> SchedulerOutput:
    blocks = list(range(-(-num_tokens // block_size)))
    tokens = [(7 * i) % 20000 + 100 for i in range(num_tokens)]
    return SchedulerOutput(scheduled=[ScheduledRequest("p", tokens, 0, (blocks,), True)])


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``call()`` over ``repeats`` runs, after one warm-up run."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time(runner: ModelRunner, step: SchedulerOutput, repeats: int) -> float:
    return median_seconds(lambda: runner.execute_model(step), repeats)


def _time_rounds(runners: list[ModelRunner], step: SchedulerOutput, repeats: int) -> list[list[float]]:
    """Each runner's step time in each round, the runners taking turns each round (the first round warms up)."""
    times: list[list[float]] = [[] for _ in runners]
    for repeat in range(repeats + 1):
        for runner, spent in zip(runners, times):
            start = time.perf_counter()
            runner.execute_model(step)
            if repeat:
                spent.append(time.perf_counter() - start)
    return times


def _time_formats(runners: list[ModelRunner], step: SchedulerOutput, repeats: int) -> list[float]:
    """Median step time of each runner over ``_time_rounds``."""
    return [statistics.median(spent) for spent in _time_rounds(runners, step, repeats)]


def _time_pair(runner: ModelRunner, step: SchedulerOutput, repeats: int) -> tuple[float, float]:
    """Median step time with and without cascade attention, the two interleaved under the same load."""
    backend = runner.attn_backend
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for repeat in range(repeats + 1):  # the first round warms up
            for cascade in (True, False):
                backend.cascade = cascade
                start = time.perf_counter()
                runner.execute_model(step)
                if repeat:
                    times[cascade].append(time.perf_counter() - start)
    finally:
        backend.cascade = True
    return statistics.median(times[True]), statistics.median(times[False])


def _shares(runner: ModelRunner, step: SchedulerOutput) -> tuple[float, float]:
    """Fractions of one step spent in attention and outside the model's forward (input prep, logits rows)."""
    spent = {"attention": 0.0, "forward": 0.0}

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            spent[key] += time.perf_counter() - start
            return out

        setattr(obj, name, wrapper)

    timed(runner.attn_backend, "forward", "attention")
    timed(runner.model, "forward", "forward")
    timed(runner.model, "compute_logits", "forward")
    try:
        start = time.perf_counter()
        runner.execute_model(step)
        total = time.perf_counter() - start
    finally:
        del runner.attn_backend.forward, runner.model.forward, runner.model.compute_logits
    return spent["attention"] / total, 1 - spent["forward"] / total


def _matmul_floor(runner: ModelRunner, batch: int, repeats: int) -> float:
    """Seconds of a decode step's weight matmuls alone: every projection and the LM head at ``batch`` rows,
    through the engine's ``Linear`` (on CPU its packed C kernel), the tied LM head included."""
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=runner.dtype, device=runner.device) for m in linears}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for m in linears:
                Linear.forward(m, inputs[m.in_features])  # the matmul, also of a tied embedding
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _prep_ms(runner: ModelRunner, step: SchedulerOutput, repeats: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        prepare_inputs(step.scheduled, runner.block_size, runner.device)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf; default: the bundled SmolLM2")
    parser.add_argument(
        "--formats", default="float32,bfloat16", help="comma-separated dtype[:quantization], e.g. float32:gguf"
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=350, help="context length of every decode sequence")
    parser.add_argument("--shared", type=int, default=0, help="leading context tokens every decode sequence shares")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch or cpu (EngineConfig's field)")
    parser.add_argument(
        "--compare", action="store_true", help="also time decode steps without cascade attention (torch backend)"
    )
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the prefill step (0: skip)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.compare and args.attention_backend != "torch":
        parser.error("--compare toggles the PyTorch backend's cascade attention: add --attention-backend torch")
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"threads={torch.get_num_threads()} backend={args.attention_backend} context={args.context} "
        f"shared={args.shared} prefill={args.prefill} repeats={args.repeats}"
    )
    print(
        "| format | step | forward ms | tokens/s | vs first | matmul floor ms | of ceiling | attention share "
        "| outside forward | input prep ms | no-cascade ms |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    block_size = 16
    needed = max(batches) * -(-args.context // block_size) + -(-args.prefill // block_size)
    formats = args.formats.split(",")
    runners = []
    for name in formats:
        dtype, _, quantization = name.partition(":")
        config = EngineConfig(
            dtype=dtype, device=args.device, block_size=block_size, num_blocks=needed,
            attention_backend=args.attention_backend, quantization=quantization or None,
        )
        # A GGUF's float formats run on its float32 dequantization; ``:gguf`` on the file's own blocks.
        gguf = gguf_source(model_dir)
        float_twin = gguf is not None and quantization != "gguf"
        runners.append(ModelRunner(config, dequantized_hf_directory(gguf) if float_twin else model_dir))
    for batch in batches:
        step = _decode_step(batch, args.context, block_size, args.shared)
        times = _time_formats(runners, step, args.repeats)
        for name, runner, seconds in zip(formats, runners, times):
            versus = ""
            if args.compare:
                seconds, plain = _time_pair(runner, step, args.repeats)
                versus = f"{plain * 1e3:.1f} ({plain / seconds:.2f}x)"
            floor = _matmul_floor(runner, batch, args.repeats)
            attention, outside = _shares(runner, step)
            print(
                f"| {name} | decode x{batch} | {seconds * 1e3:.1f} | {batch / seconds:.0f} | {times[0] / seconds:.2f}x "
                f"| {floor * 1e3:.1f} | {floor / seconds:.0%} | {attention:.0%} | {outside:.1%} "
                f"| {_prep_ms(runner, step):.2f} | {versus} |"
            )
    if args.prefill:
        step = _prefill_step(args.prefill, block_size)
        times = _time_formats(runners, step, max(1, args.repeats // 2))
        for name, seconds in zip(formats, times):
            print(
                f"| {name} | prefill {args.prefill} | {seconds * 1e3:.1f} | {args.prefill / seconds:.0f} "
                f"| {times[0] / seconds:.2f}x | |"
            )


if __name__ == "__main__":
    main()
