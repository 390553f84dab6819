"""The PyTorch and CPU-kernel paged attention backends against a float64 dense reference, over ragged batches."""

from __future__ import annotations

import random

import pytest
import torch

from engine import cpu_kernels
from engine.attention import CpuAttentionBackend, TorchAttentionBackend, get_attention_backend
from engine.core.scheduler_output import ScheduledRequest
from engine.layers.attention import Attention
from engine.worker.input_batch import prepare_inputs

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM = 4, 64, 8


def _case(query_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int, dtype, seed: int):
    """Random contexts in shuffled blocks; the cached part is already in the cache, the rest is new."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen, dtype=dtype)
    flat = kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)
    scheduled, full_k, full_v = [], [], []
    for i, (q_len, ctx) in enumerate(zip(query_lens, ctx_lens)):
        blocks = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        k = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen, dtype=dtype)
        v = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen, dtype=dtype)
        cached = ctx - q_len
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached)]
        flat[0, slots], flat[1, slots] = k[:cached], v[:cached]
        scheduled.append(ScheduledRequest(str(i), [0] * q_len, cached, (blocks,), True))
        full_k.append(k)
        full_v.append(v)
    inputs = prepare_inputs(scheduled, BLOCK_SIZE, torch.device("cpu"))
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=gen, dtype=dtype)
    new_k = torch.cat([k[c - n :] for k, n, c in zip(full_k, query_lens, ctx_lens)])
    new_v = torch.cat([v[c - n :] for v, n, c in zip(full_v, query_lens, ctx_lens)])
    return q, new_k, new_v, kv_cache, inputs.attn_metadata[0], full_k, full_v


def _reference(q, full_k, full_v, query_lens, ctx_lens, scale, window=None, softcap=None) -> torch.Tensor:
    outs, start = [], 0
    group = q.shape[1] // full_k[0].shape[1]
    for k, v, n, ctx in zip(full_k, full_v, query_lens, ctx_lens):
        qs = q[start : start + n].double().transpose(0, 1)  # [H, n, D]
        ks = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
        vs = v.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - (window or ctx))
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


CASES = {
    "decode_only": ([1, 1, 1, 1], [1, 9, 16, 30]),
    "prefill_only": ([7, 1 + 12, 3], [7, 13, 3]),
    "prefix_prefill": ([5, 2], [21, 6]),
    "mixed": ([1, 6, 1, 4, 1], [17, 6, 4, 12, 33]),
}


needs_cpu_kernel = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no C compiler for the CPU kernel"
)
BACKENDS = {  # backend name -> factory of (query heads, KV heads)
    "torch": lambda num_heads, num_kv_heads: TorchAttentionBackend(),
    "cpu": lambda num_heads, num_kv_heads: CpuAttentionBackend(num_heads // num_kv_heads),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(
    "backend, dtype, atol",
    [
        ("torch", torch.float32, 1e-5),
        ("torch", torch.bfloat16, 2e-2),
        pytest.param("cpu", torch.float32, 1e-5, marks=needs_cpu_kernel),
    ],
)
def test_matches_dense_reference(case: str, heads: tuple[int, int], backend: str, dtype, atol: float) -> None:
    """Outputs equal causal GQA attention over each sequence's full context; new K/V land at their slots."""
    query_lens, ctx_lens = CASES[case]
    q, k, v, kv_cache, meta, full_k, full_v = _case(query_lens, ctx_lens, *heads, dtype, seed=len(case))
    scale = HEAD_DIM**-0.5
    out = BACKENDS[backend](*heads).forward(q, k, v, kv_cache, meta, scale)
    expected = _reference(q, full_k, full_v, query_lens, ctx_lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    torch.testing.assert_close(flat[0, meta.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v, atol=0, rtol=0)


WINDOW_CASES = {  # window W -> (query lens, context lens): prefills longer than W, decodes past it and within it
    1: ([1, 5, 1], [9, 5, 1]),
    5: ([1, 1, 8, 3, 1], [3, 23, 8, 17, 30]),
    8: ([12, 1, 1, 6], [12, 40, 8, 14]),
}


@pytest.mark.parametrize("window", sorted(WINDOW_CASES))
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("name", ["torch", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_sliding_window_and_softcap_match_reference(name: str, heads, softcap, window: int) -> None:
    """A query at position p sees only keys p - W + 1 .. p, scores soft-capped; blocks wholly before each
    sequence's first window are never read (poisoned with NaN here), so they may go back to the pool."""
    query_lens, ctx_lens = WINDOW_CASES[window]
    q, k, v, kv_cache, meta, full_k, full_v = _case(query_lens, ctx_lens, *heads, torch.float32, seed=window)
    for table, n, ctx in zip(meta.block_tables, query_lens, ctx_lens):
        for b in range(max(0, ctx - n - window + 1) // BLOCK_SIZE):
            kv_cache[:, table[b]] = float("nan")
    scale = 0.7  # large enough that the soft cap bends the scores
    backend = BACKENDS[name](*heads)
    for _ in range(2):  # two layers of the step: the plan is reused
        out = backend.forward(
            q, k, v, kv_cache, meta, scale, sliding_window=window, logit_softcap=softcap
        )
        expected = _reference(q, full_k, full_v, query_lens, ctx_lens, scale, window, softcap)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@needs_cpu_kernel
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_cpu_kernel_windows_and_caps_over_a_bfloat16_cache(softcap) -> None:
    """The C kernel's bfloat16 cache path: the same window and soft cap over keys rounded as they are stored."""
    query_lens, ctx_lens = WINDOW_CASES[5]
    q, k, v, kv_cache, meta, full_k, full_v = _case(query_lens, ctx_lens, 6, 2, torch.float32, seed=5)
    rounded_k = [t.bfloat16().float() for t in full_k]
    rounded_v = [t.bfloat16().float() for t in full_v]
    out = CpuAttentionBackend(3).forward(
        q, k, v, kv_cache.bfloat16(), meta, 0.7, sliding_window=5, logit_softcap=softcap
    )
    expected = _reference(q, rounded_k, rounded_v, query_lens, ctx_lens, 0.7, 5, softcap)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_windowed_and_full_layers_share_a_backend() -> None:
    """Layers of one step with and without a window, through one backend, each get their own masks."""
    query_lens, ctx_lens = WINDOW_CASES[5]
    q, k, v, kv_cache, meta, full_k, full_v = _case(query_lens, ctx_lens, 4, 2, torch.float32, seed=3)
    backend = TorchAttentionBackend()
    for window in (None, 5, None, 7):
        expected = _reference(q, full_k, full_v, query_lens, ctx_lens, 0.5, window)
        out = backend.forward(q, k, v, kv_cache, meta, 0.5, sliding_window=window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["torch", pytest.param("cpu", marks=needs_cpu_kernel)])
def test_backend_reused_across_steps_and_layers(name: str) -> None:
    """One backend instance serves layers of different steps: the per-step plan never goes stale."""
    backend = BACKENDS[name](4, 2)
    for seed, (query_lens, ctx_lens) in enumerate([CASES["mixed"], CASES["decode_only"], CASES["mixed"]]):
        q, k, v, kv_cache, meta, full_k, full_v = _case(query_lens, ctx_lens, 4, 2, torch.float32, seed)
        expected = _reference(q, full_k, full_v, query_lens, ctx_lens, 0.5)
        for _ in range(2):  # two "layers" of the same step
            torch.testing.assert_close(backend.forward(q, k, v, kv_cache, meta, 0.5).double(), expected, atol=1e-5, rtol=0)


def test_get_attention_backend_choices() -> None:
    """auto picks the C kernel on CPU in float32 (plain PyTorch otherwise); misfits are named errors."""
    cpu = torch.device("cpu")

    def get(name: str, dtype=torch.float32, heads=(9, 3, 64), block_size: int = 16):
        num_heads, num_kv_heads, head_dim = heads
        return get_attention_backend(name, cpu, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, block_size=block_size)

    expected_auto = TorchAttentionBackend if cpu_kernels.library() is None else CpuAttentionBackend
    assert type(get("auto")) is expected_auto
    assert type(get("auto", torch.bfloat16)) is TorchAttentionBackend
    odd_head_dim = (4, 4, 20)  # not a multiple of 8
    assert type(get("auto", heads=odd_head_dim)) is TorchAttentionBackend
    assert type(get("torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="float32.*got torch.bfloat16"):
        get("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="block_size 512"):
        get("cpu", block_size=512)
    with pytest.raises(ValueError, match="CUDA"):
        get("triton")
    with pytest.raises(ValueError, match="backend"):
        get("flash")


@pytest.mark.parametrize(
    "kwargs, match", [({"sliding_window": 0}, "sliding_window must be >= 1"), ({"logit_softcap": 0.0}, "logit_softcap")]
)
def test_attention_rejects_a_bad_window_or_soft_cap(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Attention(4, 2, 8, 1.0, **kwargs)
