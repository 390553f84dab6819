"""Real shapes and random-weight models of them: published sizes, loadable directories, seeded weights, GGUF."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader
from tokenizers import Tokenizer

from engine.model_files import shapes
from engine.model_files.gguf_writer import write_gguf
from engine.model_files.random_tokenizer import base_tokenizer_dir
from engine.model_files.safetensors_io import SafetensorsReader
from engine.model_files.shapes import SHAPES, ModelShape, get_shape, make_random_model
from integrations.cli import main

# Parameter counts of the published checkpoints (embeddings included, a tied head counted once).
PUBLISHED_PARAMETERS = {
    "SmolLM2-135M": 134_515_008, "SmolLM2-360M": 361_821_120, "SmolLM2-1.7B": 1_711_376_384,
    "Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824, "Llama-3-8B": 8_030_261_248,
    "Llama-3.1-8B": 8_030_261_248, "Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304,
    "Qwen2.5-7B": 7_615_616_512, "Qwen3-0.6B": 596_049_920, "Qwen3-1.7B": 1_720_574_976, "Qwen3-8B": 8_190_735_360,
}  # fmt: skip
BASE_VOCAB = 49152  # the bundled SmolLM2 tokenizer


def _tiny(model_type: str, vocab: int = BASE_VOCAB + 37, **extra) -> ModelShape:
    base = get_shape({"llama": "Llama-3.2-1B", "qwen2": "Qwen2.5-0.5B", "qwen3": "Qwen3-0.6B"}[model_type])
    config = {**base.config, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
              "tie_word_embeddings": False, **extra}  # fmt: skip
    return dataclasses.replace(base, name=f"tiny-{model_type}", config=config)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(_tiny("llama"), tmp_path_factory.mktemp("tiny-llama"), seed=3)


def _logits(model_dir: Path, ids: list[int], **kwargs) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_shapes_have_the_published_parameter_counts() -> None:
    """Every shape's tensors add up to its published checkpoint's parameter count."""
    assert {name: s.num_parameters for name, s in SHAPES.items()} == PUBLISHED_PARAMETERS


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_is_a_valid_transformers_config(name: str) -> None:
    """The kwargs build the architecture's transformers config with the published values (llama3 rope where due)."""
    shape = SHAPES[name]
    config_class = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[
        shape.model_type])  # fmt: skip
    config = config_class(**shape.config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert config.num_hidden_layers == shape.config["num_hidden_layers"] and head_dim == shape.head_dim
    rope = config.rope_parameters
    assert rope["rope_type"] == ("llama3" if name.startswith(("Llama-3.1", "Llama-3.2")) else "default")


def test_random_model_loads_with_sensible_logits(tiny_llama: Path) -> None:
    """transformers loads the directory (bfloat16 weights, config and tokenizer): finite logits whose softmax is
    neither one-hot nor flat, and every id the model can emit decodes."""
    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    assert config.dtype == torch.bfloat16 and config.rope_parameters["rope_type"] == "llama3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    assert len(tokenizer) == config.vocab_size == BASE_VOCAB + 37
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    logits = _logits(tiny_llama, ids)
    probs = logits[-1].softmax(-1)
    assert torch.isfinite(logits).all() and 1 < logits.std() < 6
    assert 0.005 < probs.max() < 0.9
    assert tokenizer.decode([BASE_VOCAB + 36]) == f"<|reserved_{BASE_VOCAB + 36}|>"
    assert tokenizer.tokenize("x 2024") == ["x", "Ġ", "2", "0", "2", "4"]  # SmolLM2's digit split, one by one
    assert tokenizer.encode("Hi there") == transformers.AutoTokenizer.from_pretrained(
        base_tokenizer_dir()).encode("Hi there")  # fmt: skip
    weights = SafetensorsReader(tiny_llama)
    assert {e.dtype for e in weights.entries.values()} == {"BF16"}
    assert set(weights.entries) == set(_tiny("llama").tensor_shapes())


def test_weights_are_seeded(tiny_llama: Path, tmp_path: Path) -> None:
    """The same seed writes the same bytes; another seed other weights; norms near 1, projections N(0, 1/fan_in)."""
    again = make_random_model(_tiny("llama"), tmp_path / "again", seed=3)
    other = make_random_model(_tiny("llama"), tmp_path / "other", seed=4)
    assert (again / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    a, b = SafetensorsReader(again), SafetensorsReader(other)
    assert not np.array_equal(a.read("model.layers.0.mlp.up_proj.weight"), b.read("model.layers.0.mlp.up_proj.weight"))
    norm = a.read("model.norm.weight")
    assert abs(float(norm.mean()) - 1) < 0.1 and norm.std() > 0.01
    down = a.read("model.layers.1.mlp.down_proj.weight")  # fan-in 128
    assert abs(float(down.std()) * 128**0.5 - 1) < 0.05


def test_shards_and_index_load_as_one_model(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a small shard limit the weights spread over several files with an index; the model is the same."""
    monkeypatch.setattr(shapes, "MAX_SHARD_BYTES", 1 << 20)
    sharded = make_random_model(_tiny("llama"), tmp_path / "sharded", seed=3)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert torch.equal(_logits(sharded, [1, 2, 3]), _logits(tiny_llama, [1, 2, 3]))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_shapes_load(model_type: str, tmp_path: Path) -> None:
    """qwen2 (q/k/v biases) and qwen3 (q/k norms) random models load in transformers with every weight used."""
    out = make_random_model(_tiny(model_type), tmp_path / model_type, dtype="float32")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.model_type == model_type
    # tokenizer.json splits text as transformers' tokenizer for the architecture does (Qwen2Tokenizer for qwen2)
    text = "Order 12345 shipped ,  twice!\n\nÉté"
    assert transformers.AutoTokenizer.from_pretrained(out).encode(text) == Tokenizer.from_file(
        str(out / "tokenizer.json")).encode(text).ids  # fmt: skip


def test_gguf_of_a_random_model_holds_its_weights(tmp_path: Path) -> None:
    """F32 GGUF of a bfloat16 random model (rope unscaled: transformers ignores GGUF's rope_freqs) reads back in
    transformers to the directory's exact logits."""
    source = make_random_model(_tiny("llama", rope_scaling=None), tmp_path / "plain")
    path = write_gguf(source, source / "plain-F32.gguf", "F32")
    assert torch.equal(_logits(source, [1, 5, 9], gguf_file=path.name), _logits(source, [1, 5, 9]))
    # SmolLM2's digit split, which llama.cpp (and its convert_hf_to_gguf.py) know as smollm
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "smollm"


def test_bad_requests_are_refused(tmp_path: Path) -> None:
    """An unknown shape or dtype, and a vocab below the tokenizer's, are errors naming the value."""
    with pytest.raises(ValueError, match="unknown shape 'Llama-9B'"):
        make_random_model("Llama-9B", tmp_path / "a")
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_random_model(_tiny("llama"), tmp_path / "b", dtype="int8")
    with pytest.raises(ValueError, match="vocab_size 1000 is below the base tokenizer's 49152"):
        make_random_model(_tiny("llama", vocab=1000), tmp_path / "c")


def test_cli_lists_shapes(capsys: pytest.CaptureFixture) -> None:
    """paged make-model --list prints every shape with its parameter count."""
    assert main(["make-model", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SHAPES) and "| SmolLM2-1.7B | llama | 1.71B | 24 | 2048 | 32 / 32 | 49152 |" in out


def test_cli_writes_the_directory_and_its_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--shape --out --gguf: the HF directory and a GGUF of the file type beside it."""
    monkeypatch.setitem(SHAPES, "tiny-qwen2", _tiny("qwen2"))
    out = tmp_path / "tq"
    assert main(["make-model", "--shape", "tiny-qwen2", "--out", str(out), "--gguf", "Q8_0", "--no-progress"]) == 0
    reader = GGUFReader(tmp_path / "tq-Q8_0.gguf")
    assert reader.fields["general.file_type"].contents() == 7 and reader.fields["general.architecture"].contents() == "qwen2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"  # llama.cpp splits text as transformers does
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_cli_without_shape_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    """--out alone: exit status 2 and a message naming the missing flags."""
    with pytest.raises(SystemExit) as exc:
        main(["make-model", "--out", "x"])
    assert exc.value.code == 2 and "--shape and --out are required" in capsys.readouterr().err
