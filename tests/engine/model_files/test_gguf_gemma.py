"""Gemma 2 and Gemma 3 GGUF files (written as llama.cpp's convert writes them: norm weights stored as 1 + w,
llama.cpp's layer names) run in the engine to the Hugging Face model's logits and greedy tokens; files of other
architectures and Gemma configs that a GGUF cannot carry are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from engine import Engine, SamplingParams
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.loader import resolve_model
from engine.model_files.gguf_writer import write_gguf
from engine.worker.model_runner import ModelRunner
from tests.support.gguf_runs import last_logits
from tests.support.hf_reference import hf_greedy, hf_logits

# The tiny configs of tiny_models.py, shaped as llama.cpp reads a Gemma file: the query scale head_dim's; Gemma 3
# in 6 layers, the 6th full (llama.cpp's pattern), its full layers' rope scaled linearly.
OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=16), "gemma3_text": dict(num_hidden_layers=6, layer_types=None)}
PROMPT = [5, 9, 77, 120, 3, 200, 31, 64, 500, 17, 2, 900, 13, 14, 15]  # past the window of 8


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def gemma(request, tiny_model_factory, small_tokenizer_dir: Path):
    from transformers import AutoModelForCausalLM

    source = tiny_model_factory(request.param, tokenizer_dir=small_tokenizer_dir, **OVERRIDES[request.param])
    return source, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def test_f32_file_runs_to_the_source_logits_and_greedy_tokens(gemma, private_cache: Path, tmp_path: Path) -> None:
    """The file's config is the source's where it matters (windows by layer, soft caps, query scale, rope per layer
    type); the engine's logits and greedy tokens from the file are transformers' of the source directory."""
    source, hf = gemma
    path = write_gguf(source, tmp_path / "gemma-F32.gguf", "F32")
    stored = {t.name: t for t in GGUFReader(path).tensors}
    for gguf_name, hf_name in (("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
                               ("output_norm.weight", "model.norm.weight")):  # fmt: skip
        expected = 1 + hf.state_dict()[hf_name].numpy()
        assert (stored[gguf_name].data == expected).all()  # llama.cpp's 1 + w
    runner = ModelRunner(EngineConfig(dtype="float32", num_blocks=64, block_size=4), resolve_model(path))
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "rope_parameters", "head_dim"):  # fmt: skip
        assert getattr(runner.hf_config, key) == getattr(hf.config, key), key
    torch.testing.assert_close(last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1], atol=1e-4, rtol=0)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = Engine(str(path), num_blocks=128, block_size=4)
    assert engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 10)


def test_q8_0_file_runs_in_its_blocks_near_the_source_logits(gemma, private_cache: Path, tmp_path: Path) -> None:
    """Q8_0: the linear layers run in the file's blocks (each input in int8 blocks too); the logits stay within
    their error of the source's."""
    source, hf = gemma
    path = write_gguf(source, tmp_path / "gemma-Q8_0.gguf", "Q8_0")
    runner = ModelRunner(EngineConfig(dtype="float32", num_blocks=64, block_size=4), resolve_model(path))
    assert "Q8_0" in runner.weights.modules
    got, want = last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1]
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err <= 0.06  # measured 0.023 (gemma2) and 0.041 (gemma3, 6 layers): weights and inputs in 8-bit blocks


def test_configs_llama_cpp_would_read_otherwise_are_not_written(tiny_model_factory, small_tokenizer_dir: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """A query scale or layer pattern llama.cpp infers differently would change the model: refused, naming it."""
    with pytest.raises(ValueError, match="query_pre_attn_scalar=24 .* by 16"):
        write_gguf(tiny_model_factory("gemma2", tokenizer_dir=small_tokenizer_dir), tmp_path / "a.gguf", "F32")
    with pytest.raises(ValueError, match="layer_types .* cannot be written"):
        write_gguf(tiny_model_factory("gemma3_text", tokenizer_dir=small_tokenizer_dir), tmp_path / "b.gguf", "F32")


def test_gguf_of_an_architecture_not_served_is_refused_by_name(tmp_path: Path, private_cache: Path) -> None:
    path = tmp_path / "qwen2moe.gguf"
    writer = GGUFWriter(str(path), "qwen2moe")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'qwen2moe'; supported in GGUF: .*phi3"):
        resolve_model(path)
