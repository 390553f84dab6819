"""What the engine reads about its model besides the weights: its short name and its EOS ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.paths import bundled_gguf_path


def model_name(model: Any) -> str:
    """A short name for outputs and /v1/models: the file or directory name, without a quantisation suffix."""
    path = bundled_gguf_path() if model is None else Path(model)
    name = path.name.rstrip("/") or str(model)
    return name.split(".")[0] if path.suffix == ".gguf" else name


def eos_token_ids(model_dir: Any, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json, the model config and the tokenizer."""
    ids: set[int] = set()
    candidates: list[Any] = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
