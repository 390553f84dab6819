"""A GGUF file's float32 twin: transformers' own reading of the file, dequantized to float32 and saved as a
Hugging Face directory once. The engine serves a GGUF in its own blocks and never loads through this; it is the
reference the tests compare those blocks with, and what ``benchmarks/bench_forward.py`` times as the file's float
formats.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

from engine.paths import cache_root


def dequantized_hf_directory(gguf: Path) -> Path:
    """The float32 Hugging Face directory of ``gguf`` (weights, config, tokenizer), made once under
    ``$PAGED_CACHE/gguf-dequantized``."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    entry = cache_root() / "gguf-dequantized" / f"{gguf.stem}-{key}"
    done = entry / ".complete"
    if done.exists():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with (entry.parent / f"{entry.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _write(gguf, entry)
    return entry


def _write(gguf: Path, entry: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(entry, ignore_errors=True)
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    staging.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers refuses save_pretrained on a GGUF-loaded model
        del config.quantization_config
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(staging)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / ".complete").write_text("")
    os.replace(staging, entry)
