"""Cascade (shared-prefix) decode attention: equal to the plain path and to a float64 reference."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.attention import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend, _make_plan
from engine.core.scheduler_output import ScheduledRequest
from engine.worker.input_batch import prepare_inputs

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM = 4, 48, 8

# Each case: (block table, context length incl. the new token, query length) per sequence, in
# batch order. Blocks 0-9 are shared prefixes; 10+ are private.
CASES = {
    # one group of five: suffixes of 1 token (partial block), a full block, 2 blocks; one
    # context ends exactly at the prefix (empty suffix, its new token in the shared block)
    "one_group": [
        ([1, 2, 3, 10], 13, 1),
        ([1, 2, 3, 11], 16, 1),
        ([1, 2, 3, 12, 13], 20, 1),
        ([1, 2, 3, 14, 15], 18, 1),
        ([1, 2, 3], 12, 1),
    ],
    # two groups of different prefix lengths, interleaved with a sequence sharing nothing
    "two_groups_and_a_loner": [
        ([4, 5, 16, 17], 15, 1),
        ([1, 18, 19], 11, 1),
        ([20, 21, 22], 9, 1),
        ([4, 5, 23], 10, 1),
        ([1, 24], 7, 1),
        ([4, 5, 25, 26], 14, 1),
    ],
    # equal tables but different lengths: the prefix stops inside a block, at the shortest context
    "prefix_inside_a_block": [
        ([6, 7, 8], 9, 1),
        ([6, 7, 8], 11, 1),
    ],
    # decodes around a prefill chunk that also reads the shared prefix
    "mixed_with_prefill": [
        ([1, 2, 27], 10, 1),
        ([1, 2, 28, 29], 13, 5),
        ([1, 2, 30], 12, 1),
        ([31, 32], 6, 1),
    ],
    # every context ends at the prefix: no row has a key of its own
    "every_suffix_empty": [([8, 9], 8, 1), ([8, 9], 8, 1)],
    "one_sequence": [([1, 2, 33], 11, 1)],
    "nothing_shared": [([34, 35], 8, 1), ([36], 3, 1), ([37, 38, 39], 12, 1)],
}

# decode rows served from a shared prefix, per case: (rows' batch indices, prefix tokens)
EXPECTED_GROUPS = {
    "one_group": [([0, 1, 2, 3, 4], 12)],
    "two_groups_and_a_loner": [([1, 4], 4), ([0, 3, 5], 8)],
    "prefix_inside_a_block": [([0, 1], 9)],
    "mixed_with_prefill": [([0, 2], 8)],
    "every_suffix_empty": [([0, 1], 8)],
    "one_sequence": [],
    "nothing_shared": [],
}


def _batch(case: str, num_heads: int, num_kv_heads: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(len(case) + num_heads)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    scheduled = [
        ScheduledRequest(str(i), [0] * q_len, ctx - q_len, (table,), True)
        for i, (table, ctx, q_len) in enumerate(CASES[case])
    ]
    inputs = prepare_inputs(scheduled, BLOCK_SIZE, torch.device("cpu"))
    num_tokens = inputs.input_ids.shape[0]
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, kv_cache, inputs.attn_metadata[0]


def _reference(q, kv_cache, meta, scale) -> torch.Tensor:
    """Causal attention in float64 over each sequence's table, read from the cache after the store."""
    group = q.shape[1] // kv_cache.shape[3]
    starts, out = meta.query_start_loc.tolist(), []
    for i, ctx in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i, : -(-ctx // BLOCK_SIZE)].long()
        keys = kv_cache[0, table].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)  # [ctx, Hq, D]
        values = kv_cache[1, table].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        qs = q[starts[i] : starts[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        q_pos = torch.arange(ctx - qs.shape[0], ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_finds_shared_prefixes(case: str) -> None:
    """Decode rows are grouped by their common leading blocks, capped at the group's shortest context."""
    _, _, _, _, meta = _batch(case, 4, 2, torch.float32)
    plan = _make_plan(meta, BLOCK_SIZE, torch.float32, min_shared_keys=1).decode
    starts = meta.query_start_loc.tolist()
    tokens_in_plan_order = plan.tokens.tolist() if plan.tokens is not None else starts[:-1]
    groups = []
    for g in plan.groups:
        tokens = tokens_in_plan_order[g.start : g.end]
        groups.append((sorted(starts.index(t) for t in tokens), g.num_tokens))
        first_table = CASES[case][groups[-1][0][0]][0]
        assert g.blocks.tolist() == first_table[: -(-g.num_tokens // BLOCK_SIZE)]
    assert sorted(groups) == sorted(EXPECTED_GROUPS[case])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_cascade_matches_plain_path_and_reference(case: str, heads: tuple[int, int]) -> None:
    """Cascade outputs equal the non-cascade path and float64 attention within fp32 tolerance."""
    q, k, v, kv_cache, meta = _batch(case, *heads, torch.float32)
    scale = HEAD_DIM**-0.5
    plain_cache = kv_cache.clone()
    out = TorchAttentionBackend(min_shared_keys=1).forward(q, k, v, kv_cache, meta, scale)
    plain = TorchAttentionBackend(cascade=False).forward(q, k, v, plain_cache, meta, scale)
    assert torch.equal(kv_cache, plain_cache)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), _reference(q, kv_cache, meta, scale), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 2), (9, 3)])
def test_cpu_kernel_over_shared_blocks(case: str, heads: tuple[int, int]) -> None:
    """The C decode kernel, reading shared prefix blocks in place, equals the dense reference."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler for the CPU kernel")
    q, k, v, kv_cache, meta = _batch(case, *heads, torch.float32)
    out = CpuAttentionBackend(heads[0] // heads[1]).forward(q, k, v, kv_cache, meta, 0.3)
    torch.testing.assert_close(out.double(), _reference(q, kv_cache, meta, 0.3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["one_group", "two_groups_and_a_loner"])
def test_cascade_bfloat16_within_rounding(case: str) -> None:
    """In bfloat16 the cascade (computed in float32) stays within bf16 rounding of the reference."""
    q, k, v, kv_cache, meta = _batch(case, 6, 2, torch.bfloat16)
    out = TorchAttentionBackend(min_shared_keys=1).forward(q, k, v, kv_cache, meta, 0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(q, kv_cache, meta, 0.3), atol=2e-2, rtol=0)


def test_small_savings_stay_on_the_plain_path() -> None:
    """A group is formed only when it saves at least min_shared_keys key gathers: (rows - 1) x prefix."""
    _, _, _, _, meta = _batch("two_groups_and_a_loner", 4, 2, torch.float32)  # saves 1 x 4 and 2 x 8 keys

    def groups(min_keys: int) -> list[int]:
        return [g.num_tokens for g in _make_plan(meta, BLOCK_SIZE, torch.float32, min_keys).decode.groups]

    assert sorted(groups(4)) == [4, 8]
    assert groups(5) == [8]
    assert groups(16) == [8]
    assert groups(17) == []
    assert groups(None) == []
