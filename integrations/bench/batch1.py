"""``paged bench --workload batch1``: one request at a time, the engine beside llama.cpp's ``llama-bench``.

What llama-bench measures, measured on the engine the same way:

- decode (llama-bench's ``tg N``, with ``--depth D`` its ``-d D``): a prompt of D random token ids (one where D is
  0) and N + 1 new tokens, EOS ignored; the first comes from the prompt's prefill and is not timed, the rate is
  N / the time from the first token to the last (N decode steps with D to D + N tokens in the cache);
- prefill (``pp N``): a prompt of N random token ids and one new token; the rate is N / the time to that
  token.

Each is repeated ``--rounds`` times after an untimed warm-up of both, every prompt fresh (nothing comes
from the prefix cache); the rate is the mean of the repetitions' rates, as llama-bench reports it.

Unless ``--no-ceiling``, beside them the bound memory sets: a decode step reads every linear weight's bytes
(``stats()["weights"]["bytes"]``) and the KV cache of its tokens (``depth`` + half the new ones on average) once,
so this machine's read speed (``ceiling.read_bandwidth``) over those bytes is the most tokens a second batch 1 can
decode without reading fewer bytes.
"""

from __future__ import annotations

import random
from typing import Any

from integrations.bench.ceiling import read_bandwidth
from integrations.bench.engine_runs import EngineSpec, greedy_params, run_batch
from integrations.bench.report import ENGINE

WARM_UP_TOKENS = 8


def engine_batch1(
    spec: EngineSpec, prompt_tokens: int, gen_tokens: int, repetitions: int, depth: int = 0, ceiling: bool = True
) -> dict[str, Any]:
    """The engine's batch-1 decode (with ``depth`` tokens in the cache) and prefill rates.

    Returns:
        ``{"name", "decode_tok_s", "prefill_tok_s", "decode_samples", "prefill_samples", "weights", "ceiling"}``:
        ``weights`` what its linear weights ran as (``stats()["weights"]``), ``ceiling`` ``memory_ceiling``'s
        (None without ``ceiling``).
    """
    engine = spec.build()
    rng = random.Random(spec.settings.get("seed") or 0)

    def fresh(length: int) -> list[int]:
        return [rng.randrange(engine.vocab_size) for _ in range(length)]

    def prefill_rate() -> float:
        result = run_batch(engine, [fresh(prompt_tokens)], [greedy_params(1)], lambda n: None)
        return prompt_tokens / result.ttft_s[0]

    def decode_rate(num_tokens: int) -> float:
        result = run_batch(engine, [fresh(max(depth, 1))], [greedy_params(num_tokens + 1)], lambda n: None)
        return (result.num_new_tokens - 1) / (result.wall_s - result.ttft_s[0])

    prefill_rate()
    decode_rate(WARM_UP_TOKENS)
    prefill = [prefill_rate() for _ in range(repetitions)]
    decode = [decode_rate(gen_tokens) for _ in range(repetitions)]
    return {
        "name": ENGINE,
        "decode_tok_s": sum(decode) / len(decode),
        "prefill_tok_s": sum(prefill) / len(prefill),
        "decode_samples": decode,
        "prefill_samples": prefill,
        "weights": engine.stats().get("weights"),
        "ceiling": memory_ceiling(engine, depth, gen_tokens) if ceiling else None,
    }


def memory_ceiling(engine: Any, depth: int, gen_tokens: int) -> dict[str, Any] | None:
    """The decode rate this machine's memory allows the engine: ``{"read_gb_s", "weight_bytes", "kv_bytes_per_token",
    "bytes_per_token", "tok_s"}``; None where the weights' bytes or the KV cache are not the driver's to count (a
    GPU, ranks in other processes)."""
    weights = engine.stats().get("weights") or {}
    kv = getattr(engine.runner, "kv_cache", None)
    if not weights.get("bytes") or kv is None or kv.device.type != "cpu":
        return None
    cached = kv.shape[2] * kv.shape[3]  # blocks x block size
    scales = getattr(engine.runner, "kv_scales", None)  # an int8 cache's float32 scales
    kv_per_token = (kv.nbytes + (scales.nbytes if scales is not None else 0)) / cached
    step = weights["bytes"] + kv_per_token * (depth + gen_tokens / 2)
    bandwidth = read_bandwidth()
    return {
        "read_gb_s": bandwidth / 1e9,
        "weight_bytes": weights["bytes"],
        "kv_bytes_per_token": kv_per_token,
        "bytes_per_token": step,
        "tok_s": bandwidth / step,
    }


def batch1_report(
    results: list[dict[str, Any]], prompt_tokens: int, gen_tokens: int, threads: int, repetitions: int, depth: int = 0
) -> dict[str, Any]:
    """The report's ``batch1`` part: each contender's rates and their ratio to the engine's (the first)."""
    engine = results[0]
    rows = []
    for r in results:
        rows.append(
            {
                **r,
                "decode_ratio_to_engine": r["decode_tok_s"] / engine["decode_tok_s"],
                "prefill_ratio_to_engine": r["prefill_tok_s"] / engine["prefill_tok_s"],
            }
        )
    return {
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "depth": depth,
        "threads": threads,
        "repetitions": repetitions,
        "results": rows,
    }


def format_batch1(batch1: dict[str, Any]) -> str:
    """The batch-1 table: each contender's decode and prefill rate and its ratio to the engine's."""
    tg, pp = f"tg{batch1['gen_tokens']}", f"pp{batch1['prompt_tokens']}"
    if batch1.get("depth"):
        tg += f" @ d{batch1['depth']}"
    lines = [
        f"| contender | decode tok/s ({tg}) | x engine | prefill tok/s ({pp}) | x engine |",
        "|" + " --- |" * 5,
    ]
    for r in batch1["results"]:
        lines.append(
            f"| {r['name']} | {r['decode_tok_s']:.1f} | {r['decode_ratio_to_engine']:.2f} "
            f"| {r['prefill_tok_s']:.1f} | {r['prefill_ratio_to_engine']:.2f} |"
        )
    lines.append("")
    lines.append(
        f"- one request at a time, {batch1['threads']} threads, mean of {batch1['repetitions']} repetitions "
        f"(decode: each one's {tg}{_depth_note(batch1)}; prefill: each one's {pp} of random token ids)"
    )
    for r in batch1["results"]:
        samples = " / ".join(f"{v:.1f}" for v in r["decode_samples"])
        lines.append(f"- {r['name']}: decode each repetition {samples} tok/s")
    ceiling = batch1["results"][0].get("ceiling")
    if ceiling:
        kv = ceiling["bytes_per_token"] - ceiling["weight_bytes"]
        lines.append(
            f"- memory bound: this machine reads {ceiling['read_gb_s']:.1f} GB/s on {batch1['threads']} threads; a "
            f"decode step reads {ceiling['bytes_per_token'] / 1e6:.0f} MB (weights {ceiling['weight_bytes'] / 1e6:.0f} "
            f"MB, KV cache {kv / 1e6:.0f} MB): at most {ceiling['tok_s']:.1f} tok/s, the engine at "
            f"{batch1['results'][0]['decode_tok_s'] / ceiling['tok_s']:.0%} of it"
        )
    return "\n".join(lines)


def _depth_note(batch1: dict[str, Any]) -> str:
    depth = batch1.get("depth")
    return f", after a prompt of {depth} tokens" if depth else ""
