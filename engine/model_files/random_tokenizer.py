"""The tokenizer of random-weight models: the bundled SmolLM2's, padded to any vocab size.

The bundled model's tokenizer (49152 ids, byte-level BPE, a ChatML chat template) is built once
from its GGUF with transformers and kept in the cache; transformers drops the GGUF's pre-tokenizer
(``smollm``: digits split one by one), so it is put back, and the tokenizer is SmolLM2's own. A
model of a larger vocab gets it with ``<|reserved_N|>`` entries appended to the BPE vocab up to the
size: every id the model can emit decodes, prompts tokenize as before, and the files stay the size
of a real tokenizer's (as added tokens, 100k of them would take transformers seconds to load).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from engine.model_files.gguf_tokenizer import QWEN2_SPLIT
from engine.paths import bundled_gguf_path, cache_root

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# NOTE: transformers loads a qwen2 model's tokenizer as its Qwen2Tokenizer, which replaces tokenizer.json's
# pre-tokenizer with Qwen2's split (and adds NFC). A qwen2 random model's tokenizer.json says so itself, so
# that its GGUF (tokenizer.ggml.pre = qwen2) and llama.cpp split text as transformers does.
_PRE_TOKENIZERS = {
    "qwen2": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
}
_NORMALIZERS = {"qwen2": {"type": "NFC"}}


def base_tokenizer_dir() -> Path:
    """The bundled model's tokenizer files, built from its GGUF on first use under ``$PAGED_CACHE/tokenizers``."""
    gguf_path = bundled_gguf_path()
    target = cache_root() / "tokenizers" / gguf_path.stem
    if all((target / name).is_file() for name in TOKENIZER_FILES):
        return target
    import transformers
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    pre = GGUFReader(gguf_path).fields["tokenizer.ggml.pre"].contents()
    if pre != "smollm":
        raise ValueError(f"{str(gguf_path)!r}: tokenizer.ggml.pre is {pre!r}; random models expect smollm")
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save_pretrained(staging)
    try:
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tokenizer(out_dir: Path, vocab_size: int, model_type: str) -> dict[str, int]:
    """Write the base tokenizer, padded to ``vocab_size`` ids, into ``out_dir`` for a model of ``model_type``.

    Returns:
        The ids of its ``bos``, ``eos`` and ``pad`` tokens.

    Raises:
        ValueError: ``vocab_size`` is smaller than the base tokenizer's.
    """
    base = base_tokenizer_dir()
    tokenizer = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer.get("added_tokens") or []}
    base_size = max([*vocab.values(), *added.values()]) + 1
    if vocab_size < base_size:
        raise ValueError(f"vocab_size {vocab_size} is below the base tokenizer's {base_size} ids")
    for token_id in range(base_size, vocab_size):
        vocab[f"<|reserved_{token_id}|>"] = token_id
    if model_type in _PRE_TOKENIZERS:
        tokenizer["pre_tokenizer"] = _PRE_TOKENIZERS[model_type]
        tokenizer["normalizer"] = _NORMALIZERS[model_type]
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    for name in TOKENIZER_FILES[1:]:
        shutil.copy(base / name, out_dir / name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    ids = {"bos": config.get("bos_token"), "eos": config.get("eos_token"), "pad": config.get("pad_token")}
    return {kind: added.get(token, vocab.get(token)) for kind, token in ids.items() if token is not None}
