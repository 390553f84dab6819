"""ModelRunner set-up: dtype/device resolution, KV cache sizing from the budget, limits, errors."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest
import torch

from engine.config import DEFAULT_CPU_KV_CACHE_MIN, EngineConfig
from engine.worker import model_runner
from engine.core.scheduler_output import SchedulerOutput
from engine.errors import ModelLoadError
from engine.layers.attention import Attention
from engine.worker.model_runner import ModelRunner, kv_cache_groups, resolve_dtypes

# tiny models: 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes per token in float32
BYTES_PER_TOKEN_F32 = 2 * 2 * 2 * 16 * 4


def test_auto_settings_and_exposed_attributes(tiny_model_factory, monkeypatch) -> None:
    """auto resolves to CPU float32; the default budget is 30% of the available memory; the runner exposes
    the model's limits."""
    monkeypatch.setattr(model_runner, "available_cpu_memory", lambda: 2 << 30)
    runner = ModelRunner(EngineConfig(max_num_seqs=1024), tiny_model_factory("llama"))
    assert runner.device == torch.device("cpu") and runner.dtype == runner.weight_dtype == torch.float32
    assert runner.block_size == 16
    assert runner.num_blocks == int(0.3 * (2 << 30)) // (16 * BYTES_PER_TOKEN_F32)
    assert runner.kv_cache.shape == (2, 2, runner.num_blocks, 16, 2, 16)
    assert runner.max_model_len == 2048 and runner.vocab_size == runner.hf_config.vocab_size


def test_default_budget_floor_cap_and_lazy_commit(tiny_model_factory, monkeypatch) -> None:
    """Little memory available still gives the 256 MiB floor; plenty gives no more blocks than max_num_seqs
    sequences of max_model_len fill; a large cache costs resident memory only as its blocks are written."""
    monkeypatch.setattr(model_runner, "available_cpu_memory", lambda: 1 << 20)
    path = tiny_model_factory("llama")
    assert ModelRunner(EngineConfig(max_num_seqs=1024), path).num_blocks == DEFAULT_CPU_KV_CACHE_MIN // (16 * BYTES_PER_TOKEN_F32)
    monkeypatch.setattr(model_runner, "available_cpu_memory", lambda: 1 << 40)
    assert ModelRunner(EngineConfig(max_num_seqs=4, max_model_len=100), path).num_blocks == 4 * 7

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident()
    runner = ModelRunner(EngineConfig(kv_cache_memory=4 << 30), path)
    assert runner.kv_cache.numel() * 4 >= (4 << 30) - 16 * BYTES_PER_TOKEN_F32
    assert resident() - before < 256 << 20
    runner.kv_cache[:, :, :2].fill_(1.0)  # the first blocks written: committed, the rest still zero
    assert runner.kv_cache[:, :, 2:4].abs().sum() == 0


def _resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """Pages of the memory at ``address`` the OS backs now (mincore), and all its pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    first = address // page * page
    length = address + nbytes - first
    vec = (ctypes.c_ubyte * -(-length // page))()
    assert libc.mincore(first, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), len(vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's residency, as Linux reports it")
@pytest.mark.parametrize("platform", ["linux", "darwin"])  # madvise, and the writes elsewhere
def test_commit_pages_backs_every_page_and_keeps_zeros(platform: str, monkeypatch) -> None:
    """commit_pages has the OS back every page of fresh anonymous memory (none backed before), the bytes still zero,
    with the buffer starting mid-page."""
    region = mmap.mmap(-1, 8 << 20)
    buffer = np.frombuffer(region, dtype=np.uint8)[100:]
    assert _resident_pages(buffer.ctypes.data, buffer.nbytes)[0] == 0
    monkeypatch.setattr(model_runner.sys, "platform", platform)
    model_runner.commit_pages(buffer, threads=2)
    resident, pages = _resident_pages(buffer.ctypes.data, buffer.nbytes)
    assert resident == pages and not buffer.any()
    del buffer
    region.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's residency, as Linux reports it")
def test_kv_cache_prefault_commits_the_cache(tiny_model_factory) -> None:
    """With kv_cache_prefault the runner's whole cache is backed at start-up and still zero."""
    runner = ModelRunner(EngineConfig(kv_cache_memory=16 << 20, kv_cache_prefault=True), tiny_model_factory("llama"))
    cache = runner.kv_cache
    resident, pages = _resident_pages(cache.data_ptr(), cache.numel() * cache.element_size())
    assert resident == pages and not cache.any()


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_of_a_gguf_file(
    native, tiny_model_factory, small_tokenizer_dir, private_cache, tmp_path, monkeypatch
) -> None:
    """Under auto, a GGUF of quantized blocks keeps its other weights and its KV cache in bfloat16 where the CPU
    multiplies bfloat16 natively, else float32; a GGUF of float32 tensors stays float32, as a float32 checkpoint."""
    from engine.loader import resolve_model
    from engine.model_files.gguf_writer import write_gguf

    monkeypatch.setattr(model_runner, "native_bf16", lambda: native)
    source = tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir)
    quantized = ModelRunner(EngineConfig(num_blocks=8), resolve_model(write_gguf(source, tmp_path / "q8.gguf", "Q8_0")))
    assert quantized.weight_dtype == quantized.kv_cache_dtype == (torch.bfloat16 if native else torch.float32)
    assert "Q8_0" in quantized.weights.modules
    floats = ModelRunner(EngineConfig(num_blocks=8), resolve_model(write_gguf(source, tmp_path / "f32.gguf", "F32")))
    assert floats.dtype == floats.weight_dtype == floats.kv_cache_dtype == torch.float32


def test_kv_cache_budget_and_dtype(tiny_model_factory) -> None:
    """kv_cache_memory sizes the cache by whole blocks of its dtype, bfloat16 whether the CPU computes in it or
    widens it (the C backend's cache); num_blocks is taken as given."""
    path = tiny_model_factory("qwen3")
    runner = ModelRunner(EngineConfig(dtype="bfloat16", block_size=8, kv_cache_memory=100_000), path)
    assert (runner.dtype, runner.weight_dtype) == resolve_dtypes("bfloat16", torch.device("cpu"))
    assert runner.kv_cache.dtype == runner.kv_cache_dtype == torch.bfloat16
    assert runner.num_blocks == 100_000 // (8 * BYTES_PER_TOKEN_F32 // 2)
    # the PyTorch backend reads its cache in the compute dtype
    torch_backend = ModelRunner(EngineConfig(dtype="bfloat16", attention_backend="torch", num_blocks=8), path)
    assert torch_backend.kv_cache.dtype == torch_backend.dtype
    assert ModelRunner(EngineConfig(num_blocks=7, max_model_len=100), path).num_blocks == 7


def test_limits_and_errors(tiny_model_factory, tmp_path) -> None:
    """A too-small budget, a max_model_len past the model's positions and an unknown architecture are refused."""
    path = tiny_model_factory("mistral")
    with pytest.raises(ValueError, match="no block"):
        ModelRunner(EngineConfig(kv_cache_memory=100), path)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(EngineConfig(max_model_len=4096), path)
    windowed = tiny_model_factory("mistral", sliding_window=256)
    assert ModelRunner(EngineConfig(num_blocks=4), windowed).max_model_len == 2048  # its layers apply the window
    config = (path / "config.json").read_text().replace('"mistral"', '"gpt2"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="gpt2"):
        ModelRunner(EngineConfig(num_blocks=4), tmp_path)


def test_empty_step_returns_no_logits(tiny_model_factory) -> None:
    """A step with nothing scheduled returns an empty float32 [0, vocab] tensor."""
    runner = ModelRunner(EngineConfig(num_blocks=4), tiny_model_factory("llama"))
    logits = runner.execute_model(SchedulerOutput())
    assert logits.shape == (0, runner.vocab_size) and logits.dtype == torch.float32


@pytest.mark.parametrize(
    ("windows", "groups"),
    [
        ([8, 8, 8], [[8, 8, 8]]),  # one window: one group
        ([None, 8, None, 8], [[None, None], [8, 8]]),  # full attention first, layers in model order
        ([8, 8, 8, 8, 8, None], [[None]] + [[8]] * 5),  # Gemma 3's 5:1: groups of the smallest count
        ([None] * 4 + [8] * 5, [[None] * 4, [8] * 4, [8]]),  # 5 is not under 1.25 x 4: groups of 4, one short
        ([None] * 8 + [8] * 9, [[None] * 8, [8] * 9]),  # 9 < 1.25 x 8: groups of the largest count
    ],
)
def test_kv_cache_groups_split_windows_into_equal_groups(windows: list[int | None], groups: list) -> None:
    layers = [Attention(4, 2, 16, 1.0, sliding_window=w) for w in windows]
    split = kv_cache_groups(layers)
    assert [[attn.sliding_window for attn in group] for group in split] == groups
    assert sorted(layers.index(attn) for group in split for attn in group) == list(range(len(layers)))
