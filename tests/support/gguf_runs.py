"""Running GGUF files the tests write: one prompt's last logits from a runner, and the Hugging Face model whose
weights are a file type's values (the float32 model a quantized file dequantizes to)."""

from __future__ import annotations

import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.model_files.gguf_quants import dequantize, quantize
from engine.worker.model_runner import ModelRunner


def last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The logits after ``prompt``, prefilled in one step (each KV cache group its own block ids)."""
    n = -(-len(prompt) // runner.block_size)
    tables = tuple(list(range(g * n, (g + 1) * n)) for g in range(len(runner.kv_cache_windows)))
    return runner.execute_model(SchedulerOutput(scheduled=[ScheduledRequest("r", prompt, 0, tables, True)]))[0]


def round_to_type(hf, type_name: str) -> None:
    """Every matrix of ``hf`` (a 3-D experts tensor: its rows in turn) replaced by its ``type_name`` blocks' values,
    as a file of that type stores every weight; norms and routers (``*.gate.weight``) stay as they are."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() >= 2 and not name.endswith(".gate.weight"):
                rows = param.view(-1, param.shape[-1]).numpy()
                rows[:] = dequantize(quantize(rows, type_name), type_name).reshape(rows.shape)
