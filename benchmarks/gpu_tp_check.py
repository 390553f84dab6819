"""The GPU check of tensor and pipeline parallelism (NCCL), prepared to run wherever a GPU is: not run on CPU-only
machines.

1. A group of one rank over NCCL (every collective of the parallel layers called: all-reduces, the logits'
   gather) against the plain runner on the same GPU: a prefill and decode steps give equal logits (an
   all-reduce of one rank is the identity), and their step times and the all-reduce time are reported.
2. With two GPUs or more: engines of ``--tp`` ranks and of ``--pp`` pipeline stages (one process and GPU each)
   against one rank, greedy tokens of a batch of prompts compared (bfloat16 sums in another order may flip a near
   tie: the agreement is reported; a pipeline's stages run the same sums as one rank), and their times.

    python benchmarks/gpu_tp_check.py                          # a random Llama of hidden 1024, 8 layers, bfloat16
    python benchmarks/gpu_tp_check.py --model path/to/hf-dir --tp 2 --pp 2
    python benchmarks/gpu_tp_check.py --device cpu             # the same check over gloo (a dry run)

Exits 1 when the one-rank group's logits differ from the plain runner's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_forward import _decode_step, _prefill_step

from engine import Engine, SamplingParams
from engine.config import EngineConfig
from engine.distributed.runner import ParallelRunner
from engine.worker.model_runner import ModelRunner


def _random_model(out: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _step_ms(runner: ModelRunner, step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        runner.execute_model(step)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def check_one_rank_group(model_dir: Path, config: EngineConfig, repeats: int) -> bool:
    plain = ModelRunner(config, model_dir)
    group = ParallelRunner(dataclasses.replace(config, tensor_parallel_size=1), model_dir)
    steps = [_prefill_step(200, config.block_size)] + [_decode_step(b, 256, config.block_size, 0) for b in (1, 16, 64)]
    equal = all(torch.equal(plain.execute_model(s), group.execute_model(s)) for s in steps)
    print(f"one-rank {'NCCL' if plain.device.type == 'cuda' else 'gloo'} group: logits "
          f"{'equal to' if equal else 'DIFFER from'} the plain runner's on a prefill and decode batches 1, 16, 64")
    print("| decode batch | plain step ms | one-rank group step ms | all-reduces of the group a step, ms |")
    print("| --- | --- | --- | --- |")
    comm = group.tp.comm
    for step in steps[1:]:
        before = comm.all_reduce_seconds
        group_ms = _step_ms(group, step, repeats)
        per_step = (comm.all_reduce_seconds - before) / repeats
        plain_ms = _step_ms(plain, step, repeats)
        print(f"| {len(step.scheduled)} | {plain_ms:.2f} | {group_ms:.2f} | {per_step * 1e3:.2f} |")
    group.workers.close()
    return equal


def compare_engines(model_dir: Path, config: EngineConfig, layouts: list[dict[str, int]]) -> None:
    prompts = [[100 + 37 * i + j for j in range(8 + 5 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = {}
    for layout in [{}, *layouts]:
        engine = Engine(str(model_dir), config=dataclasses.replace(config, **layout))
        start = time.perf_counter()
        name = ", ".join(f"{k}={v}" for k, v in layout.items()) or "one rank"
        results[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        print(f"{name}: {len(prompts)} prompts x 32 tokens in {time.perf_counter() - start:.2f} s")
        engine.close()
    for name, tokens in list(results.items())[1:]:
        same = sum(a == b for a, b in zip(results["one rank"], tokens))
        print(f"greedy tokens of {name} equal to one rank's for {same} of {len(prompts)} prompts")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model directory (default: a random-weight Llama)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the engine comparison (needs that many GPUs)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages of the engine comparison (a GPU each)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (run with --device cpu for a dry run over gloo)")
        return 0
    config = EngineConfig(device=args.device, dtype=args.dtype, block_size=16, num_blocks=1200)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else _random_model(Path(tmp))
        ok = check_one_rank_group(model_dir, config, args.repeats)
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        layouts = [layout for layout, ranks in (({"tensor_parallel_size": args.tp}, args.tp),
                                                ({"pipeline_parallel_size": args.pp}, args.pp)) if 1 < ranks <= gpus]
        if layouts:
            compare_engines(model_dir, config, layouts)
        elif args.device == "cuda":
            print(f"{gpus} GPU(s): the engine comparisons need {args.tp} (tp) or {args.pp} (pp)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
