"""TritonAttentionBackend: store then attend, against the float64 reference and the PyTorch backend."""

from __future__ import annotations

import pytest
import torch
from paged_cases import TOL, PagedBatch, make_batch, reference_attention, stored_cache

from engine.attention import AttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend


# (seq_len, query_len) per sequence; shared-prefix cases need >= 16 cached tokens everywhere
DECODE = [(37, 1), (100, 1), (17, 1)]
MIXED = [(33, 1), (80, 48), (64, 30), (21, 2)]
PREFILL = [(45, 45), (17, 17)]


def _torch_backend() -> AttentionBackend:
    try:
        from engine.attention import TorchAttentionBackend
    except ImportError:
        pytest.skip("TorchAttentionBackend is not available")
    return TorchAttentionBackend()


def _run(backend: AttentionBackend, b: PagedBatch) -> torch.Tensor:
    return backend.forward(b.q, b.k, b.v, b.kv_cache, b.meta, b.scale)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize(
    ("seqs", "num_shared_blocks", "num_splits"),
    [(DECODE, 1, None), (DECODE, 1, 2), (MIXED, 1, None), (PREFILL, 0, None)],
)
def test_forward_stores_then_attends(
    seqs: list[tuple[int, int]], num_shared_blocks: int, num_splits: int | None
) -> None:
    """One forward writes the new K/V exactly and returns the reference attention."""
    b = make_batch(seqs, num_shared_blocks=num_shared_blocks)
    expected_cache = stored_cache(b)
    out = _run(TritonAttentionBackend(decode_num_splits=num_splits), b)
    assert _same(b.kv_cache, expected_cache)
    torch.testing.assert_close(out.double(), reference_attention(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("seqs", "num_shared_blocks"), [(DECODE, 1), (MIXED, 1), (PREFILL, 0)])
def test_matches_torch_backend(seqs: list[tuple[int, int]], num_shared_blocks: int) -> None:
    """Both backends leave the same cache and agree on the outputs, decode, prefill and mixed."""
    torch_backend = _torch_backend()
    a = make_batch(seqs, num_shared_blocks=num_shared_blocks, poison=False)
    b = make_batch(seqs, num_shared_blocks=num_shared_blocks, poison=False)
    out_torch = _run(torch_backend, a)
    out_triton = _run(TritonAttentionBackend(decode_num_splits=2), b)
    assert torch.equal(a.kv_cache, b.kv_cache)
    torch.testing.assert_close(out_triton, out_torch, atol=1e-4, rtol=1e-4)


def test_rejects_unpaired_cache() -> None:
    """A cache without the leading K/V axis of 2 is refused with the expected layout in the message."""
    b = make_batch(DECODE)
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, num_blocks"):
        TritonAttentionBackend().forward(b.q, b.k, b.v, b.kv_cache[0], b.meta, b.scale)


GPU_CASES = [
    [(4096, 1), (1500, 1), (77, 1), (2049, 1)],  # decode, long enough to split
    [(1000, 1), (1300, 512), (700, 700), (257, 1), (3000, 129)],  # mixed, cached prefixes
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqs", GPU_CASES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64)])
def test_gpu_matches_reference(
    dtype: torch.dtype, seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """On CUDA at model-sized shapes, every dtype matches the float64 reference and stores exactly."""
    b = make_batch(
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        num_shared_blocks=4,
    )
    expected_cache = stored_cache(b)
    out = _run(TritonAttentionBackend(), b)
    assert _same(b.kv_cache, expected_cache)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), reference_attention(b), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqs", GPU_CASES)
def test_gpu_matches_torch_backend(dtype: torch.dtype, seqs: list[tuple[int, int]]) -> None:
    """On CUDA the Triton and PyTorch backends agree within half-precision tolerance."""
    torch_backend = _torch_backend()
    kwargs = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda", poison=False)
    a, b = make_batch(seqs, **kwargs), make_batch(seqs, **kwargs)
    out_torch = _run(torch_backend, a)
    out_triton = _run(TritonAttentionBackend(), b)
    assert torch.equal(a.kv_cache, b.kv_cache)
    torch.testing.assert_close(out_triton, out_torch, atol=TOL[dtype], rtol=TOL[dtype])
