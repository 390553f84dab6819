"""``paged bench --profile``: where an engine step's time goes, and a torch profiler trace."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from integrations.bench.engine_runs import EngineSpec, greedy_params, run_batch


class PhaseTimer:
    """Seconds spent in, and calls of, the functions it wraps, by phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
                self.calls[phase] = self.calls.get(phase, 0) + 1

        return timed

    @contextmanager
    def timing(self, targets: Iterable[tuple[Any, str, str]]) -> Iterator[None]:
        """Times each ``(object, attribute, phase)`` function of ``targets`` while the block runs."""
        with ExitStack() as stack:
            for target, attr, phase in targets:  # NOTE: a renamed target fails here, never reads as 0 s
                stack.enter_context(mock.patch.object(target, attr, self.wrap(phase, getattr(target, attr))))
            yield


def profile_steps(
    spec: EngineSpec,
    prompts: list[list[int]],
    max_tokens: int,
    out_dir: Any,
    trace_steps: int = 6,
) -> dict[str, Any]:
    """Where a step's time goes, and a torch profiler trace of the first steps.

    Times the phases of ``Engine.step`` by wrapping what it calls (scheduler, input
    preparation, model forward, sampler, scheduler update, detokenizer, output building)
    over one full run of ``prompts``; then traces ``trace_steps`` steps of a second run
    with ``torch.profiler`` into ``out_dir``.
    """
    import torch

    import engine.detokenizer as detokenizer_module
    import engine.worker.model_runner as runner_module

    engine = spec.build()
    timer = PhaseTimer()
    targets = [
        (engine.scheduler, "schedule", "schedule"),
        (runner_module, "prepare_inputs", "prepare inputs"),
        (engine.runner, "execute_model", "execute_model"),
        (type(engine.sampler), "__call__", "sample"),
        (engine.scheduler, "update_from_output", "update"),
        (detokenizer_module.IncrementalDetokenizer, "update", "detokenize"),
        (engine.output_processor, "make_output", "emit outputs"),
        (engine, "step", "step"),
    ]
    params = greedy_params(max_tokens)
    with timer.timing(targets):
        result = run_batch(engine, prompts, [params] * len(prompts), lambda n: None)
    seconds = timer.seconds
    step_total = seconds.pop("step", 0.0)
    prepare = seconds.get("prepare inputs", 0.0)
    phases = {
        "schedule": seconds.get("schedule", 0.0),
        "prepare inputs": prepare,
        "forward": seconds.pop("execute_model", 0.0) - prepare,
        "sample": seconds.get("sample", 0.0),
        "update": seconds.get("update", 0.0),
        "detokenize": seconds.get("detokenize", 0.0),
        "emit outputs": seconds.get("emit outputs", 0.0),
        "hooks": 0.0,
    }
    phases["other"] = max(0.0, step_total - sum(phases.values()))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"trace-{time.strftime('%Y%m%d-%H%M%S')}.json"
    ids = [engine.add_request(f"trace-{i}", p, params) for i, p in enumerate(prompts)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(trace_steps):
            if not engine.has_unfinished_requests():
                break
            with torch.profiler.record_function("Engine.step"):
                engine.step()
    engine.abort_request(ids)
    prof.export_chrome_trace(str(trace))
    return {
        "num_steps": timer.calls.get("step", 0),
        "step_s": step_total,
        "wall_s": result.wall_s,
        "tokens_per_s": result.tokens_per_s,
        "phases_s": phases,
        "trace": str(trace),
        "note": "hooks run in the SDK client, not inside Engine.step; the engine alone spends nothing on them",
    }
