"""The alternatives a user would pick instead of the engine, run on the same prompts, model and dtype.

- ``one-by-one``: Hugging Face ``generate`` one request at a time (optionally a subsample).
- ``static-16`` / ``static-64``: ``generate`` over left-padded batches of 16 (64) requests.
- ``continuous``: transformers' own continuous batching, ``model.generate_batch``.

Every contender decodes greedily with EOS disabled, so each request yields exactly
``max_tokens`` new tokens (the engine's ``ignore_eos=True``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from integrations.bench.report import RunResult

BASELINES = ("one-by-one", "static-16", "static-64", "continuous")

# The continuous-batching token budget per forward pass; generate_batch's CPU default (8192)
# allocates an 8192 x (cache + 8192) attention mask and spends most of its time clearing it.
CB_MAX_BATCH_TOKENS = 512

Progress = Callable[[int], None]  # called with the number of new tokens just finished


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The Hugging Face model on ``device`` in eval mode, with EOS switched off in its generation config."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # NOTE: a GenerationConfig passed to generate() falls back to the model's eos_token_id when its
    # own is None, so EOS must be cleared on the model to decode past it.
    model.generation_config.eos_token_id = None
    return model


class _StepClock:
    """A logits processor that records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def _greedy_config(max_tokens: int, pad_token_id: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id
    )


@torch.inference_mode()
def _generate_padded(
    model: Any, prompts: list[list[int]], max_tokens: int, pad_token_id: int
) -> tuple[list[list[int]], list[float]]:
    """Greedy-decode one left-padded batch; returns the new tokens and the per-step timestamps."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    clock = _StepClock()
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        generation_config=_greedy_config(max_tokens, pad_token_id),
        logits_processor=[clock],
    )
    return out[:, width:].tolist(), clock.stamps


def warm_up(model: Any, pad_token_id: int) -> None:
    """One tiny generation, so first-call costs are not charged to the first baseline."""
    _generate_padded(model, [[1, 2, 3, 4]], 2, pad_token_id)


def run_one_by_one(
    model: Any, prompts: list[list[int]], indices: list[int], max_tokens: int, pad_token_id: int, progress: Progress
) -> RunResult:
    """``generate`` one request at a time on ``prompts[i] for i in indices``; the rate is per token served."""
    outputs, ttft, itl, wall = [], [], [], 0.0
    for i in indices:
        start = time.perf_counter()
        tokens, stamps = _generate_padded(model, [prompts[i]], max_tokens, pad_token_id)
        wall += time.perf_counter() - start
        outputs.append(tokens[0])
        ttft.append(stamps[0] - start)
        itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
        progress(len(tokens[0]))
    sub = "" if len(indices) == len(prompts) else f"; {len(indices)} of {len(prompts)} requests"
    return RunResult.of_outputs(
        "HF generate, one by one", prompts, outputs, wall, indices,
        prompt_tokens_computed=sum(len(prompts[i]) for i in indices), ttft_s=ttft, itl_s=itl,
        notes=f"TTFT from each request's own start (no queueing){sub}",
    )  # fmt: skip


def run_static_batches(
    model: Any, prompts: list[list[int]], batch_size: int, max_tokens: int, pad_token_id: int, progress: Progress
) -> RunResult:
    """``generate`` over consecutive left-padded batches; every request is submitted at the start."""
    outputs, ttft, itl = [], [], []
    padded_prompt_tokens = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        tokens, stamps = _generate_padded(model, batch, max_tokens, pad_token_id)
        outputs.extend(tokens)
        padded_prompt_tokens += len(batch) * max(len(p) for p in batch)
        ttft.extend([stamps[0] - start] * len(batch))
        itl.extend(b - a for a, b in zip(stamps, stamps[1:]) for _ in batch)
        progress(sum(len(t) for t in tokens))
    wall = time.perf_counter() - start
    return RunResult.of_outputs(
        f"HF generate, static batches of {batch_size}", prompts, outputs, wall,
        prompt_tokens_computed=padded_prompt_tokens, ttft_s=ttft, itl_s=itl,
        notes="prompt tokens computed include left padding",
    )  # fmt: skip


@torch.inference_mode()
def run_continuous_batching(model: Any, prompts: list[list[int]], max_tokens: int, progress: Progress) -> RunResult:
    """transformers' continuous batching (``generate_batch``), its paged cache sized for the workload."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    page_size = 256
    num_tokens = sum(len(p) + max_tokens for p in prompts)
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=math.ceil(num_tokens / page_size) + len(prompts),
        max_batch_tokens=CB_MAX_BATCH_TOKENS,
        max_requests_per_batch=len(prompts),
    )
    # NOTE: generate_batch reads EOS from its own config, then the model's; -1 disables it.
    gen_config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1)
    start = time.perf_counter()
    results = model.generate_batch(
        inputs=prompts,
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        record_timestamps=True,
        progress_bar=False,
        warmup=False,
    )
    wall = time.perf_counter() - start
    ordered = list(results.values())  # generate_batch returns them in input order
    errors = [r.error for r in ordered if r.error]
    if len(ordered) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(ordered)} of {len(prompts)} requests; errors: {errors[:3]}")
    ttft, itl = [], []
    for r in ordered:
        stamps = r.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start)
            itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
    outputs = [list(r.generated_tokens) for r in ordered]
    progress(sum(len(o) for o in outputs))
    return RunResult.of_outputs(
        "transformers continuous batching", prompts, outputs, wall, ttft_s=ttft, itl_s=itl,
        notes=f"generate_batch, page size {page_size}, {CB_MAX_BATCH_TOKENS} tokens per batch",
    )


def subsample(num_prompts: int, num_wanted: int | None) -> list[int]:
    """``num_wanted`` prompt indices spread evenly over the workload (all of them for None)."""
    if num_wanted is None or num_wanted >= num_prompts:
        return list(range(num_prompts))
    step = num_prompts / num_wanted
    return [int(i * step) for i in range(num_wanted)]


def run_baseline(
    name: str,
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    pad_token_id: int,
    baseline_requests: int | None,
    progress: Progress,
) -> RunResult:
    """Run baseline ``name`` (one of ``BASELINES``)."""
    if name == "one-by-one":
        indices = subsample(len(prompts), baseline_requests)
        return run_one_by_one(model, prompts, indices, max_tokens, pad_token_id, progress)
    if name.startswith("static-"):
        return run_static_batches(model, prompts, int(name.split("-")[1]), max_tokens, pad_token_id, progress)
    if name == "continuous":
        return run_continuous_batching(model, prompts, max_tokens, progress)
    raise ValueError(f"baseline must be one of {', '.join(BASELINES)}; got {name!r}")
