"""Speculative decoding (n-gram drafts) in each mode against none, in one run: a copy-heavy reply at batch 1, W1 at 64.

The modes: off (no speculative_config), always and auto (``speculative_config.mode``). Batch 1: one
chat request that asks for a passage of its prompt back, greedy; decode tokens/s is (output tokens
- 1) / (last token time - first token time), the engines taking turns for ``--rounds`` rounds (the
median of each is reported). W1: the shared-prefix workload (64 questions behind one system prompt,
128 new tokens each, greedy, EOS ignored, all submitted at once), output tokens/s over the wall
time, fresh engines taking turns for ``--w1-rounds`` rounds (medians reported). Greedy outputs with
and without drafts are compared.

    python benchmarks/bench_spec_decode.py                                  # bundled SmolLM2, k = 3
    python benchmarks/bench_spec_decode.py --spec '{"num_speculative_tokens": 5}' --skip-w1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine import Engine, SamplingParams
from integrations.bench.engine_runs import EngineSpec, greedy_params, run_batch
from integrations.bench.machine import machine_info
from integrations.bench.workloads import apply_chat_template, build_workload

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, it approved "
    "funds for the new public library on Oak Avenue, the renovation of the central park and its playground, and the "
    "repair of the old stone bridge on Mill Street, which has been closed to traffic since the spring floods. The "
    "mayor thanked the volunteers who had collected signatures, and said that work on the bridge would begin in "
    "early September and end before the first snow. Residents can follow the progress of each project on the "
    "city's website, where the minutes of every meeting are published within a week."
)
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MODES = ("always", "auto")  # speculative_config.mode, each against off


def mode_settings(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Engine settings by contender: off, then each mode of ``spec``."""
    return {"off": {}, **{mode: {"speculative_config": {**spec, "mode": mode}} for mode in MODES}}


def decode_rate(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """One request alone: decode tokens/s after its first token, and its tokens."""
    engine.add_request("copy", prompt, params)
    first = last = None
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs[0].token_ids:
                first = first or now
                last, token_ids = now, out.outputs[0].token_ids
    assert first is not None and last is not None and len(token_ids) > 1
    return (len(token_ids) - 1) / (last - first), list(token_ids)


def spec_counts(engine: Engine) -> dict[str, Any]:
    return {k: v for k, v in engine.stats().items() if k.startswith("spec_decode")}


def batch1(model: str | None, spec: dict[str, Any], max_tokens: int, rounds: int) -> dict[str, Any]:
    engines = {name: EngineSpec(model, {"max_num_seqs": 1, **extra}).build() for name, extra in mode_settings(spec).items()}
    prompt = apply_chat_template(engines["off"].tokenizer, "You are a helpful assistant.",
                                 f"Repeat the following text exactly, word for word:\n\n{PASSAGE}")  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            rate, outputs[name] = decode_rate(engine, prompt, params)
            rates[name].append(rate)
    median = {name: statistics.median(r) for name, r in rates.items()}
    return {"prompt_tokens": len(prompt), "output_tokens": len(outputs["off"]), "decode_tok_s": median,
            "ratio": {mode: median[mode] / median["off"] for mode in MODES}, "rounds": rates,
            "identical": {mode: outputs[mode] == outputs["off"] for mode in MODES},
            "spec": {mode: spec_counts(engines[mode]) for mode in MODES}}


def w1(model: str | None, spec: dict[str, Any], num_requests: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    settings = mode_settings(spec)
    rates: dict[str, list[float]] = {name: [] for name in settings}
    outputs, counts = {}, {}
    for _ in range(rounds):
        for name, extra in settings.items():
            engine = EngineSpec(model, {"max_num_seqs": num_requests, **extra}).build()  # fresh: no prefix cached
            prompts = build_workload("shared-prefix", engine.tokenizer, num_requests).prompts
            result = run_batch(engine, prompts, [greedy_params(max_tokens)] * num_requests, lambda _: None)
            rates[name].append(result.tokens_per_s)
            outputs[name], counts[name] = result.output_token_ids, spec_counts(engine)
            del engine
    median = {name: statistics.median(r) for name, r in rates.items()}
    same = {mode: sum(a == b for a, b in zip(outputs["off"], outputs[mode])) for mode in MODES}
    return {"tok_s": median, "ratio": {mode: median[mode] / median["off"] for mode in MODES}, "rounds": rates,
            "identical_requests": same, "num_requests": num_requests, "spec": {mode: counts[mode] for mode in MODES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf; default the bundled SmolLM2")
    parser.add_argument("--spec", type=json.loads, default=DEFAULT_SPEC, help="speculative_config as JSON")
    parser.add_argument("--copy-tokens", type=int, default=128, help="max_tokens of the batch-1 copy request")
    parser.add_argument("--rounds", type=int, default=3, help="batch-1 rounds, the engines taking turns")
    parser.add_argument("--w1-rounds", type=int, default=3, help="W1 rounds, the engines taking turns")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-w1", action="store_true")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine_info(), "spec": args.spec}
    one = report["batch1"] = batch1(args.model, args.spec, args.copy_tokens, args.rounds)
    print(f"machine: {report['machine']['cpu']} ({', '.join(report['machine']['cpu_flags'])}), "
          f"{report['machine']['cpu_count']} CPUs; speculative_config {json.dumps(args.spec)}")
    for mode in MODES:
        print(f"batch 1, copy, {mode}: {one['output_tokens']} tokens; decode {one['decode_tok_s']['off']:.1f} -> "
              f"{one['decode_tok_s'][mode]:.1f} tok/s = {one['ratio'][mode]:.2f}x; identical: {one['identical'][mode]}; "
              f"{one['spec'][mode]}")
    if not args.skip_w1:
        many = report["w1"] = w1(args.model, args.spec, args.num_requests, args.max_tokens, args.w1_rounds)
        for mode in MODES:
            print(f"W1, {args.num_requests} requests, {mode} (median of {args.w1_rounds}): {many['tok_s']['off']:.1f} -> "
                  f"{many['tok_s'][mode]:.1f} tok/s = {many['ratio'][mode]:.2f}x; identical requests "
                  f"{many['identical_requests'][mode]}/{many['num_requests']}; {many['spec'][mode]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
