"""What pipeline and tensor parallelism give an engine on CPU: one process against two pipeline stages (with a
step per stage in flight, as the engine runs them, and with one step in flight) and two tensor-parallel ranks
(gloo, each process a half of the cores), and each pipeline stage's idle time.

Each layout's engine generates the same greedy batch, round after round (layouts alternating within a round, so
that a loaded machine weighs on all alike); the table gives the median tokens per second and, for the pipeline,
the most steps in the pipe at once and the share of the wall time each stage was idle
(``runner.stage_wait_seconds_per_stage()``): the first stage (the driver) waiting for logits or for the next stage
to take its hidden states, the last waiting for the first's hidden states.

    python benchmarks/bench_pipeline_parallel.py      # a random Llama: hidden 1024, 16 layers, 16 heads, 8 KV heads
    python benchmarks/bench_pipeline_parallel.py --model path/to/hf-dir --prompts 16 --tokens 64 --rounds 3
    python benchmarks/bench_pipeline_parallel.py --model path/to/smollm2-1.7b --dtype bfloat16 --prompts 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_forward import _save_random

from engine import Engine, SamplingParams
from engine.loader import resolve_model

LAYOUTS = {
    "one process": {}, "pp=2": {"pipeline_parallel_size": 2}, "pp=2, one step in flight": {"pipeline_parallel_size": 2},
    "tp=2": {"tensor_parallel_size": 2},
}  # fmt: skip
PIPELINES = ("pp=2", "pp=2, one step in flight")


def _random_llama(out: Path) -> Path:
    """A random-weight Llama with the bundled model's tokenizer (and its vocabulary's size)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(None))
    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    tokenizer.save_pretrained(out)
    return _save_random(config, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model directory (default: a random-weight Llama)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (bfloat16 for a model of a real size)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(args, args.model or str(_random_llama(Path(tmp))))


def run(args: argparse.Namespace, model: str) -> None:
    prompts = [[100 + 37 * i + j for j in range(16 + 3 * i)] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    # NOTE: the blocks the prompts and their tokens fill (16 tokens a block), and as many again: four engines' caches
    # of a real-size model fit the machine
    num_blocks = 2 * sum(-(-(len(prompt) + args.tokens) // 16) for prompt in prompts)
    options = dict(dtype=args.dtype, device="cpu", enable_prefix_caching=False, num_blocks=num_blocks)
    engines = {name: Engine(model, **options, **layout) for name, layout in LAYOUTS.items()}
    engines["pp=2, one step in flight"].steps_in_flight = None  # each step through the whole pipe, then sampled
    rates: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    waits: dict[str, list[list[float]]] = {name: [] for name in PIPELINES}  # each round's idle share per stage
    outputs = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            before = engine.runner.stage_wait_seconds_per_stage() if name in PIPELINES else []
            start = time.perf_counter()
            outputs[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
            wall = time.perf_counter() - start
            rates[name].append(args.prompts * args.tokens / wall)
            if name in PIPELINES:
                after = engine.runner.stage_wait_seconds_per_stage()
                waits[name].append([(a - b) / wall for a, b in zip(after, before, strict=True)])
    in_flight = {name: max(1, getattr(engines[name].runner, "max_steps_in_flight", 0)) for name in PIPELINES}
    for engine in engines.values():
        engine.close()
    same = all(out == outputs["one process"] for out in outputs.values())
    print(f"{args.prompts} prompts x {args.tokens} tokens, {args.rounds} rounds; greedy tokens equal across "
          f"layouts: {same}")
    print("| layout | tokens/s (median) | steps in flight | idle: stage 0 / stage 1 |")
    print("| --- | --- | --- | --- |")
    for name in LAYOUTS:
        if name in PIPELINES:
            idle = " / ".join(f"{statistics.median(stage):.0%}" for stage in zip(*waits[name], strict=True))
            pipe = f" {in_flight[name]} | {idle} |"
        else:
            pipe = " | |"
        print(f"| {name} | {statistics.median(rates[name]):.1f} |" + pipe)


if __name__ == "__main__":
    main()
