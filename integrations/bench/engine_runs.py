"""The engine's side of the benchmark: offline batch, Poisson arrivals, concurrency sweep.

The offline run submits every request with ``Engine.add_request`` and steps the engine
until all finish, as ``Engine.generate`` does, recording when each request's tokens
appear (TTFT and inter-token latency per token, not histogram buckets).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from integrations.bench.report import ENGINE, RunResult, summarize

Progress = Callable[[int], None]


def greedy_params(max_tokens: int) -> Any:
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class EngineSpec:
    """The engine a bench's runs build, each a fresh one: ``Engine(model, **settings)`` (``None``: the bundled
    model; ``settings``: every engine flag but ``--model``)."""

    model: str | None
    settings: dict[str, Any]

    def build(self, **overrides: Any) -> Any:
        """A fresh engine (``overrides`` replacing settings), warmed up on a prompt unrelated to the workloads, so
        that first-call costs are not measured."""
        from engine import Engine

        engine = Engine(self.model, **{**self.settings, **overrides})
        engine.generate([[1, 2, 3, 4]], greedy_params(2), use_tqdm=False)
        return engine


def _stat_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def run_batch(engine: Any, prompts: list[list[int]], params: Sequence[Any], progress: Progress) -> RunResult:
    """All ``prompts`` submitted at once to a ready engine, each with its ``SamplingParams``; stepped
    until the last token."""
    before = engine.stats()
    start = time.perf_counter()
    ids = [engine.add_request(f"bench-{i}", p, ps) for i, (p, ps) in enumerate(zip(prompts, params, strict=True))]
    index = {req_id: i for i, req_id in enumerate(ids)}
    num_seen = [0] * len(prompts)
    last_stamp: list[float | None] = [None] * len(prompts)
    ttft: list[float] = []
    itl: list[float] = []
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            i = index.get(out.request_id)
            if i is None:
                continue
            tokens = out.outputs[0].token_ids
            new = len(tokens) - num_seen[i]
            if new <= 0:
                continue
            if last_stamp[i] is None:
                ttft.append(now - start)
            else:
                itl.append(now - last_stamp[i])
            last_stamp[i], num_seen[i] = now, len(tokens)
            if out.finished:
                outputs[i] = list(tokens)
            progress(new)
    wall = time.perf_counter() - start
    failures = engine.pop_failures()
    if failures:
        raise RuntimeError(f"the engine failed {len(failures)} requests: {next(iter(failures.values()))}")
    after = engine.stats()
    queries = _stat_delta(before, after, "prefix_cache_queries")
    hits = _stat_delta(before, after, "prefix_cache_hits")
    return RunResult.of_outputs(
        ENGINE, prompts, outputs, wall,
        ttft_s=ttft,
        itl_s=itl,
        prompt_tokens_computed=_stat_delta(before, after, "prompt_tokens_computed"),
        prefix_cache_hit_rate=hits / queries if queries else None,
        num_preemptions=_stat_delta(before, after, "num_preemptions"),
        weights=after.get("weights"),
    )  # fmt: skip


def run_offline(spec: EngineSpec, prompts: list[list[int]], max_tokens: int, progress: Progress) -> RunResult:
    """The protocol run: a fresh engine, every request submitted at once."""
    return run_batch(spec.build(), prompts, [greedy_params(max_tokens)] * len(prompts), progress)


# ------------------------------------------------------------------------------------ concurrency sweep


def concurrency_sweep(
    spec: EngineSpec,
    prompts: list[list[int]],
    max_tokens: int,
    levels: list[int],
    hf_model: Any | None,
    pad_token_id: int,
    progress: Progress,
) -> dict[str, Any]:
    """Throughput with ``c`` requests in flight, for each ``c`` in ``levels``.

    Each level submits ``c`` requests at once (a fresh engine per level, so no level reuses
    another's prefix cache); with ``hf_model`` the same ``c`` requests also run as one static
    Hugging Face batch.

    Returns:
        ``{"levels": [{"concurrency", "tokens_per_s": {name: rate}, "itl_s": {name: summary}}],
        "saturation_concurrency": c}``, the latter from ``saturation_point``.
    """
    from integrations.bench.baselines import run_static_batches

    rows = []
    for c in levels:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        engine = spec.build(max_num_seqs=max(c, 1))
        result = run_batch(engine, batch, [greedy_params(max_tokens)] * c, progress)
        row: dict[str, Any] = {"concurrency": c, "tokens_per_s": {ENGINE: result.tokens_per_s}}
        row["itl_s"] = {ENGINE: summarize(result.itl_s)}
        del engine
        if hf_model is not None:
            hf = run_static_batches(hf_model, batch, c, max_tokens, pad_token_id, progress)
            row["tokens_per_s"]["HF generate, one static batch"] = hf.tokens_per_s
            row["itl_s"]["HF generate, one static batch"] = summarize(hf.itl_s)
        rows.append(row)
    return {"levels": rows, "saturation_concurrency": saturation_point(rows)}


def saturation_point(sweep: list[dict[str, Any]], name: str = ENGINE, min_gain: float = 0.1) -> int | None:
    """The first concurrency after which doubling gains less than ``min_gain`` (10%) throughput."""
    points = [(row["concurrency"], row["tokens_per_s"].get(name)) for row in sweep]
    points = [(c, t) for c, t in points if t]
    for (c, t), (_, t_next) in zip(points, points[1:]):
        if t_next < t * (1 + min_gain):
            return c
    return None


# ------------------------------------------------------------------------------------ Poisson arrivals


async def _poisson_once(
    engine: Any, prompts: list[list[int]], max_tokens: int, rate: float, seed: int, progress: Progress
) -> dict[str, Any]:
    rng = random.Random(seed)
    params = greedy_params(max_tokens)
    ttft: list[float] = []
    itl: list[float] = []
    num_tokens = 0

    async def one(i: int, prompt: list[int], delay: float) -> None:
        nonlocal num_tokens
        await asyncio.sleep(delay)
        submitted = last = time.perf_counter()
        seen = 0
        async for out in engine.generate(prompt, params, request_id=f"poisson-{seed}-{i}"):
            new = len(out.outputs[0].token_ids) - seen
            if new <= 0:
                continue
            now = time.perf_counter()
            (itl if seen else ttft).append(now - (last if seen else submitted))
            last, seen = now, seen + new
            num_tokens += new
            progress(new)

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    start = time.perf_counter()
    await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))
    wall = time.perf_counter() - start
    return {
        "rate": rate,
        "num_requests": len(prompts),
        "tokens_per_s": num_tokens / wall if wall else 0.0,
        "wall_s": wall,
        "ttft_s": summarize(ttft),
        "itl_s": summarize(itl),
    }


def poisson_search(
    spec: EngineSpec,
    prompts: list[list[int]],
    max_tokens: int,
    first_rate: float,
    itl_bound: float,
    num_trials: int,
    progress: Progress,
) -> dict[str, Any]:
    """Requests arriving as a Poisson process through ``AsyncEngine``; find the highest rate within the bound.

    The rate doubles while p99 inter-token latency stays within ``itl_bound`` and halves
    while it does not; once both sides are known, it bisects between them.
    """
    from engine import AsyncEngine

    async def search() -> dict[str, Any]:
        async with AsyncEngine(spec.model, **spec.settings) as engine:
            async for _ in engine.generate([1, 2, 3, 4], greedy_params(2)):  # warm-up
                pass
            runs: list[dict[str, Any]] = []
            good, bad, rate = None, None, first_rate
            for trial in range(num_trials):
                run = await _poisson_once(engine, prompts, max_tokens, rate, seed=trial, progress=progress)
                p99 = run["itl_s"]["p99"]
                run["within_bound"] = p99 is not None and p99 <= itl_bound
                runs.append(run)
                if run["within_bound"]:
                    good = rate if good is None else max(good, rate)
                else:
                    bad = rate if bad is None else min(bad, rate)
                rate = rate * 2 if bad is None else rate / 2 if good is None else (good + bad) / 2
        return {"itl_bound_s": itl_bound, "max_rate_within_bound": good, "runs": runs}

    return asyncio.run(search())

