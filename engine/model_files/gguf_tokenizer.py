"""A Hugging Face byte-level BPE tokenizer as GGUF metadata (``tokenizer.ggml.*`` and the chat template).

What convert_hf_to_gguf.py writes for a gpt2-style BPE: one token per id up to the model's vocab
size (added tokens CONTROL when special, USER_DEFINED otherwise, ``[PAD<id>]`` UNUSED for ids the
tokenizer lacks), the merges, the special token ids, ``add_bos_token`` and the chat template
(gguf-py's ``SpecialVocab`` reads those). ``tokenizer.ggml.pre`` names llama.cpp's pre-tokenizer for
the tokenizer's own split rule.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, SpecialVocab, TokenType

logger = logging.getLogger(__name__)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {_LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


def add_tokenizer(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """Write the tokenizer of ``model_dir`` (its ``tokenizer.json``) for a model of ``vocab_size`` ids.

    Raises:
        ValueError: no tokenizer.json, or a tokenizer that is not byte-level BPE.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{str(model_dir)!r} has no tokenizer.json; GGUF files are written from a fast tokenizer")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{str(path)!r}: a {model.get('type')!r} tokenizer; only byte-level BPE is written")
    tokens, types = token_table(model["vocab"], tokenizer.get("added_tokens") or [], vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token:
        writer.add_add_bos_token(False)


def token_table(
    vocab: dict[str, int], added_tokens: list[dict[str, Any]], vocab_size: int
) -> tuple[list[str], list[int]]:
    """The token text and GGUF token type of every id below ``vocab_size``."""
    text = {token_id: token for token, token_id in vocab.items()}
    added = {t["id"]: t for t in added_tokens}
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id in added:
            tokens.append(added[token_id]["content"])
            types.append(TokenType.CONTROL if added[token_id].get("special") else TokenType.USER_DEFINED)
        elif token_id in text:
            tokens.append(text[token_id])
            types.append(TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{token_id}]")
            types.append(TokenType.UNUSED)
    return tokens, [int(t) for t in types]


def pre_tokenizer_name(pre_tokenizer: dict[str, Any] | None) -> str:
    """llama.cpp's name for a tokenizer.json ``pre_tokenizer`` (``default`` with a warning when unknown)."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or ([pre_tokenizer] if pre_tokenizer else [])
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and (name := _SPLIT_PRE.get(steps[0].get("pattern", {}).get("Regex"))):
        return name
    logger.warning("unknown pre-tokenizer %s; writing tokenizer.ggml.pre = 'default'", json.dumps(pre_tokenizer)[:200])
    return "default"
