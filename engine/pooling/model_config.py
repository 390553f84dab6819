"""What a pooling model's own files say: its task, pooling, normalization, prompt prefixes and max length.

Read without torch from ``config.json``, sentence-transformers' ``modules.json``,
``1_Pooling/config.json``, ``config_sentence_transformers.json`` and ``sentence_bert_config.json``,
and the tokenizer's ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model_types import ENCODER_MODEL_TYPES

TASKS = ("generate", "embed", "classify")
POOLING_MODES = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}  # fmt: skip
_UNSERVED_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    """How a pooling model turns token states into an embedding or a score.

    Attributes:
        task: "embed" or "classify" (a cross-encoder's score).
        model_type: config.json's ``model_type`` (``bert``, ``xlm-roberta``, ``qwen3``).
        pooling: "mean", "max", "cls" or "last" (over every token the model read, special tokens included).
        normalize: whether embeddings are L2-normalized by default.
        max_length: most tokens of one input (sentence-transformers' ``max_seq_length``, else the model's).
        prompts: prompt prefixes by name (``{"query": "query: "}``); default_prompt_name: the one used unasked.
        matryoshka_dimensions: the ``dimensions`` the model declares; None: truncation refused; (): any.
        hidden_size: the embedding's full size; vocab_size: token ids below it are valid;
        num_labels: a classifier's outputs.
    """

    task: str
    model_type: str
    pooling: str
    normalize: bool
    max_length: int
    hidden_size: int
    vocab_size: int
    num_labels: int = 1
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {e}") from None


def _module_path(model_dir: Path, kind: str) -> Path | None:
    """The folder of the sentence-transformers module of ``kind`` (``Pooling``, ``Normalize``), if listed."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    for module in _read_json(modules_file):
        if str(module.get("type", "")).rsplit(".", 1)[-1] == kind:
            return model_dir / module.get("path", "")
    return None


def model_task(model_dir: Path, runner: str = "auto", convert: str = "auto") -> str:
    """The model's task from its files, or as ``runner`` / ``convert`` (vLLM's settings) force it.

    A ``*ForSequenceClassification`` architecture is a classifier (a cross-encoder's score); a
    sentence-transformers ``modules.json`` with a ``Pooling`` module, or an encoder model
    (``BertModel``, ``XLMRobertaModel``), an embedder; anything else generates.
    ``runner="pooling"`` makes any model a pooling one (``convert``, else embed).

    Raises:
        ModelLoadError: ``runner="generate"`` for an encoder model, which cannot generate.
    """
    config = _read_json(model_dir / "config.json")
    architectures = config.get("architectures") or []
    if runner == "generate":
        if config.get("model_type") in ENCODER_MODEL_TYPES:
            raise ModelLoadError(f"{str(model_dir)!r} is an encoder ({config.get('model_type')}): it cannot generate")
        return "generate"
    if convert != "auto":
        return convert
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classify"
    if _module_path(model_dir, "Pooling") is not None or config.get("model_type") in ENCODER_MODEL_TYPES:
        return "embed"
    return "embed" if runner == "pooling" else "generate"


def model_pooling(model_dir: Path, runner: str = "auto", convert: str = "auto") -> tuple[str, PoolingConfig | None]:
    """The model's task (``model_task``) and, for a pooling model, its ``PoolingConfig``."""
    task = model_task(model_dir, runner, convert)
    return task, None if task == "generate" else pooling_config(model_dir, task)


def pooling_config(model_dir: Path, task: str) -> PoolingConfig:
    """The pooling of a model whose task is ``task`` ("embed" or "classify"), as its files give it.

    Without sentence-transformers files an encoder pools its CLS token and a decoder its last
    token, both normalized (vLLM's defaults).

    Raises:
        ModelLoadError: a pooling mode the engine does not serve (mean_sqrt_len, weightedmean).
    """
    config = _read_json(model_dir / "config.json")
    model_type = str(config.get("model_type"))
    encoder = model_type in ENCODER_MODEL_TYPES
    pooling, normalize = ("cls" if encoder else "last"), True
    pooling_dir = _module_path(model_dir, "Pooling")
    if pooling_dir is not None and (pooling_dir / "config.json").is_file():
        modes = _read_json(pooling_dir / "config.json")
        unserved = [m for m in _UNSERVED_MODES if modes.get(m)]
        chosen = [name for key, name in POOLING_MODES.items() if modes.get(key)]
        if unserved or len(chosen) != 1:
            raise ModelLoadError(
                f"{str(pooling_dir)!r}: pooling {unserved or chosen} not served; one of cls, mean, max, lasttoken"
            )
        pooling = chosen[0]
        normalize = _module_path(model_dir, "Normalize") is not None
    st_config = model_dir / "config_sentence_transformers.json"
    st = _read_json(st_config) if st_config.is_file() else {}
    matryoshka = config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in matryoshka) if matryoshka else (() if config.get("is_matryoshka") else None)
    id2label = config.get("id2label") or {}
    return PoolingConfig(
        task=task, model_type=model_type, pooling=pooling, normalize=normalize,
        max_length=_max_length(model_dir, config, encoder), hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]), num_labels=int(config.get("num_labels") or len(id2label) or 1),
        prompts=dict(st.get("prompts") or {}), default_prompt_name=st.get("default_prompt_name") or None, matryoshka_dimensions=dims,
    )  # fmt: skip


def _max_length(model_dir: Path, config: dict[str, Any], encoder: bool) -> int:
    """sentence-transformers' ``max_seq_length``, else the least of the model's positions and the tokenizer's limit."""
    sbert = model_dir / "sentence_bert_config.json"
    if sbert.is_file() and (length := _read_json(sbert).get("max_seq_length")):
        return int(length)
    positions = int(config.get("max_position_embeddings") or 512)
    if encoder and config.get("model_type") == "xlm-roberta":
        positions -= int(config.get("pad_token_id", 1)) + 1  # RoBERTa's positions start after the padding index
    tokenizer_config = model_dir / "tokenizer_config.json"
    limit = _read_json(tokenizer_config).get("model_max_length") if tokenizer_config.is_file() else None
    return min(positions, int(limit)) if isinstance(limit, (int, float)) and limit < 1e9 else positions
