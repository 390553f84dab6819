"""Linear layers: packed for the C kernel or plain F.linear, bfloat16 weights widened for float32 input,
the embedding that a tied LM head shares, fused shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.layers.linear import Linear, MergedLinear, VocabEmbedding

needs_kernels = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")


def _layer(bias: bool, weight_dtype: torch.dtype, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(48, 80, bias=bias)
    torch.nn.init.normal_(layer.weight, generator=gen)
    if bias:
        torch.nn.init.normal_(layer.bias, generator=gen)
    layer.weight.data = layer.weight.data.to(weight_dtype)
    return layer


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_packed_matches_f_linear(rows: int, bias: bool, weight_dtype: torch.dtype) -> None:
    """Packed, the layer gives F.linear of its (widened) weight for a contiguous and a strided input (rounded to
    bfloat16 where this CPU multiplies bfloat16), and holds the weight only in its panels."""
    layer = _layer(bias, weight_dtype, rows)
    weight = layer.weight.detach().float()
    layer.pack()
    assert layer.weight is None and layer.packed.dtype == weight_dtype
    assert "weight" not in dict(layer.named_parameters()) and "packed" in dict(layer.named_buffers())
    rounds = weight_dtype == torch.bfloat16 and cpu_kernels.bf16_linear_path(rows) != "widened"
    for x in (torch.randn(rows, 48), torch.randn(48, rows).t()):
        y = layer(x)
        assert y.shape == (rows, 80) and y.dtype == torch.float32
        x_used = x.bfloat16().float() if rounds else x
        torch.testing.assert_close(y, F.linear(x_used, weight, layer.bias), atol=1e-4, rtol=1e-5)


def test_unpacked_is_f_linear() -> None:
    """Unpacked (GPU, no CPU kernels, bfloat16 compute), the layer is exactly F.linear."""
    layer = _layer(True, torch.bfloat16, 0)
    layer.bias.data = layer.bias.data.bfloat16()
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_kernels)])
def test_embedding_rows_and_tied_head(pack: bool) -> None:
    """The embedding looks up its rows in either layout, and as a tied head computes hidden x table^T."""
    embedding = VocabEmbedding(50, 8)
    torch.nn.init.normal_(embedding.weight)
    table = embedding.weight.detach().clone()
    if pack:
        embedding.pack()
    ids = torch.tensor([0, 49, 17, 17])
    assert torch.equal(embedding(ids), table[ids])
    hidden = torch.randn(3, 8)
    torch.testing.assert_close(Linear.forward(embedding, hidden), hidden @ table.T, atol=1e-5, rtol=1e-5)


def test_merged_shards_split_and_load() -> None:
    """Each checkpoint shard lands in its rows; split returns the shards' outputs."""
    layer = MergedLinear(4, {"q": 3, "k": 2})
    wq, wk = torch.randn(3, 4), torch.randn(2, 4)
    layer.weight_loader(layer.weight, wq, "q")
    layer.weight_loader(layer.weight, wk, "k")
    x = torch.randn(5, 4)
    q, k = layer.split(layer(x))
    torch.testing.assert_close(q, x @ wq.T)
    torch.testing.assert_close(k, x @ wk.T)
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.weight, torch.randn(3, 5), "q")
