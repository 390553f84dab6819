"""GGUF files written from Hugging Face directories: transformers loads them back to the source model's logits
(exactly for F32, within the quantization error otherwise), with llama.cpp's names, metadata and tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader

from engine.model_files.gguf_file_types import tensor_types
from engine.model_files.gguf_quants import row_bytes
from engine.model_files.gguf_writer import HParams, llama3_rope_factors, permute_rows, write_gguf

# Tiny models wide enough (rows of 256) for the K-quants; qwen3 at head_dim 128, the only one transformers
# reads from a qwen3 GGUF (its GGUF config mapping has no head_dim).
WIDE = dict(hidden_size=256, intermediate_size=512)
ARCH_OVERRIDES = {"llama": WIDE, "mistral": WIDE, "qwen2": WIDE, "qwen3": {**WIDE, "head_dim": 128}, "smollm2": WIDE}
PROMPTS = torch.tensor([[1, 17, 300, 301, 900, 42, 7, 1000], [2, 250, 251, 252, 253, 600, 601, 602]])
# max |logit - source logit| / max |source logit| of a GGUF read back by transformers, per file type: about 1.4x
# what these two-layer models measure (Q8_0 0.013, Q6_K 0.043, Q5_K_M 0.095, Q4_K_M 0.17, Q4_0 0.18, BF16 0.0044,
# F16 0.0005), about 2.5x each weight type's relative RMS error.
LOGIT_BOUND = {"Q8_0": 0.02, "Q6_K": 0.06, "Q5_K_M": 0.13, "Q4_K_M": 0.24, "Q4_0": 0.25, "BF16": 0.007, "F16": 0.001}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, small_tokenizer_dir: Path):
    return lambda arch: tiny_model_factory(arch, tokenizer_dir=small_tokenizer_dir, **ARCH_OVERRIDES[arch])


def _logits(model_dir: Path, gguf_file: str | None = None) -> torch.Tensor:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(PROMPTS).logits


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "smollm2"])
def test_f32_file_gives_the_source_logits_exactly(model_dir, arch: str, tmp_path: Path) -> None:
    """F32: every weight, bias and norm lands where transformers reads it (q/k rows permuted and back)."""
    source = model_dir(arch)
    write_gguf(source, source / "model-F32.gguf", "F32")
    try:
        assert torch.equal(_logits(source, "model-F32.gguf"), _logits(source))
    finally:
        (source / "model-F32.gguf").unlink()


@pytest.mark.parametrize("file_type", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "BF16", "F16"])
def test_quantized_file_gives_logits_within_its_bound(model_dir, file_type: str) -> None:
    """A quantized file reads back to logits within the file type's bound of the source's, and not equal to them."""
    source = model_dir("llama")
    name = f"model-{file_type}.gguf"
    write_gguf(source, source / name, file_type)
    try:
        got, want = _logits(source, name), _logits(source)
    finally:
        (source / name).unlink()
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err <= LOGIT_BOUND[file_type]


def test_q4_k_m_file_holds_the_mix_names_and_metadata(model_dir, tmp_path: Path) -> None:
    """The file's tensors carry llama.cpp's names and the Q4_K_M mix; the hyperparameters, file type and
    tokenizer are llama.cpp's keys."""
    source = model_dir("qwen2")
    config = json.loads((source / "config.json").read_text())
    path = write_gguf(source, tmp_path / "m.gguf", "Q4_K_M")
    reader = GGUFReader(path)
    found = {t.name: (t.tensor_type.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    expected_names = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}" for i in range(2)
        for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias", "attn_k.bias",
                  "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                  "ffn_down.weight")
    }  # fmt: skip
    assert set(found) == expected_names
    assert found["blk.0.attn_q.bias"] == ("F32", (256,)) and found["blk.1.ffn_down.weight"][1] == (256, 512)
    assert {n: t for n, (t, _) in found.items()} == tensor_types([(n, s) for n, (_, s) in found.items()], "Q4_K_M", 2)
    assert found["output.weight"][0] == "Q6_K" and found["blk.0.attn_q.weight"][0] == "Q4_K"
    assert _field(reader, "general.architecture") == "qwen2" and _field(reader, "general.file_type") == 15
    for key, value in {
        "block_count": 2, "embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 4,
        "attention.head_count_kv": 2, "context_length": config["max_position_embeddings"], "vocab_size": 1024,
    }.items():  # fmt: skip
        assert _field(reader, f"qwen2.{key}") == value
    assert _field(reader, "qwen2.rope.freq_base") == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert _field(reader, "qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and len(_field(reader, "tokenizer.ggml.tokens")) == 1024
    assert _field(reader, "tokenizer.ggml.tokens")[1] == "<|im_start|>" and _field(reader, "tokenizer.ggml.token_type")[1] == 3
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2 and _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.ggml.merges")[0] == "Ġ t"
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")


@pytest.mark.parametrize("arch", ["qwen3_moe", "phi3"])
def test_transformers_reads_qwen3moe_and_phi3_files_back_to_the_source_logits(
    arch: str, tiny_model_factory, small_tokenizer_dir: Path
) -> None:
    """transformers' own GGUF reader splits the 3-D ``ffn_*_exps`` tensors back into the source's experts, and reads
    Phi-3's fused ``attn_qkv`` and ``ffn_up`` (given the config: its GGUF mapping has neither the experts' width nor
    LongRoPE): an F32 file's logits are the source's exactly."""
    overrides = dict(mlp_only_layers=None, norm_topk_prob=True) if arch == "qwen3_moe" else {}
    source = tiny_model_factory(arch, tokenizer_dir=small_tokenizer_dir, **overrides)
    write_gguf(source, source / "model-F32.gguf", "F32")
    try:
        config = transformers.AutoConfig.from_pretrained(source)
        model = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file="model-F32.gguf", config=config,
                                                                  dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            assert torch.equal(model(PROMPTS).logits, _logits(source))
    finally:
        (source / "model-F32.gguf").unlink()


def test_qwen3_head_dim_is_recorded_where_it_differs(model_dir, tmp_path: Path) -> None:
    """qwen3 at head_dim 128 over a width of 256 with 4 heads: key/value lengths recorded, q/k norms written."""
    reader = GGUFReader(write_gguf(model_dir("qwen3"), tmp_path / "q.gguf", "Q8_0"))
    assert _field(reader, "qwen3.attention.key_length") == _field(reader, "qwen3.attention.value_length") == 128
    names = {t.name: t.tensor_type.name for t in reader.tensors}
    assert names["blk.0.attn_q_norm.weight"] == names["blk.1.attn_k_norm.weight"] == "F32"


def test_llama3_rope_scaling_becomes_rope_freqs(tiny_model_factory, small_tokenizer_dir: Path, tmp_path: Path) -> None:
    """llama3 rope scaling is a rope_freqs tensor: each frequency divided by it is transformers' llama3 frequency."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    source = tiny_model_factory("llama3", tokenizer_dir=small_tokenizer_dir, **WIDE)
    reader = GGUFReader(write_gguf(source, tmp_path / "l3.gguf", "Q8_0"))
    (rope,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    config = transformers.AutoConfig.from_pretrained(source)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    hp = HParams.from_config(json.loads((source / "config.json").read_text()))
    base = 1.0 / hp.rope_theta ** (np.arange(0, hp.head_dim, 2) / hp.head_dim)
    assert np.allclose(base / np.asarray(rope.data), hf_inv_freq.numpy(), rtol=1e-5)
    assert np.array_equal(np.asarray(rope.data), llama3_rope_factors(hp)) and len(set(rope.data.tolist())) > 2


def test_permutation_is_what_transformers_undoes() -> None:
    """permute_rows is the inverse of transformers' GGUF reverse permutation, for q (heads) and k (kv heads)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    undo = LlamaTensorProcessor()._reverse_permute_weights
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (8, 2):
        assert np.array_equal(undo(permute_rows(w, heads), heads, heads), w)
    assert not np.array_equal(permute_rows(w, 8), w)


def test_tokenizer_reads_back_in_transformers(tiny_model_factory, bundled_model_dir: Path, tmp_path: Path) -> None:
    """The bundled tokenizer written into a GGUF reads back (AutoTokenizer, gguf_file=) to the same ids and chat
    template rendering."""
    source = tiny_model_factory("smollm2")
    write_gguf(source, tmp_path / "tok.gguf", "Q8_0")
    want = transformers.AutoTokenizer.from_pretrained(source)
    got = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What's 12 + 30? Ünïcödé!"}]
    for text in ("Hello world, it's 2024.", "  spaces\tand\nnewlines  ", "naïve café 日本語"):
        assert got.encode(text) == want.encode(text)
    assert got.apply_chat_template(messages, tokenize=False) == want.apply_chat_template(messages, tokenize=False)
    assert len(got) == len(want) and got.eos_token_id == want.eos_token_id


def test_unsupported_checkpoints_are_refused_and_leave_no_file(model_dir, tmp_path: Path) -> None:
    """Another architecture, or a tensor with no GGUF name, is an error naming it; no partial file stays."""
    source = model_dir("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in source.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' cannot be written"):
        write_gguf(bad, tmp_path / "x.gguf", "Q8_0")
    with pytest.raises(ValueError, match="file type must be one of"):
        write_gguf(source, tmp_path / "x.gguf", "Q3_K")
    assert not list(tmp_path.glob("x.gguf*"))


def test_file_is_its_metadata_then_each_tensors_blocks(model_dir, tmp_path: Path) -> None:
    """Each tensor takes exactly its rows' blocks, aligned to 32 bytes after the metadata: nothing else is in the file."""
    source = model_dir("smollm2")
    path = write_gguf(source, tmp_path / "s.gguf", "Q4_K_M")
    reader = GGUFReader(path)
    for t in reader.tensors:
        dims = [int(n) for n in reversed(t.shape)]
        rows = dims[0] if len(dims) == 2 else 1
        assert int(t.n_bytes) == rows * row_bytes(t.tensor_type.name, dims[-1])
    assert path.stat().st_size == reader.data_offset + sum(math.ceil(int(t.n_bytes) / 32) * 32 for t in reader.tensors)
