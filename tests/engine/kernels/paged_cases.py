"""Random paged batches and a naive float64 reference for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.core.kv_cache_groups import NULL_BLOCK


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new tokens' keys, not yet stored
    v: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], cached prefixes filled in
    meta: AttentionMetadata
    scale: float
    block_ids: list[list[int]]  # each sequence's blocks, unpadded


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_shared_blocks: int = 0,
    poison: bool = True,
    seed: int = 0,
) -> PagedBatch:
    """A batch of sequences given as ``(seq_len, query_len)``: the last ``query_len`` tokens are new.

    Blocks come from a random permutation of the pool (non-contiguous tables, block 0 among
    them). With ``num_shared_blocks`` every sequence's first blocks are sequence 0's, as a
    shared prefix would be. With ``poison`` every cache row that no sequence should read is
    NaN, so a kernel that reads past a context or a table poisons its output.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, head_dim)
    blocks_needed = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    fill = float("nan") if poison else 0.0
    kv_cache = torch.full((2, num_blocks, block_size, *shape), fill, dtype=torch.float32)

    block_ids: list[list[int]] = []
    slots: list[int] = []
    for i, ((seq_len, query_len), n) in enumerate(zip(seqs, blocks_needed)):
        context_len = seq_len - query_len
        shared = block_ids[0][:num_shared_blocks] if i > 0 else []
        if shared and min(context_len, seqs[0][0] - seqs[0][1]) < len(shared) * block_size:
            raise ValueError("shared blocks must lie inside every sequence's cached prefix")
        ids = shared + [pool.pop() for _ in range(n - len(shared))]
        block_ids.append(ids)
        for pos in range(seq_len):
            blk, off = ids[pos // block_size], pos % block_size
            if pos >= context_len:
                slots.append(blk * block_size + off)
            elif not (i > 0 and pos < len(shared) * block_size):
                kv_cache[:, blk, off] = torch.randn(2, *shape, generator=gen)

    num_tokens = sum(q for _, q in seqs)
    max_blocks = max(blocks_needed) + 1  # one padding column past the longest table
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    query_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0)]).to(torch.int32).to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(s for s, _ in seqs),
    )

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(dtype=dtype, device=device)

    return PagedBatch(
        q=rand(num_tokens, num_q_heads, head_dim),
        k=rand(num_tokens, *shape),
        v=rand(num_tokens, *shape),
        kv_cache=kv_cache.to(dtype=dtype, device=device),
        meta=meta,
        scale=head_dim**-0.5,
        block_ids=block_ids,
    )


def stored_cache(batch: PagedBatch) -> torch.Tensor:
    """The cache after the new tokens' K/V are written at their slots (computed with torch)."""
    cache = batch.kv_cache.clone()
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, batch.meta.slot_mapping] = batch.k
    flat[1, batch.meta.slot_mapping] = batch.v
    return cache


def reference_attention(batch: PagedBatch, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Per-sequence gather + causal softmax in float64: ``[T, Hq, D]``; with a sliding ``window`` (a query at p
    sees keys p - window + 1 .. p) and scaled scores s soft-capped to ``softcap * tanh(s / softcap)``."""
    cache = stored_cache(batch).double().cpu()
    q = batch.q.double().cpu()
    meta = batch.meta
    group = q.shape[1] // cache.shape[3]
    out = torch.empty_like(q)
    qsl = meta.query_start_loc.tolist()
    for i, ids in enumerate(batch.block_ids):
        seq_len = int(meta.seq_lens[i])
        start, end = qsl[i], qsl[i + 1]
        keys = cache[0, ids].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = cache[1, ids].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q[start:end], keys) * batch.scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [L, S]
        if window is not None:
            visible &= torch.arange(seq_len)[None, :] > q_pos[:, None] - window
            values = values.masked_fill(~visible.any(0)[:, None, None], 0.0)  # poisoned where unseen
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, values)
    return out


TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def check_against_reference(
    batch: PagedBatch, out: torch.Tensor, window: int | None = None, softcap: float | None = None
) -> None:
    """``out`` has the queries' dtype and shape and equals the float64 reference within the dtype's tolerance."""
    tol = TOL[batch.q.dtype]
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    expected = reference_attention(batch, window, softcap)
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


def poison_before_windows(batch: PagedBatch, window: int) -> None:
    """NaN in every block that lies wholly before its sequence's first query's window, and NULL_BLOCK (-1)
    in its table entry: blocks a windowed kernel must never read (the KV cache released them)."""
    block_size = batch.kv_cache.shape[2]
    qsl = batch.meta.query_start_loc.tolist()
    for i, ids in enumerate(batch.block_ids):
        first_query = int(batch.meta.seq_lens[i]) - (qsl[i + 1] - qsl[i])
        released = max(0, first_query - window + 1) // block_size
        for block in ids[:released]:
            batch.kv_cache[:, block] = float("nan")
        batch.meta.block_tables[i, :released] = NULL_BLOCK
