"""The Triton backend inside the model runner: same logits as the PyTorch backend, step by step."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from engine.attention.triton_backend import TritonAttentionBackend


def test_runner_steps_match_torch_backend(tiny_model_factory: Callable) -> None:
    """Prefill, a chunk over a shared prefix next to a decode, then pure decode: logits agree."""
    try:
        from engine.config import EngineConfig
        from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
        from engine.layers.attention import Attention
        from engine.worker.model_runner import ModelRunner
    except ImportError:
        pytest.skip("the model runner is not available")
    model_dir = tiny_model_factory("llama")
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=16, attention_backend="torch")
    reference, runner = ModelRunner(config, model_dir), ModelRunner(config, model_dir)
    backend = TritonAttentionBackend(decode_num_splits=2)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert layers
    for attn in layers:
        attn.backend = backend

    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 1000, (40,), generator=gen).tolist()
    b = a[:32] + torch.randint(0, 1000, (9,), generator=gen).tolist()  # shares a's first 2 blocks
    steps = [
        [ScheduledRequest("a", a, 0, ([5, 9, 2],), True)],
        [ScheduledRequest("a", [7], 40, ([5, 9, 2],), True), ScheduledRequest("b", b[32:], 32, ([5, 9, 11],), True)],
        [ScheduledRequest("a", [8], 41, ([5, 9, 2],), True), ScheduledRequest("b", [3], 41, ([5, 9, 11],), True)],
    ]
    for scheduled in steps:
        expected = reference.execute_model(SchedulerOutput(scheduled))
        got = runner.execute_model(SchedulerOutput(scheduled))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
