"""The CPU attention backend's rows: every query token (decode or prefill) as a kernel row, tiled by shared keys."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.attention.cpu_backend import CpuAttentionBackend, plan_tiles, token_rows
from engine.core.scheduler_output import ScheduledRequest
from engine.worker.input_batch import prepare_inputs
from tests.support.bf16_paths import attention_path

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernel")

BLOCK_SIZE, HEAD_DIM = 16, 64


def _step(requests: list[tuple[list[int], int, int]], num_blocks: int, heads: tuple[int, int], seed: int):
    """(table, cached tokens, new tokens) per request: random cache, q/k/v of the new tokens, the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    scheduled = [
        ScheduledRequest(str(i), [0] * new, cached, (table,), True) for i, (table, cached, new) in enumerate(requests)
    ]
    meta = prepare_inputs(scheduled, BLOCK_SIZE, torch.device("cpu")).attn_metadata[0]
    num_tokens = meta.slot_mapping.shape[0]
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    return q, k, v, kv_cache, meta


def _reference(q, kv_cache, meta, scale) -> torch.Tensor:
    """Causal attention of each token over its sequence's context, read from the (already written) cache."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:]).double()
    group = q.shape[1] // kv_cache.shape[-2]
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    outs = []
    for i, ctx in enumerate(seq_lens):
        pos = torch.arange(ctx)
        slots = meta.block_tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k, v = (flat[j, slots].repeat_interleave(group, 1) for j in (0, 1))  # [ctx, Hq, D]
        for t in range(starts[i], starts[i + 1]):
            n = ctx - (starts[i + 1] - t) + 1  # keys the token at this row sees
            scores = torch.einsum("hd,nhd->hn", q[t].double() * scale, k[:n])
            outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v[:n]))
    return torch.stack(outs)


def test_token_rows_give_each_prefill_token_its_causal_context() -> None:
    _, _, _, _, meta = _step([([3, 4], 20, 5), ([7], 4, 1), ([1, 2], 0, 18)], 16, (4, 2), seed=0)
    lens, tables = token_rows(meta)
    assert lens.tolist() == [21, 22, 23, 24, 25, 5, *range(1, 19)]
    assert tables[:5].tolist() == [[3, 4]] * 5 and tables[5, 0] == 7 and tables[6:].tolist() == [[1, 2]] * 18


def test_prefill_tokens_tile_over_their_chunk() -> None:
    """A chunk's tokens tile in order, each tile sharing every key up to its first token (not a block boundary)."""
    _, _, _, _, meta = _step([([5, 6, 7, 8], 20, 30)], 16, (9, 3), seed=1)
    tiles = plan_tiles(*token_rows(meta), BLOCK_SIZE, group=3, lanes=24)  # 8 rows a tile
    assert tiles.rows.tolist() == list(range(30))
    assert tiles.starts.tolist() == [0, 8, 16, 24, 30]
    assert tiles.shared.tolist() == [21, 29, 37, 45]


def test_sequences_behind_one_prefix_share_its_blocks_only() -> None:
    """Decode rows and prefill tokens of sequences that share two leading blocks tile together over
    those 32 keys; a sequence with other blocks never joins their tiles."""
    requests = [([1, 2, 10], 40, 1), ([9, 11], 20, 1), ([1, 2, 12, 13], 36, 4), ([1, 2, 14], 33, 1)]
    _, _, _, _, meta = _step(requests, 16, (4, 2), seed=2)
    tiles = plan_tiles(*token_rows(meta), BLOCK_SIZE, group=2, lanes=24)
    starts = tiles.starts.tolist()
    tile_of = {row: t for t in range(len(starts) - 1) for row in tiles.rows[starts[t] : starts[t + 1]].tolist()}
    together = {tile_of[row] for row in (0, 2, 3, 4, 5, 6)}  # rows of the three sequences behind blocks 1, 2
    assert len(together) == 1 and tiles.shared[together.pop()] == 32
    assert tiles.shared[tile_of[1]] == 0 and (np.diff(tiles.starts.numpy()) <= 12).all()


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (16, 1)])
def test_backend_matches_reference_over_prefill_and_decode(heads: tuple[int, int]) -> None:
    """A step mixing a fresh prompt, chunks over a cached shared prefix and decode rows equals causal
    attention over each sequence's context; every new K/V lands at its slot."""
    rng = random.Random(sum(heads))
    free = list(range(6, 64))
    rng.shuffle(free)
    prefix = [0, 1, 2]  # 48 keys cached once, as a system prompt is
    requests = [([3, 4, 5], 0, 37)]  # a fresh prompt: its first chunk
    for cached, new in [(48, 9), (52, 30), (70, 1), (48, 1), (49, 17)]:
        own = [free.pop() for _ in range(-(-(cached + new) // BLOCK_SIZE) - len(prefix))]
        requests.append((prefix + own, cached, new))
    q, k, v, kv_cache, meta = _step(requests, 64, heads, seed=3)
    out = CpuAttentionBackend(heads[0] // heads[1]).forward(q, k, v, kv_cache, meta, 0.125)
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    assert torch.equal(flat[0, meta.slot_mapping], k) and torch.equal(flat[1, meta.slot_mapping], v)
    torch.testing.assert_close(out.double(), _reference(q, kv_cache, meta, 0.125), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", cpu_kernels.BF16_ATTENTION_PATHS)
def test_bfloat16_cache_chunks_match_reference(attention: str) -> None:
    """Over a bfloat16 cache: a fresh prompt's chunk, long and short chunks over a cached prefix and decode rows all
    equal causal attention over the widened cache (the tiles' shared keys on AMX or the dot products round the queries
    and weights to bfloat16), and the new tokens' keys and values are stored rounded to bfloat16."""
    rng = random.Random(5)
    free = list(range(6, 64))
    rng.shuffle(free)
    prefix = [0, 1, 2]
    requests = [([3, 4, 5], 0, 40)]  # a fresh prompt: causal from position 0
    for cached, new in [(48, 64), (52, 5), (70, 1), (49, 63)]:  # over the prefix, long; short; decode; long
        own = [free.pop() for _ in range(-(-(cached + new) // BLOCK_SIZE) - len(prefix))]
        requests.append((prefix + own, cached, new))
    q, k, v, kv_cache, meta = _step(requests, 64, (9, 3), seed=4)
    kv_cache = kv_cache.bfloat16()
    with attention_path(attention):
        out = CpuAttentionBackend(3).forward(q, k, v, kv_cache, meta, 0.125)
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    assert torch.equal(flat[0, meta.slot_mapping], k.bfloat16()) and torch.equal(flat[1, meta.slot_mapping], v.bfloat16())
    expected = _reference(q, kv_cache.float(), meta, 0.125)
    tolerance = 1e-5 if attention == "widened" else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("attention", cpu_kernels.BF16_ATTENTION_PATHS)
def test_describe_names_the_path_that_runs(attention: str) -> None:
    """The start-up log's and Engine.stats()'s account of the backend names the cache's dtype, the tiles' queries
    and the path of their shared keys as the kernel takes it."""
    backend = CpuAttentionBackend(3)
    with attention_path(attention):
        text = backend.describe(torch.bfloat16, 64)
        lanes = cpu_kernels.tile_lanes(64, torch.bfloat16)
    assert text == f"cpu (bfloat16 cache; tiles of {lanes} queries, their shared keys on {attention})"
    lanes = cpu_kernels.tile_lanes(64, torch.float32)
    expected = f"cpu (float32 cache; tiles of {lanes} queries, their shared keys on float32 vectors)"
    assert backend.describe(torch.float32, 64) == expected


@pytest.mark.parametrize(
    "heads, head_dim, block_size, dtype",
    [
        ((9, 3), 64, 16, torch.float32),
        ((16, 1), 64, 24, torch.float32),  # chunks end at blocks' ends as well as every 16 (or 8) keys
        ((4, 4), 40, 8, torch.float32),  # 8-lane rows even on AVX-512 (40 is no multiple of 16)
        ((9, 3), 64, 16, torch.bfloat16),
    ],
)
def test_a_row_is_the_same_bits_tiled_as_alone(
    heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """Batch invariance: each row's output is bitwise what it is alone (no tile, every key its own), whatever tile
    and shared keys it gets: prefill tokens of a fresh prompt and of chunks over a cached prefix, and decode rows
    behind a shared prompt. A quantized model's next matmul rounds its input to int8 steps, where one bit of
    difference here can move a step (tests/engine/models/test_gguf_batch_invariance.py)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks = 96
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    prefix = [pool.pop() for _ in range(-(-50 // block_size))]  # a 50-token prompt, cached once
    lens, tables = [], []
    for cached, new in [(0, 45), (50, 37), (53, 1), (61, 1), (80, 1), (50, 20)]:
        seq_len = cached + new
        table = (prefix + [pool.pop() for _ in range(-(-seq_len // block_size) - len(prefix))]) if cached else [
            pool.pop() for _ in range(-(-seq_len // block_size))
        ]
        for t in range(cached, seq_len):
            lens.append(t + 1)
            tables.append(table + [-1] * (12 - len(table)))
    seq_lens, tables = np.array(lens, dtype=np.int64), np.array(tables, dtype=np.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    tiles = plan_tiles(seq_lens, tables, block_size, num_heads // num_kv_heads,
                       cpu_kernels.tile_lanes(head_dim, dtype))
    assert (tiles.shared > 0).sum() >= 3 and (tiles.shared % block_size % 8 != 0).any()  # unaligned shares too
    args = (torch.from_numpy(tables), torch.from_numpy(seq_lens), 0.125)
    context = attention_path("widened") if dtype == torch.bfloat16 else contextlib.nullcontext()
    with context:
        tiled = cpu_kernels.attention(q, k_cache, v_cache, *args, tiles)
        alone = cpu_kernels.attention(q, k_cache, v_cache, *args)
    assert torch.equal(tiled, alone)


@contextlib.contextmanager
def _split(mode: str):
    """Run paged attention's rows split by keys per ``mode`` (one of ``ATTENTION_SPLIT``), ``auto`` restored after."""
    lib = cpu_kernels.library()
    lib.attention_split_mode(cpu_kernels.ATTENTION_SPLIT.index(mode))
    try:
        yield
    finally:
        lib.attention_split_mode(cpu_kernels.ATTENTION_SPLIT.index("auto"))


def _decode_rows(lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype, seed: int):
    """Decode rows of contexts ``lens`` over scattered blocks of a random cache: q, caches, tables, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(per_row)), -1, dtype=torch.int32)
    for i, n in enumerate(per_row):
        tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    return q, kv[0], kv[1], tables, torch.tensor(lens, dtype=torch.int64)


def _decode_reference(q, k_cache, v_cache, tables, seq_lens, scale: float, window: int = 0) -> torch.Tensor:
    """Each row's attention over its context (its last ``window`` keys where given), in float64."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    outs = []
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(max(n - window, 0) if window else 0, n)
        blocks, offsets = tables[i, pos // block_size].long(), pos % block_size
        k, v = (c[blocks, offsets].double().repeat_interleave(group, 1) for c in (k_cache, v_cache))
        scores = torch.einsum("hd,nhd->hn", q[i].double() * scale, k)
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("split", cpu_kernels.ATTENTION_SPLIT)
@pytest.mark.parametrize(
    "heads, head_dim, block_size, dtype",
    [
        ((9, 3), 64, 16, torch.float32),  # GQA, 16-lane rows where the build has AVX-512
        ((16, 1), 128, 32, torch.bfloat16),  # a group of 16 query heads, a bfloat16 cache
        ((4, 4), 40, 8, torch.float32),  # 8-lane rows, blocks of 8 (spans of 256 keys are 32 blocks)
        ((32, 32), 64, 16, torch.bfloat16),  # more KV heads than one item holds: two head groups a span
    ],
)
def test_decode_rows_split_by_keys_match_reference(
    split: str, heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """Decode rows of contexts 1, 17, 500 and 4,100 keys equal attention over each row's context, split by keys
    across the threads or not (every dispatch of paged_attention)."""
    q, k_cache, v_cache, tables, seq_lens = _decode_rows([1, 17, 500, 4100], heads, head_dim, block_size, dtype, 7)
    with _split(split):
        out = cpu_kernels.attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    expected = _decode_reference(q, k_cache.float(), v_cache.float(), tables, seq_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


def test_split_rows_keep_windows_and_soft_caps() -> None:
    """Split by keys, a sliding window that starts inside a span reads only its last keys, as unsplit."""
    q, k_cache, v_cache, tables, seq_lens = _decode_rows([700, 4100], (9, 3), 64, 16, torch.float32, 8)
    with _split("off"):
        whole = cpu_kernels.attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window=300, softcap=30.0)
    with _split("always"):
        split = cpu_kernels.attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window=300, softcap=30.0)
        plain = cpu_kernels.attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window=300)
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=0)
    expected = _decode_reference(q, k_cache, v_cache, tables, seq_lens, 0.125, window=300)
    torch.testing.assert_close(plain.double(), expected, atol=2e-6, rtol=0)


def test_a_split_row_is_the_same_bits_whatever_its_batch() -> None:
    """Split by keys, a row's output does not depend on the rows beside it (its spans are cut at fixed positions
    and merged in order)."""
    q, k_cache, v_cache, tables, seq_lens = _decode_rows([3000, 260, 4100], (9, 3), 64, 16, torch.float32, 9)
    with _split("always"):
        together = cpu_kernels.attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
        alone = [cpu_kernels.attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], seq_lens[i : i + 1], 0.125)
                 for i in range(3)]  # fmt: skip
    assert torch.equal(together, torch.cat(alone))
