"""BERT embedders as llama.cpp writes them (GGUF architecture ``bert``): kind, pooling, tokenizer and weights from
the file, equal to the same model from its Hugging Face directory; other embedder files refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter, PoolingType

from engine import Engine, PoolingParams
from engine.errors import ModelLoadError
from engine.model_files.gguf import GGUFFile
from engine.model_files.gguf_bert import wordpiece_vocab
from engine.model_files.gguf_bert_writer import write_bert_gguf

TEXTS = ["short", "a somewhat longer sentence about paged attention", "x " * 60, "Café naïve 東京 [SEP] mixed"]
SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Ünïcödé àccents and 中文字符 mixed with emoji 🙂",
    "a",
    "retrieval " * 400,
]
# the least cosine with the Hugging Face directory's embeddings per file type (Q8_0: weights and x in int8 blocks)
MIN_COSINE = {"F32": 0.99999, "F16": 0.99999, "Q8_0": 0.999}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _embed(engine: Engine, texts: list[str], params: PoolingParams | None = None) -> np.ndarray:
    return np.array([o.outputs.embedding for o in engine.embed(texts, params)])


@pytest.mark.parametrize("file_type", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_bert_gguf_equals_its_directory(tiny_encoder_factory, tmp_path: Path, file_type: str, pooling: str) -> None:
    """A tiny random BERT written as GGUF is an embedder with the file's pooling and tokenizer, and embeds as its
    Hugging Face directory does (cosine >= 0.99999 in F32)."""
    model_dir = tiny_encoder_factory("bert", st_pooling=pooling)
    path = tmp_path / f"tiny-{pooling}-{file_type}.gguf"
    write_bert_gguf(model_dir, path, file_type)
    engine = Engine(model=str(path), device="cpu", dtype="float32")
    reference = Engine(model=str(model_dir), device="cpu", dtype="float32")
    assert engine.task == "embed"
    assert engine.runner.pooling.pooling == pooling
    for text in TEXTS:
        assert engine.tokenizer(text)["input_ids"] == reference.tokenizer(text)["input_ids"]
    ours, theirs = _embed(engine, TEXTS), _embed(reference, TEXTS)
    assert _cosines(ours, theirs).min() >= MIN_COSINE[file_type]
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    if file_type == "Q8_0":
        assert engine.runner.weights.modules == {"Q8_0": 2 * 4}  # served in its blocks: 4 linears a layer
        auto = Engine(model=str(path), device="cpu")  # dtype "auto" keeps the blocks too
        assert auto.runner.weights.modules == {"Q8_0": 2 * 4}
        np.testing.assert_allclose(_embed(auto, TEXTS), ours, atol=1e-6)
    alone = np.array([_embed(engine, [t])[0] for t in TEXTS])
    np.testing.assert_allclose(alone, ours, atol=1e-5)


def test_bare_bert_gguf_pools_cls(tiny_encoder_factory, tmp_path: Path) -> None:
    """A file without bert.pooling_type (a bare BertModel) pools its CLS token, as the directory does."""
    model_dir = tiny_encoder_factory("bert")
    write_bert_gguf(model_dir, tmp_path / "bare.gguf")
    engine = Engine(model=str(tmp_path / "bare.gguf"), device="cpu", dtype="float32")
    assert engine.runner.pooling.pooling == "cls"
    reference = Engine(model=str(model_dir), device="cpu", dtype="float32")
    assert _cosines(_embed(engine, TEXTS), _embed(reference, TEXTS)).min() >= 0.99999


@pytest.mark.parametrize("file_type", ["F32", "F16"])
def test_minilm_gguf_equals_sentence_transformers(minilm_dir: Path, sentence_transformer, tmp_path: Path,
                                                  file_type: str) -> None:  # fmt: skip
    """The shipped MiniLM as llama.cpp writes it embeds as sentence-transformers does (cosine >= 0.9999); the file
    records no max_seq_length, so inputs run to its 512 positions unless cut to sentence-transformers' 256."""
    path = tmp_path / f"minilm-{file_type}.gguf"
    write_bert_gguf(minilm_dir, path, file_type)
    engine = Engine(model=str(path), device="cpu", dtype="float32")
    assert engine.task == "embed" and engine.max_model_len == 512
    outputs = engine.embed(SENTENCES, PoolingParams(truncate_prompt_tokens=256))
    ours = np.array([o.outputs.embedding for o in outputs])
    reference = sentence_transformer.encode(SENTENCES, convert_to_numpy=True)
    assert _cosines(ours, reference).min() >= 0.9999
    assert max(len(o.prompt_token_ids) for o in outputs) == 256


def test_phantom_space_vocab_round_trips(minilm_dir: Path, tmp_path: Path) -> None:
    """The vocab written in llama.cpp's phantom-space form reads back as the model's vocab.txt, id for id."""
    path = tmp_path / "minilm.gguf"
    write_bert_gguf(minilm_dir, path, "Q8_0")
    meta = GGUFFile(path).metadata
    assert meta["tokenizer.ggml.tokens"][:3] == ["[PAD]", "\u2581[unused0]", "\u2581[unused1]"]
    vocab = (minilm_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")[:30522]
    assert wordpiece_vocab(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]) == vocab


def test_gguf_embedder_cannot_score(tiny_encoder_factory, tmp_path: Path) -> None:
    """convert="classify" on a BERT GGUF (no classification head in the file) is a ModelLoadError naming it."""
    write_bert_gguf(tiny_encoder_factory("bert", st_pooling="mean"), tmp_path / "e.gguf")
    with pytest.raises(ModelLoadError, match="has no classification head; it cannot score"):
        Engine(model=str(tmp_path / "e.gguf"), device="cpu", convert="classify")


def _metadata_only(path: Path, arch: str, **fields: object) -> Path:
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    for key, value in fields.items():
        if key == "tokenizer":
            writer.add_tokenizer_model(str(value))
        elif key == "pooling":
            writer.add_pooling_type(PoolingType(int(value)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "fields", "message"),
    [
        ("nomic-bert", {"tokenizer": "bert"}, r"unsupported GGUF architecture 'nomic-bert' \(an embedding model"),
        ("jina-bert-v2", {"tokenizer": "bert"}, r"unsupported GGUF architecture 'jina-bert-v2'"),
        ("bert", {"tokenizer": "t5"}, r"a GGUF 'bert' file with a 't5' tokenizer \(RoBERTa / XLM-RoBERTa"),
        ("bert", {"tokenizer": "bert", "pooling": 4}, r"bert.pooling_type=4, rank"),
        ("bert", {"tokenizer": "bert", "pooling": 0}, r"bert.pooling_type=0, none"),
    ],
)
def test_unserved_gguf_embedders_are_refused_by_name(tmp_path: Path, arch: str, fields: dict, message: str) -> None:
    """llama.cpp's other embedder architectures, RoBERTa-family 'bert' files and unserved pooling types raise a
    ModelLoadError that names them."""
    path = _metadata_only(tmp_path / f"{arch}.gguf", arch, **fields)
    with pytest.raises(ModelLoadError, match=message):
        Engine(model=str(path), device="cpu")
