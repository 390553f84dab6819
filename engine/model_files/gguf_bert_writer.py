"""A BERT embedder's Hugging Face directory written as a GGUF file, as llama.cpp's ``convert_hf_to_gguf.py`` writes
it (architecture ``bert``): the tests' and benchmarks' way to a BERT GGUF without llama.cpp.

Tensors ``token_embd``, ``position_embd``, ``token_types``, ``token_embd_norm``, ``blk.N.attn_q/k/v``,
``attn_output``, ``attn_output_norm``, ``ffn_up``, ``ffn_down``, ``layer_output_norm`` (the pooler dropped); 2-D
weights in the file type but the position and token-type tables in F32, 1-D tensors in F32; ``bert.*`` sizes,
``bert.attention.causal`` false, ``bert.pooling_type`` from sentence-transformers' Pooling module; the WordPiece
vocab in llama.cpp's phantom-space form with its special ids and ``normalizer.lowercase``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter, LlamaFileType, PoolingType, SpecialVocab, TokenType

from engine.model_files.gguf_bert import PHANTOM_SPACE, POOLING_MODES
from engine.model_files.gguf_quants import ggml_type, quantize

FILE_TYPES = {"F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "Q8_0": LlamaFileType.MOSTLY_Q8_0}
_TOP = {
    "embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
}  # fmt: skip
_LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}  # fmt: skip
_F32_TABLES = ("position_embd.weight", "token_types.weight")  # llama.cpp keeps these in F32 in every file type


def gguf_tensor_name(name: str) -> str | None:
    """llama.cpp's name of a BERT checkpoint tensor; None for one it drops (the pooler, an MLM head)."""
    name = name.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")
    base, _, part = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{part}"
    if base.startswith("encoder.layer."):
        layer, _, rest = base.removeprefix("encoder.layer.").partition(".")
        if rest in _LAYER:
            return f"blk.{layer}.{_LAYER[rest]}.{part}"
    return None


def write_bert_gguf(hf_dir: Path, out_path: Path, file_type: str = "F32") -> None:
    """Write ``hf_dir`` (a ``BertModel`` and its WordPiece ``vocab.txt``) as a ``bert`` GGUF of ``file_type``.

    Raises:
        ValueError: not a BERT directory, no vocab.txt, or a file type other than F32, F16, Q8_0.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}")
    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("model_type") != "bert":
        raise ValueError(f"{str(hf_dir)!r}: model_type {config.get('model_type')!r}; only bert is written")
    writer = GGUFWriter(out_path, "bert")
    writer.add_name(hf_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config.get("layer_norm_eps", 1e-12))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_file_type(FILE_TYPES[file_type])
    writer.add_causal_attention(False)
    if (pooling := _pooling_type(hf_dir)) is not None:
        writer.add_pooling_type(PoolingType(pooling))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    _add_vocab(writer, hf_dir, config)
    for name, values in _checkpoint_tensors(hf_dir):
        gguf_name = gguf_tensor_name(name)
        if gguf_name is None:
            continue
        type_name = file_type if values.ndim == 2 and gguf_name not in _F32_TABLES else "F32"
        if type_name == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(values, dtype=np.float32))
        elif type_name == "F16":
            writer.add_tensor(gguf_name, values.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(values, type_name), raw_dtype=ggml_type(type_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _checkpoint_tensors(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor of the directory's safetensors files as float32 (a BERT checkpoint also holds int64
    ``position_ids``, which the reader of decoders refuses)."""
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(hf_dir)!r} has no *.safetensors weights")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if gguf_tensor_name(name) is not None:
                    yield name, f.get_tensor(name).float().numpy()


def _pooling_type(hf_dir: Path) -> int | None:
    modules_file = hf_dir / "modules.json"
    if not modules_file.is_file():
        return None
    for module in json.loads(modules_file.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            modes = json.loads((hf_dir / module.get("path", "") / "config.json").read_text())
            chosen = [pooling for pooling, mode in POOLING_MODES.items() if modes.get(mode)]
            if len(chosen) != 1:
                raise ValueError(f"{str(hf_dir)!r}: llama.cpp writes mean, cls or last-token pooling; got {modes}")
            return chosen[0]
    return None


def _add_vocab(writer: GGUFWriter, hf_dir: Path, config: dict) -> None:
    """The WordPiece vocab in llama.cpp's form: ``piece`` as ``▁piece``, ``##piece`` as ``piece``, special tokens
    (CONTROL) as they are."""
    vocab_file = hf_dir / "vocab.txt"
    if not vocab_file.is_file():
        raise ValueError(f"{str(hf_dir)!r} has no vocab.txt; a BERT GGUF is written from its WordPiece vocab")
    vocab = vocab_file.read_text(encoding="utf-8").split("\n")[: config["vocab_size"]]
    vocab += [f"[PAD{i}]" for i in range(len(vocab), config["vocab_size"])]  # ids the vocab lacks, as llama.cpp
    tokenizer_config_file = hf_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_file.read_text()) if tokenizer_config_file.is_file() else {}
    special = {tokenizer_config.get(k) for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
    special |= {"[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]"}
    tokens, types = [], []
    for token in vocab:
        if token in special:
            tokens.append(token)
            types.append(TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else PHANTOM_SPACE + token)
            types.append(TokenType.NORMAL)
    writer.add_token_type_count(config.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", bool(tokenizer_config.get("do_lower_case", True)))
