"""The attention kernels over an int8 KV cache (``attention_i8.c``): codes with a scale per block and KV head, written
as tokens come and read by decode rows and prefill tiles, against attention over the dequantized cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.attention.cpu_backend import plan_tiles

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernel")


class Int8Cache:
    """An int8 cache of ``num_blocks`` blocks, its scales, and each row's table over scattered blocks."""

    def __init__(self, lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads = heads
        self.head_dim, self.block_size = head_dim, block_size
        per_row = [-(-n // block_size) for n in lens]
        num_blocks = sum(per_row) + 2
        self.k = torch.zeros(num_blocks, block_size, self.num_kv_heads, head_dim, dtype=torch.int8)
        self.v = torch.zeros_like(self.k)
        self.scales = (torch.zeros(num_blocks, self.num_kv_heads), torch.zeros(num_blocks, self.num_kv_heads))
        pool = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.tables = torch.full((len(lens), max(per_row)), -1, dtype=torch.int32)
        for i, n in enumerate(per_row):
            self.tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int64)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return self.tables[row, pos // self.block_size].long() * self.block_size + pos % self.block_size

    def fill(self, chunk: int, growth: float = 15.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Writes every row's keys and values ``chunk`` tokens a call, the keys' magnitudes growing ``growth``-fold
        along the row (so that scales grow within blocks); returns each row's float32 keys and values."""
        written = []
        for i, n in enumerate(self.lens.tolist()):
            magnitude = torch.linspace(3.0 / growth, 3.0, n)[:, None, None]
            k = torch.randn(n, self.num_kv_heads, self.head_dim, generator=self.gen) * magnitude
            v = torch.randn(n, self.num_kv_heads, self.head_dim, generator=self.gen)
            for a in range(0, n, chunk):
                cpu_kernels.store_kv(k[a : a + chunk], v[a : a + chunk], self.k, self.v,
                                     self.slots(i, a, min(a + chunk, n)), self.scales)  # fmt: skip
            written.append((k, v))
        return written

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(c.float() * s[:, None, :, None] for c, s in zip((self.k, self.v), self.scales, strict=True))


@pytest.mark.parametrize(
    "chunk, growth, steps",
    [
        (16, 15.0, 0.5),  # each block written in one call, as a prompt's are: each code rounded once
        (37, 15.0, 1.0),  # calls across blocks: a block's first codes rounded again as its scale grows, once
        (1, 1.0, 2.0),  # one token a call, as decode writes: a rounding more for each growth of the scale
    ],
)
def test_codes_and_scales_hold_each_block_head(chunk: int, growth: float, steps: float) -> None:
    """Each block's scale for a head is its tokens' largest |element| / 127, and every element dequantizes to within
    ``steps`` of that scale."""
    cache = Int8Cache([300, 45], (4, 2), 32, 16, seed=0)
    written = cache.fill(chunk, growth)
    k_deq, v_deq = cache.dequantized()
    for i, (k, v) in enumerate(written):
        slots = cache.slots(i, 0, len(k))
        blocks = slots // cache.block_size
        for x, deq, scales in ((k, k_deq, cache.scales[0]), (v, v_deq, cache.scales[1])):
            for b in blocks.unique().tolist():
                top = x[blocks == b].abs().amax(dim=(0, 2))
                assert torch.equal(scales[b], top / 127)
            step = scales[blocks][:, :, None]
            assert ((deq.view(-1, *deq.shape[2:])[slots] - x).abs() <= step * steps * 1.0001).all()


@pytest.mark.parametrize("split", cpu_kernels.ATTENTION_SPLIT)
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [((9, 3), 64, 16), ((16, 1), 128, 32), ((4, 4), 40, 8)],  # GQA; a group of 16; 8-lane rows
)
def test_decode_rows_equal_attention_over_the_dequantized_cache(
    split: str, heads: tuple[int, int], head_dim: int, block_size: int
) -> None:
    """Decode rows of contexts 1, 17, 500 and 4,100 over int8 codes equal attention over the dequantized float32
    cache (the scales applied to scores and weights rather than to elements), split by keys or not."""
    cache = Int8Cache([1, 17, 500, 4100], heads, head_dim, block_size, seed=1)
    cache.fill(64)
    q = torch.randn(4, cache.num_heads, head_dim, generator=cache.gen)
    lib = cpu_kernels.library()
    lib.attention_split_mode(cpu_kernels.ATTENTION_SPLIT.index(split))
    try:
        out = cpu_kernels.attention(q, cache.k, cache.v, cache.tables, cache.lens, 0.125, scales=cache.scales)
        expected = cpu_kernels.attention(q, *cache.dequantized(), cache.tables, cache.lens, 0.125)
    finally:
        lib.attention_split_mode(cpu_kernels.ATTENTION_SPLIT.index("auto"))
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)


def test_prefill_tiles_scale_their_shared_keys() -> None:
    """A prompt's tokens tiled over their shared keys (the shared phase scales each chunk's scores and weights as
    own_keys does) give the same bits as each token alone, and equal attention over the dequantized cache."""
    cache = Int8Cache([600], (9, 3), 64, 16, seed=2)
    cache.fill(600)
    rows = 40  # the prompt's last 40 tokens, each over its causal context
    seq_lens = np.arange(561, 601, dtype=np.int64)
    tables = np.repeat(cache.tables.numpy(), rows, axis=0)
    q = torch.randn(rows, 9, 64, generator=cache.gen)
    tiles = plan_tiles(seq_lens, tables, 16, 3, cpu_kernels.tile_lanes(64, torch.float32))
    assert (tiles.shared > 0).any()
    args = (torch.from_numpy(tables), torch.from_numpy(seq_lens), 0.125)
    with_tiles = cpu_kernels.attention(q, cache.k, cache.v, *args, tiles, scales=cache.scales)
    alone = cpu_kernels.attention(q, cache.k, cache.v, *args, scales=cache.scales)
    assert torch.equal(with_tiles, alone)
    torch.testing.assert_close(alone, cpu_kernels.attention(q, *cache.dequantized(), *args), atol=2e-6, rtol=0)


def test_an_int8_cache_needs_its_scales() -> None:
    """An int8 cache without scales, or scales beside a float cache, is refused before the kernel runs."""
    cache = Int8Cache([20], (4, 2), 32, 16, seed=3)
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="an int8 cache takes its scales"):
        cpu_kernels.attention(q, cache.k, cache.v, cache.tables, cache.lens, 0.125)
    with pytest.raises(ValueError, match="an int8 cache takes its scales"):
        cpu_kernels.attention(q, *cache.dequantized(), cache.tables, cache.lens, 0.125, scales=cache.scales)
    with pytest.raises(ValueError, match=r"k_scales must be a contiguous float32 CPU tensor of shape \(4, 2\)"):
        cpu_kernels.attention(q, cache.k, cache.v, cache.tables, cache.lens, 0.125,
                              scales=(cache.scales[0][:2], cache.scales[1]))  # fmt: skip


# ---------------------------------------------------------------------------- the engine on an int8 cache


def test_int8_cache_is_refused_where_it_cannot_run() -> None:
    """kv_cache_dir keeps float caches only, and the PyTorch attention backend reads no int8 cache: each is a
    ParameterError naming kv_cache_dtype, before anything loads or at start-up."""
    from engine import Engine
    from engine.config import EngineConfig
    from engine.errors import ParameterError

    with pytest.raises(ParameterError, match="kv_cache_dir persists float32 and bfloat16 caches") as exc:
        EngineConfig(kv_cache_dtype="int8", kv_cache_dir="/nonexistent")
    assert exc.value.param == "kv_cache_dtype"
    with pytest.raises(ParameterError, match="runs on the CPU attention kernels") as exc:
        Engine(kv_cache_dtype="int8", attention_backend="torch", num_blocks=16)
    assert exc.value.param == "kv_cache_dtype"


def test_bundled_model_serves_from_an_int8_cache_and_returns_its_blocks() -> None:
    """The bundled model with kv_cache_dtype="int8": the modules run (decoder.c reads float caches), the cache holds
    int8 codes with their scales and counts about four times a float32 cache's blocks in the same memory, every
    request gets its 8 greedy tokens, and every block comes back. Token agreement with a float cache is measured, not
    asserted: docs/kv_cache.md."""
    from engine import Engine, SamplingParams

    prompts = [torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 90, 7)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    blocks = {}
    for dtype in ("auto", "int8"):
        engine = Engine(dtype="float32", kv_cache_dtype=dtype, kv_cache_memory=16 << 20, max_model_len=512)
        outputs = engine.generate(prompts, greedy, use_tqdm=False)
        assert [len(out.outputs[0].token_ids) for out in outputs] == [8, 8, 8]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests()
        blocks[dtype] = engine.kv.num_blocks
        if dtype == "int8":
            stats = engine.stats()
            assert stats["layers"] == "modules" and "int8" in stats["attention"]
    # a block holds K and V of 30 layers x 3 KV heads x 16 tokens x 64: 4 bytes an element in float32; in int8 one,
    # and a 4-byte scale for each layer's K or V of a KV head
    heads = 30 * 2 * 3
    assert blocks == {"auto": (16 << 20) // (heads * 16 * 64 * 4), "int8": (16 << 20) // (heads * (16 * 64 + 4))}
