"""Results of one benchmark run: per-contender figures, the printed table and the JSON document.

JSON layout (``paged bench --json PATH``), stable so that later runs can be compared::

    {"schema": 1, "workload": {...}, "machine": {...}, "protocol": {...},
     "model": {"name", "shape", "model_type", "hidden_size", ..., "file_type"} | null,
     "results": [{"name", "tokens_per_s", "ratio_to_engine", "wall_s", "num_requests",
                  "num_new_tokens", "num_prompt_tokens", "prompt_tokens_computed",
                  "prefix_cache_hit_rate", "num_preemptions", "ttft_s": {"p50", "p99", "mean"},
                  "itl_s": {...}, "matches_engine", "mean_common_prefix", "startup_s", "notes",
                  "weights": the engine's {"quantization", "modules", "bytes", "products", "batched"} | null}, ...],
     "ceiling": {...} | null, "poisson": {...} | null, "sweep": {"levels": [...], "saturation_concurrency"} | null,
     "structured": {"schema", "num_requests", "tokens_per_s": {"constrained", "unconstrained"}, "ratio",
                    "num_steps", "step_ms", "mask_ms_per_step": {"mask fill", "mask apply", "matcher advance"},
                    "mask_share_of_step", "mask_share_from_ratio", "valid_fraction",
                    "output_tokens": {"mean", "max"}} | null,
     "profile": {...} | null,
     "rounds": [{"name", "tokens_per_s": [...], "ratio_to_engine": [...]}, ...] | null,
     "batch1": {"prompt_tokens", "gen_tokens", "depth", "threads", "repetitions",
                "results": [{"name", "decode_tok_s", "prefill_tok_s", "decode_samples", "prefill_samples",
                             "decode_ratio_to_engine", "prefill_ratio_to_engine"}, ...]} | null,
     "skipped": {contender: reason, ...},
     "http": {"base_url", "model", "slo": {"ttft_s", "itl_s", "e2e_s"}, "in_process_ratio",
              "runs": [{"load", "rate", "concurrency", "num_requests", "num_failed", "wall_s", "tokens_per_s",
                        "requests_per_s", "ttft_s", "itl_s", "e2e_s", "slo_fraction", "goodput_rps"}, ...]} | null}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

ENGINE = "paged engine"
SCHEMA_VERSION = 1


@dataclass
class RunResult:
    """What one contender did on one workload.

    ``ttft_s`` is measured from the moment the request was submitted (for one-by-one
    generation: from its own start, i.e. without queueing behind earlier requests).
    ``startup_s`` is a contender's own start-up where it is a process of its own (vLLM); no
    contender's start-up is in ``wall_s``.
    """

    name: str
    num_requests: int
    num_new_tokens: int
    wall_s: float
    num_prompt_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens_computed: int | None = None
    prefix_cache_hit_rate: float | None = None
    num_preemptions: int | None = None
    startup_s: float | None = None
    notes: str = ""
    weights: dict[str, Any] | None = None  # the engine's: what its linear weights ran as (``stats()["weights"]``)
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    prompt_indices: list[int] = field(default_factory=list, repr=False)  # which workload prompts ran

    @classmethod
    def of_outputs(
        cls, name: str, prompts: list[list[int]], outputs: list[list[int]], wall_s: float,
        indices: list[int] | None = None, **fields: Any,
    ) -> RunResult:  # fmt: skip
        """The run of ``prompts[i] for i in indices`` (default: all of them) whose new tokens are ``outputs``, in
        that order; ``fields`` are the rest (``ttft_s``, ``notes``, ...)."""
        indices = list(range(len(prompts))) if indices is None else list(indices)
        return cls(
            name=name,
            num_requests=len(indices),
            num_new_tokens=sum(len(o) for o in outputs),
            wall_s=wall_s,
            num_prompt_tokens=sum(len(prompts[i]) for i in indices),
            output_token_ids=outputs,
            prompt_indices=indices,
            **fields,
        )

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    """p50 / p99 / mean of a latency sample (None when empty)."""
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
        "count": len(values),
    }


class Agreement(NamedTuple):
    """A contender's greedy tokens against the engine's, over the requests both ran."""

    num_same: int  # requests whose token ids are identical
    num_compared: int
    mean_common_prefix: float  # tokens equal from the first, per request

    @property
    def fraction_same(self) -> float:
        return self.num_same / self.num_compared


def agreement(result: RunResult, engine: RunResult | None) -> Agreement | None:
    """How ``result``'s tokens agree with ``engine``'s; None for the engine itself or nothing to compare."""
    if engine is None or result is engine or not result.output_token_ids or not engine.output_token_ids:
        return None
    by_prompt = dict(zip(engine.prompt_indices, engine.output_token_ids))
    pairs = [(ids, by_prompt.get(i)) for i, ids in zip(result.prompt_indices, result.output_token_ids)]
    pairs = [(a, b) for a, b in pairs if b is not None]
    if not pairs:
        return None
    prefixes = [_common_prefix(a, b) for a, b in pairs]
    return Agreement(sum(a == b for a, b in pairs), len(pairs), sum(prefixes) / len(pairs))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def result_to_dict(result: RunResult, engine: RunResult | None) -> dict[str, Any]:
    ratio = result.tokens_per_s / engine.tokens_per_s if engine and engine.tokens_per_s > 0 else None
    same = agreement(result, engine)
    return {
        "name": result.name,
        "tokens_per_s": result.tokens_per_s,
        "ratio_to_engine": ratio,
        "wall_s": result.wall_s,
        "num_requests": result.num_requests,
        "num_new_tokens": result.num_new_tokens,
        "num_prompt_tokens": result.num_prompt_tokens,
        "prompt_tokens_computed": result.prompt_tokens_computed,
        "prefix_cache_hit_rate": result.prefix_cache_hit_rate,
        "num_preemptions": result.num_preemptions,
        "ttft_s": summarize(result.ttft_s),
        "itl_s": summarize(result.itl_s),
        "matches_engine": None if same is None else same.fraction_same,
        "mean_common_prefix": None if same is None else same.mean_common_prefix,
        "startup_s": result.startup_s,
        "notes": result.notes,
        "weights": result.weights,
    }


def median_round(runs: list[RunResult]) -> RunResult:
    """One contender's round of median rate (of an even number, the lower middle one)."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]


def round_rates(rounds: list[list[RunResult]]) -> list[dict[str, Any]]:
    """Each contender's rate in every round (``rounds[i]``: round i's results, the engine's first), and its ratio
    to the engine's rate of the same round."""
    engine_rates = [one[0].tokens_per_s for one in rounds]
    return [
        {
            "name": rounds[0][i].name,
            "tokens_per_s": [one[i].tokens_per_s for one in rounds],
            "ratio_to_engine": [one[i].tokens_per_s / e if e > 0 else None for one, e in zip(rounds, engine_rates)],
        }
        for i in range(len(rounds[0]))
    ]


def find_engine(results: list[RunResult]) -> RunResult | None:
    return next((r for r in results if r.name == ENGINE), None)


def build_report(
    results: list[RunResult],
    *,
    workload: dict[str, Any],
    machine: dict[str, Any],
    protocol: dict[str, Any],
    model: dict[str, Any] | None = None,
    ceiling: dict[str, Any] | None = None,
    poisson: dict[str, Any] | None = None,
    sweep: dict[str, Any] | None = None,
    structured: dict[str, Any] | None = None,
    profile: dict[str, Any] | None = None,
    http: dict[str, Any] | None = None,
    rounds: list[dict[str, Any]] | None = None,
    batch1: dict[str, Any] | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The JSON document of one run (see the module docstring for its layout)."""
    engine = find_engine(results)
    if ceiling is not None and engine is not None and ceiling.get("tokens_per_s"):
        ceiling = {**ceiling, "engine_fraction": engine.tokens_per_s / ceiling["tokens_per_s"]}
    return {
        "schema": SCHEMA_VERSION,
        "workload": workload,
        "machine": machine,
        "protocol": protocol,
        "model": model,
        "results": [result_to_dict(r, engine) for r in results],
        "ceiling": ceiling,
        "poisson": poisson,
        "sweep": sweep,
        "structured": structured,
        "profile": profile,
        "http": http,
        "rounds": rounds,
        "batch1": batch1,
        "skipped": skipped or {},
    }


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_table(report: dict[str, Any]) -> str:
    """The results table as GitHub-flavoured Markdown (printed by the command, pasted in docs); without
    contender results (a Poisson search) only the ceiling's line."""
    header = (
        "| contender | tok/s | x engine | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
        "| prefix hit | prompt tok computed / total | same tokens | common prefix (tok) |"
    )
    lines = [header, "|" + " --- |" * 9] if report["results"] else []
    for r in report["results"]:
        computed = r["prompt_tokens_computed"]
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.1f} | {_fmt(r['ratio_to_engine'], '.2f')} "
            f"| {_fmt(r['ttft_s']['p50'], '.2f')} / {_fmt(r['ttft_s']['p99'], '.2f')} "
            f"| {_fmt(r['itl_s']['p50'], '.0f', 1e3)} / {_fmt(r['itl_s']['p99'], '.0f', 1e3)} "
            f"| {_fmt(r['prefix_cache_hit_rate'], '.0%')} "
            f"| {'-' if computed is None else computed} / {r['num_prompt_tokens']} "
            f"| {_fmt(r['matches_engine'], '.0%')} | {_fmt(r['mean_common_prefix'], '.1f')} |"
        )
    notes = [f"- {r['name']}: {r['notes']}" for r in report["results"] if r["notes"]]
    for r in report.get("rounds") or []:
        rates = " / ".join(f"{v:.1f}" for v in r["tokens_per_s"])
        ratios = "" if r["name"] == ENGINE else "; x engine " + " / ".join(_fmt(v, ".2f") for v in r["ratio_to_engine"])
        notes.append(f"- {r['name']}, each round (the row: its median): {rates} tok/s{ratios}")
    ceiling = report.get("ceiling")
    if ceiling:
        frac = ceiling.get("engine_fraction")
        weights = ceiling.get("weight_dtype", ceiling["dtype"])
        dtype = ceiling["dtype"] if weights == ceiling["dtype"] else f"{weights} weights computed in {ceiling['dtype']}"
        notes.append(
            f"- machine ceiling ({dtype}, matmuls at batch {ceiling['batch']}): "
            f"{ceiling['gflops']:.0f} GFLOP/s = {ceiling['tokens_per_s']:.0f} tok/s"
            + ("" if frac is None else f"; the engine reaches {frac:.0%} of it")
        )
    return "\n".join(lines + ([""] + notes if notes and lines else notes))


def format_poisson(poisson: dict[str, Any]) -> str:
    lines = [
        "| rate (req/s) | tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | within bound |",
        "|" + " --- |" * 5,
    ]
    for p in poisson["runs"]:
        lines.append(
            f"| {p['rate']:.2f} | {p['tokens_per_s']:.1f} "
            f"| {_fmt(p['ttft_s']['p50'], '.2f')} / {_fmt(p['ttft_s']['p99'], '.2f')} "
            f"| {_fmt(p['itl_s']['p50'], '.0f', 1e3)} / {_fmt(p['itl_s']['p99'], '.0f', 1e3)} "
            f"| {'yes' if p['within_bound'] else 'no'} |"
        )
    best = poisson.get("max_rate_within_bound")
    bound_ms = poisson["itl_bound_s"] * 1e3
    lines.append("")
    lines.append(
        f"- highest rate with p99 ITL <= {bound_ms:.0f} ms: "
        + ("none of the rates tried" if best is None else f"{best:.2f} req/s")
    )
    return "\n".join(lines)


def format_sweep(sweep: dict[str, Any]) -> str:
    levels = sweep["levels"]
    names = list(levels[0]["tokens_per_s"])
    lines = ["| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " |", "|" + " --- |" * (len(names) + 1)]
    for row in levels:
        cells = " | ".join(_fmt(row["tokens_per_s"].get(n), ".1f") for n in names)
        lines.append(f"| {row['concurrency']} | {cells} |")
    knee = sweep.get("saturation_concurrency")
    lines.append("")
    lines.append(
        f"- {ENGINE} throughput stops growing (< 10% per doubling) after {knee} concurrent requests"
        if knee is not None
        else f"- {ENGINE} throughput still grows at the highest concurrency tried"
    )
    return "\n".join(lines)


def format_structured(structured: dict[str, Any]) -> str:
    """Where the constraint's cost goes: the mask phases per step, their share, and the replies' validity."""
    lines = ["| per step (constrained run) | ms | share of step |", "| --- | --- | --- |"]
    step_ms = structured["step_ms"]
    for phase, ms in structured["mask_ms_per_step"].items():
        share = None if ms is None or not step_ms else ms / step_ms
        lines.append(f"| {phase} | {_fmt(ms, '.2f')} | {_fmt(share, '.1%')} |")
    lines.append(f"| whole step | {_fmt(step_ms, '.1f')} | 100% |")
    tps = structured["tokens_per_s"]
    lines += [
        "",
        f"- {structured['num_requests']} requests, all constrained by {structured['schema']}: "
        f"{tps['constrained']:.1f} tok/s against {tps['unconstrained']:.1f} unconstrained "
        f"(ratio {_fmt(structured['ratio'], '.3f')}) over {structured['num_steps']} steps",
        f"- the masks take {_fmt(structured['mask_share_of_step'], '.1%')} of step time measured, "
        f"{_fmt(structured['mask_share_from_ratio'], '.1%')} from the ratio",
        f"- replies valid against the schema: {_fmt(structured['valid_fraction'], '.0%')}; "
        f"reply tokens mean {_fmt(structured['output_tokens']['mean'], '.1f')}, "
        f"max {structured['output_tokens']['max']}",
    ]
    return "\n".join(lines)


def format_profile(profile: dict[str, Any]) -> str:
    lines = ["| phase | total (s) | share |", "| --- | --- | --- |"]
    total = sum(profile["phases_s"].values()) or 1.0
    for phase, seconds in profile["phases_s"].items():
        lines.append(f"| {phase} | {seconds:.2f} | {seconds / total:.0%} |")
    if profile.get("trace"):
        lines.append("")
        lines.append(f"- torch profiler trace: {profile['trace']}")
    if profile.get("note"):
        lines.append(f"- {profile['note']}")
    return "\n".join(lines)


def format_http(http: dict[str, Any]) -> str:
    """The HTTP runs with what only a client sees: end-to-end latency, failures, the SLO and the in-process ratio."""
    lines = [
        "| load | requests (failed) | tok/s | req/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | e2e p50 / p99 (s) "
        "| within SLO | goodput (req/s) |",
        "|" + " --- |" * 9,
    ]
    for r in http["runs"]:
        lines.append(
            f"| {r['load']} | {r['num_requests']} ({r['num_failed']}) | {r['tokens_per_s']:.1f} "
            f"| {r['requests_per_s']:.2f} "
            f"| {_fmt(r['ttft_s']['p50'], '.2f')} / {_fmt(r['ttft_s']['p99'], '.2f')} "
            f"| {_fmt(r['itl_s']['p50'], '.0f', 1e3)} / {_fmt(r['itl_s']['p99'], '.0f', 1e3)} "
            f"| {_fmt(r['e2e_s']['p50'], '.2f')} / {_fmt(r['e2e_s']['p99'], '.2f')} "
            f"| {_fmt(r['slo_fraction'], '.0%')} | {_fmt(r['goodput_rps'], '.2f')} |"
        )
    names = ("TTFT", "mean ITL", "e2e")
    bounds = [f"{name} <= {value:g} s" for name, value in zip(names, http["slo"].values()) if value]
    lines.append("")
    lines.append(f"- SLO: {', '.join(bounds)}, all per request" if bounds else "- no SLO given (--slo-ttft ...)")
    ratio = http.get("in_process_ratio")
    if ratio is not None:
        overhead = f"HTTP overhead {1 - ratio:.0%}" if ratio <= 1 else "the HTTP run was the faster: no overhead shown"
        lines.append(f"- the all-at-once run over HTTP reaches {ratio:.2f}x the in-process throughput ({overhead})")
    return "\n".join(lines)
