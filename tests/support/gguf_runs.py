"""Running GGUF files the tests write: one prompt's last logits from a runner, and the Hugging Face model holding a
file's weights (a quantized file's dequantized values: the float32 model its blocks stand for)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.model_files.checkpoint import GGUFCheckpoint
from engine.model_files.gguf import GGUFFile
from engine.worker.model_runner import ModelRunner

# transformers' in-memory experts: [experts, 2 * width, hidden] gate rows first, and [experts, hidden, width]
_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The logits after ``prompt``, prefilled in one step (each KV cache group its own block ids)."""
    n = -(-len(prompt) // runner.block_size)
    tables = tuple(list(range(g * n, (g + 1) * n)) for g in range(len(runner.kv_cache_windows)))
    return runner.execute_model(SchedulerOutput(scheduled=[ScheduledRequest("r", prompt, 0, tables, True)]))[0]


def load_gguf_weights(hf, path: Path) -> None:
    """Every parameter of ``hf`` set to the GGUF file's values of it (dequantized to float32 by gguf-py), read by
    Hugging Face name through ``GGUFCheckpoint``; a 3-D experts parameter from its experts' weights in turn."""
    config = hf.config
    checkpoint = GGUFCheckpoint(GGUFFile(path), config.num_attention_heads, config.num_key_value_heads)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if match := _EXPERTS.fullmatch(name):
                base, kind = match.groups()
                parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for e in range(param.shape[0]):
                    param[e] = torch.cat([checkpoint.tensor(f"{base}.{e}.{part}.weight") for part in parts]).float()
            else:
                param.copy_(checkpoint.tensor(name).float())
