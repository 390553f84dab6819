"""``--workload structured``: the same prompts decoded with and without a JSON-schema constraint, in one run.

The constrained run goes first: every request carries the extraction schema
(``integrations.bench.extraction``) and ends when its structure completes. Then each prompt
decodes unconstrained, EOS ignored, exactly as many tokens as its constrained twin did, so
both runs step the same batches and their throughput ratio is the constraint's cost. Both
runs time what structured output adds to a step: filling the token masks (one xgrammar
matcher per constrained row), applying them to the logits (the C kernel on CPU) and
advancing the matchers by the sampled tokens.
"""

from __future__ import annotations

from typing import Any

from integrations.bench.engine_runs import EngineSpec, Progress, greedy_params, run_batch
from integrations.bench.extraction import Extraction, is_valid
from integrations.bench.profiling import PhaseTimer
from integrations.bench.report import RunResult

CONSTRAINED = "paged engine, JSON schema"
MASK_PHASES = ("mask fill", "mask apply", "matcher advance")


def structured_compare(
    spec: EngineSpec, prompts: list[list[int]], max_tokens: int, progress: Progress
) -> tuple[list[RunResult], dict[str, Any]]:
    """Both runs, each on a fresh engine; at most ``max_tokens`` per constrained reply.

    Returns:
        The unconstrained and the constrained ``RunResult``, and the report's ``structured``
        section: ``{"schema", "num_requests", "tokens_per_s": {"constrained", "unconstrained"},
        "ratio", "num_steps", "step_ms", "mask_ms_per_step": {phase: ms}, "mask_share_of_step",
        "mask_share_from_ratio", "valid_fraction", "output_tokens": {"mean", "max"}}``.
    """
    from engine import SamplingParams
    from engine.structured_output import StructuredOutput

    constraint = StructuredOutput(json_schema=Extraction.model_json_schema())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=constraint)
    engine = spec.build()
    engine.grammars.compile(constraint)  # NOTE: compiled before the clock starts, as a served schema is cached
    constrained, timer = _timed_run(engine, prompts, [params] * len(prompts), progress)
    texts = [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in constrained.output_token_ids]
    del engine
    lengths = [len(ids) for ids in constrained.output_token_ids]
    plain, _ = _timed_run(spec.build(), prompts, [greedy_params(n) for n in lengths], progress)

    constrained.name = CONSTRAINED
    constrained.notes = "ends when the structure completes; the unconstrained run decodes as many tokens per prompt"
    # NOTE: the two runs' tokens differ by design; "same tokens" does not apply.
    constrained.output_token_ids = []
    num_steps = timer.calls.get("step", 0)
    step_s = timer.seconds.get("step", 0.0)
    mask_s = {phase: timer.seconds.get(phase, 0.0) for phase in MASK_PHASES}
    ratio = constrained.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None
    section = {
        "schema": Extraction.__name__,
        "num_requests": len(prompts),
        "tokens_per_s": {"constrained": constrained.tokens_per_s, "unconstrained": plain.tokens_per_s},
        "ratio": ratio,
        "num_steps": num_steps,
        "step_ms": 1e3 * step_s / num_steps if num_steps else None,
        "mask_ms_per_step": {p: 1e3 * s / num_steps if num_steps else None for p, s in mask_s.items()},
        "mask_share_of_step": sum(mask_s.values()) / step_s if step_s else None,
        "mask_share_from_ratio": None if ratio is None else 1.0 - ratio,
        "valid_fraction": sum(map(is_valid, texts)) / len(texts) if texts else None,
        "output_tokens": {"mean": sum(lengths) / len(lengths) if lengths else None, "max": max(lengths, default=None)},
    }
    return [plain, constrained], section


def _timed_run(
    engine: Any, prompts: list[list[int]], params: list[Any], progress: Progress
) -> tuple[RunResult, PhaseTimer]:
    import engine.layers.sampler as sampler_module

    timer = PhaseTimer()
    targets = [
        (engine.structured_output, "token_mask", "mask fill"),
        (sampler_module, "apply_token_mask", "mask apply"),
        (engine.structured_output, "accept", "matcher advance"),
        (engine, "step", "step"),
    ]
    with timer.timing(targets):
        return run_batch(engine, prompts, params, progress), timer
