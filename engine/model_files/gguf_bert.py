"""A BERT embedder's GGUF (architecture ``bert``, as llama.cpp's ``convert_hf_to_gguf.py`` writes all-MiniLM, bge,
e5) read as a Hugging Face directory: ``config.json`` (a ``BertModel``), the WordPiece tokenizer from
``tokenizer.ggml.*``, and sentence-transformers' ``modules.json`` / ``1_Pooling`` / ``2_Normalize`` from
``bert.pooling_type``, so that the pooling path reads it as it reads a model directory. transformers reads no
``bert`` GGUF, so this replaces its reading for the architecture. numpy and transformers' tokenizer only.

llama.cpp stores the vocab in a "phantom space" form: a word-initial piece as ``▁piece``, a continuation ``##piece``
as ``piece``, control tokens ([CLS], [SEP], ...) as they are; ``wordpiece_vocab`` undoes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model_files.gguf import GGUFFile

PHANTOM_SPACE = "\u2581"
CONTROL = 3  # gguf.TokenType.CONTROL
# llama.cpp's pooling_type (gguf.PoolingType) -> sentence-transformers' Pooling mode; 0 none, 4 rank are not served
POOLING_MODES = {1: "pooling_mode_mean_tokens", 2: "pooling_mode_cls_token", 3: "pooling_mode_lasttoken"}
_UNSERVED_POOLING = {0: "none (one embedding per token)", 4: "rank (a cross-encoder's score)"}
# tensors of a classification head, which llama.cpp writes for BertForSequenceClassification
_CLASSIFIER_TENSORS = ("cls.output.weight", "cls.weight", "classifier.out_proj.weight")


def check_bert_file(gguf: GGUFFile) -> None:
    """Refuse, by what they are, the ``bert`` files this engine does not serve as embedders.

    Raises:
        ModelLoadError: a tokenizer other than WordPiece (RoBERTa's BPE and XLM-RoBERTa's unigram, which llama.cpp
            also writes as ``bert``), a pooling type of none or rank, or a classification head.
    """
    meta, path = gguf.metadata, gguf.path
    tokenizer = meta.get("tokenizer.ggml.model")
    if tokenizer != "bert":
        raise ModelLoadError(
            f"{str(path)!r}: a GGUF 'bert' file with a {tokenizer!r} tokenizer (RoBERTa / XLM-RoBERTa as llama.cpp "
            "writes them) is not served; GGUF embedders served: BERT with its WordPiece vocab (tokenizer 'bert'). "
            "Load the model's Hugging Face directory instead"
        )
    pooling = meta.get("bert.pooling_type")
    if pooling is not None and int(pooling) not in POOLING_MODES:
        what = _UNSERVED_POOLING.get(int(pooling), f"type {int(pooling)}")
        raise ModelLoadError(
            f"{str(path)!r}: bert.pooling_type={int(pooling)}, {what}, is not served for a GGUF; served: 1 mean, "
            "2 cls, 3 last"
        )
    if meta.get("bert.classifier.output_labels") is not None or any(n in gguf.tensors for n in _CLASSIFIER_TENSORS):
        raise ModelLoadError(
            f"{str(path)!r}: a GGUF BERT classifier (cross-encoder) is not served; load its Hugging Face directory"
        )
    if meta.get("bert.attention.causal", False):
        raise ModelLoadError(f"{str(path)!r}: bert.attention.causal is true; a BERT encoder attends both ways")


def wordpiece_vocab(tokens: list[str], token_types: Any) -> list[str]:
    """The WordPiece vocab (``vocab.txt``'s lines, by id) of llama.cpp's phantom-space token list."""
    vocab = []
    for token, token_type in zip(tokens, token_types):
        if int(token_type) == CONTROL:
            vocab.append(token)
        elif token.startswith(PHANTOM_SPACE):
            vocab.append(token[1:])
        else:
            vocab.append("##" + token)
    return vocab


def bert_config(gguf: GGUFFile) -> dict[str, Any]:
    """``config.json`` of a ``bert`` GGUF: a ``BertModel`` of the file's sizes (GELU, as llama.cpp runs it)."""
    meta = gguf.metadata
    positions = gguf.tensors["position_embd.weight"].shape[0] if "position_embd.weight" in gguf.tensors else None
    types = gguf.tensors["token_types.weight"].shape[0] if "token_types.weight" in gguf.tensors else 0
    return {
        "architectures": ["BertModel"], "model_type": "bert",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": int(meta["bert.embedding_length"]),
        "num_hidden_layers": int(meta["bert.block_count"]),
        "num_attention_heads": int(meta["bert.attention.head_count"]),
        "intermediate_size": int(meta["bert.feed_forward_length"]),
        "max_position_embeddings": int(positions or meta["bert.context_length"]),
        "type_vocab_size": int(meta.get("tokenizer.ggml.token_type_count", types) or types or 1),
        "layer_norm_eps": float(meta.get("bert.attention.layer_norm_epsilon", 1e-12)),
        "hidden_act": "gelu", "position_embedding_type": "absolute",
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    }  # fmt: skip


def write_bert_directory(gguf: GGUFFile, out: Path) -> None:
    """Write the Hugging Face files of a ``bert`` GGUF into ``out`` (an existing, empty directory): config,
    tokenizer, and the sentence-transformers pooling the file names (none when it names none: CLS, as for a bare
    ``BertModel``). Embeddings are normalized, as llama.cpp's server returns them.

    Raises:
        ModelLoadError: a file ``check_bert_file`` refuses, or one missing a key a BERT file has.
    """
    check_bert_file(gguf)
    meta = gguf.metadata
    try:
        config = bert_config(gguf)
        vocab = wordpiece_vocab(list(meta["tokenizer.ggml.tokens"]), meta["tokenizer.ggml.token_type"])
    except KeyError as e:
        raise ModelLoadError(f"{str(gguf.path)!r}: a 'bert' GGUF without {e.args[0]!r}") from None
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(meta, vocab, config["max_position_embeddings"], out)
    pooling = meta.get("bert.pooling_type")
    if pooling is None:
        return
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    (out / "1_Pooling").mkdir()
    modes = {mode: mode == POOLING_MODES[int(pooling)] for mode in POOLING_MODES.values()}
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config["hidden_size"], **modes}, indent=1)
    )
    (out / "2_Normalize").mkdir()


def _write_tokenizer(meta: dict[str, Any], vocab: list[str], max_length: int, out: Path) -> None:
    """``tokenizer.json`` (BERT's normalizer, pre-tokenizer, WordPiece and [CLS] .. [SEP] template), ``vocab.txt``
    and a ``tokenizer_config.json`` naming ``BertTokenizer``, as a BERT model directory has them."""
    from tokenizers.implementations import BertWordPieceTokenizer

    def special(key: str, default: str) -> str:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return vocab[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(vocab) else default

    # NOTE: llama.cpp writes [CLS] as the BOS token (gguf-py has no CLS key) and [SEP] as EOS and separator
    specials = {
        "unk_token": special("unknown", "[UNK]"), "sep_token": special("seperator", special("eos", "[SEP]")),
        "pad_token": special("padding", "[PAD]"), "cls_token": special("bos", "[CLS]"),
        "mask_token": special("mask", "[MASK]"),
    }  # fmt: skip
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", False))
    tokenizer = BertWordPieceTokenizer(
        {token: token_id for token_id, token in reversed(list(enumerate(vocab)))}, lowercase=lowercase,
        unk_token=specials["unk_token"], sep_token=specials["sep_token"], cls_token=specials["cls_token"],
        pad_token=specials["pad_token"], mask_token=specials["mask_token"],
    )  # fmt: skip
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "vocab.txt").write_text("".join(token + "\n" for token in vocab), encoding="utf-8")
    config = {
        "tokenizer_class": "BertTokenizer", "do_lower_case": lowercase, "tokenize_chinese_chars": True,
        "strip_accents": None, "model_max_length": max_length, **specials,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
