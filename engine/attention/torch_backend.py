"""The PyTorch attention backend: portable paged attention, with cascade attention over shared prefixes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.prefix import common_prefix


class _PrefixGroup(NamedTuple):
    """Decode rows ``start:end`` (plan order) whose block tables begin with the same blocks."""

    start: int
    end: int
    blocks: torch.Tensor  # [ceil(num_tokens / block_size)] int64: the shared prefix's blocks
    num_tokens: int  # shared context length; each row's own keys start at this position


class _DecodePlan(NamedTuple):
    """How one step's single-token sequences attend (see ``TorchAttentionBackend``)."""

    tokens: torch.Tensor | None  # [Bd] int64 rows of q in plan order; None = every row of q, in order
    blocks: torch.Tensor  # [Bd * W] int64: W blocks per row, from the end of its shared prefix (or 0)
    bias: torch.Tensor  # [Bd, 1, 1, W * block_size] 0 for the row's own keys, -inf elsewhere
    groups: list[_PrefixGroup]  # empty: no prefix worth sharing, one masked SDPA serves every row


class _TorchPlan(NamedTuple):
    """Host-side split of one step's batch, computed once and shared by every layer."""

    decode: _DecodePlan | None  # None when no row decodes
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]  # start, end, ctx slots, mask


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch, for the CPU (and as a portable fallback on GPU).

    Single-token (decode) sequences are served together. Their context blocks are gathered
    into a reused workspace ``[Bd, W * block_size, Hkv, D]`` and one masked SDPA call attends
    for all of them, the query heads of a KV group folded into the query axis. When several
    of them start with the same blocks (a shared system prompt, cached once), that prefix is
    gathered once per layer and attended by all their queries in one matmul per KV head
    (cascade attention); each row then gathers only its own suffix, and one softmax over
    the scores of both parts keeps the result exact. Longer chunks (prefills) run one SDPA
    each: straight over the new K/V when nothing is cached before them, else over their
    context gathered from the cache with a causal mask.

    A sliding-window layer gathers and attends over the blocks of each query's window only
    (the mask bounds it to the exact keys) and shares no prefix. A soft-capped layer scores
    with matmuls rather than SDPA, which has no soft cap.

    Args:
        cascade: share the gather and the scores of common prefixes between decode rows.
        min_shared_keys: a group of rows takes the cascade path only when it saves at least
            this many key gathers, (rows - 1) x prefix tokens; below that (measured on CPU)
            its dozen extra small ops per layer cost more than the copies they save.
    """

    name = "torch"

    def __init__(self, cascade: bool = True, min_shared_keys: int = 256) -> None:
        self.cascade = cascade
        self.min_shared_keys = min_shared_keys
        # the step's plans by (metadata, window, cascade); a step's groups share its query_start_loc
        self._plan_step: torch.Tensor | None = None
        self._plans: dict[tuple[int, int | None, bool], tuple[AttentionMetadata, _TorchPlan]] = {}
        self._workspace: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # NOTE: every new token's K/V is stored before any attention reads the cache, so a
        # sequence may read prefix blocks that another sequence of this batch writes now.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        plan = self._get_plan(meta, block_size, q.dtype, sliding_window, logit_softcap is None)
        dec = plan.decode
        if dec is not None and dec.tokens is None:  # a pure decode step: no copy in or out
            return self._decode(q, kv_cache, dec, scale, logit_softcap)
        out = torch.empty_like(q)
        if dec is not None:
            o_dec = self._decode(q.index_select(0, dec.tokens), kv_cache, dec, scale, logit_softcap)
            out.index_copy_(0, dec.tokens, o_dec)
        group = q.shape[1] // num_kv_heads
        for start, end, ctx_slots, mask in plan.prefills:
            if ctx_slots is None:  # nothing cached before this chunk: its own K/V are the context
                k_seq, v_seq = k[start:end], v[start:end]
            else:
                k_seq = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, ctx_slots)
                v_seq = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, ctx_slots)
            # NOTE: 4-D [1, H, S, D]: on CPU only batched inputs reach SDPA's flash kernel; 3-D ones take
            # the unfused math path, 2-3.5x slower on prefill chunks.
            o = _attend(
                q[start:end].transpose(0, 1).unsqueeze(0),
                k_seq.transpose(0, 1).unsqueeze(0),
                v_seq.transpose(0, 1).unsqueeze(0),
                mask,
                scale,
                logit_softcap,
                group,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float, softcap: float | None
    ) -> torch.Tensor:
        """Attention of the decode rows ``q`` [Bd, Hq, D] (plan order) over their contexts."""
        num_dec, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        kv_blocks = kv_cache.view(2, kv_cache.shape[1], -1)  # [2, num_blocks, block_size * Hkv * D]
        ctx = plan.bias.shape[-1]
        k_ctx, v_ctx = self._gather(kv_blocks, plan.blocks)
        if not plan.groups:
            k_ctx = k_ctx.view(num_dec, ctx, num_kv_heads, head_dim).transpose(1, 2)  # [Bd, Hkv, L, D]
            v_ctx = v_ctx.view(num_dec, ctx, num_kv_heads, head_dim).transpose(1, 2)
            q = q.view(num_dec, num_kv_heads, num_heads // num_kv_heads, head_dim)  # a KV group's heads as its queries
            o = _attend(q, k_ctx, v_ctx, plan.bias, scale, softcap, 1)
            return o.view(num_dec, num_heads, head_dim)
        return _cascade(q, kv_blocks, k_ctx.view(num_dec, ctx, -1), v_ctx.view(num_dec, ctx, -1), plan, scale)

    def _gather(self, kv_blocks: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: a reused workspace, not a fresh tensor per layer: allocating tens of MB per
        # layer costs more in page faults than the copy itself on CPU.
        numel = block_ids.numel() * kv_blocks.shape[-1]
        ws = self._workspace
        if ws is None or ws.shape[1] < numel or ws.dtype != kv_blocks.dtype or ws.device != kv_blocks.device:
            ws = self._workspace = torch.empty(2, numel, dtype=kv_blocks.dtype, device=kv_blocks.device)
        k_ctx = ws[0, :numel].view(block_ids.numel(), -1)
        v_ctx = ws[1, :numel].view(block_ids.numel(), -1)
        torch.index_select(kv_blocks[0], 0, block_ids, out=k_ctx)
        torch.index_select(kv_blocks[1], 0, block_ids, out=v_ctx)
        return k_ctx, v_ctx

    def _get_plan(
        self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None, cascade: bool
    ) -> _TorchPlan:
        """The step's plan for layers of this metadata (KV cache group) and window; the cascade only without a
        window and where ``cascade``."""
        if meta.query_start_loc is not self._plan_step:
            self._plans, self._plan_step = {}, meta.query_start_loc
        key = (id(meta), window, cascade and self.cascade and window is None)
        held = self._plans.get(key)
        if held is None or held[0] is not meta:
            min_keys = self.min_shared_keys if key[2] else None
            held = self._plans[key] = (meta, _make_plan(meta, block_size, dtype, min_keys, window))
        return held[1]


def _attend(
    q: torch.Tensor,  # [N, Hq, S, D]
    k: torch.Tensor,  # [N, Hkv, L, D]
    v: torch.Tensor,  # [N, Hkv, L, D]
    mask: torch.Tensor | None,  # [S, L] bool (True: attend) or an additive bias; None: causal, S == L
    scale: float,
    softcap: float | None,
    group: int,  # query heads per KV head (Hq // Hkv)
) -> torch.Tensor:  # [N, Hq, S, D]
    """Masked attention: SDPA, or without it where scores are soft-capped, which SDPA cannot do."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _cascade(
    q: torch.Tensor,  # [Bd, Hq, D]
    kv_blocks: torch.Tensor,  # [2, num_blocks, block_size * Hkv * D]
    k_own: torch.Tensor,  # [Bd, L, Hkv * D] each row's keys past its shared prefix
    v_own: torch.Tensor,  # [Bd, L, Hkv * D]
    plan: _DecodePlan,
    scale: float,
) -> torch.Tensor:  # [Bd, Hq, D]
    """Decode attention over (its group's shared prefix) + (its own suffix) per row, in float32.

    Scores of both parts sit side by side in one [Bd, Hq, P + L] matrix (-inf where a row has
    no such key), so one softmax normalises them together, exactly as over the whole context.
    """
    num_dec, num_heads, head_dim = q.shape
    num_kv_heads = k_own.shape[-1] // head_dim
    group = num_heads // num_kv_heads
    out_dtype = q.dtype
    q = q.float() * scale
    # Suffix: with a block-diagonal query matrix one bmm per row scores every head against
    # the gathered [L, Hkv * D] keys as they lie (no transposing copy of the context):
    # query row (h, g) holds q[h, g] in head h's columns and zeros elsewhere.
    q_bd = q.new_zeros(num_dec, num_kv_heads, group, num_kv_heads, head_dim)
    q_bd.diagonal(dim1=1, dim2=3).copy_(q.view(num_dec, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
    bias = plan.bias.view(num_dec, 1, -1).float()
    s_own = torch.baddbmm(bias, q_bd.view(num_dec, num_heads, -1), k_own.float().transpose(1, 2))  # [Bd, Hq, L]
    # Prefix: gathered once per group, every query of the group against it in one bmm per KV head.
    width = max(grp.num_tokens for grp in plan.groups)
    s_pre = q.new_full((num_dec, num_kv_heads, group, width), float("-inf"))
    v_pres = []
    for grp in plan.groups:
        n, ctx = grp.end - grp.start, grp.num_tokens
        k_pre = kv_blocks[0].index_select(0, grp.blocks).view(-1, num_kv_heads, head_dim)[:ctx].float()
        v_pres.append(kv_blocks[1].index_select(0, grp.blocks).view(-1, num_kv_heads, head_dim)[:ctx].float())
        q_grp = q[grp.start : grp.end].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
        s = torch.bmm(q_grp.reshape(num_kv_heads, n * group, head_dim), k_pre.permute(1, 2, 0))  # [Hkv, n*G, P]
        s_pre[grp.start : grp.end, :, :, :ctx] = s.view(num_kv_heads, n, group, ctx).transpose(0, 1)
    p = torch.cat([s_pre.view(num_dec, num_heads, width), s_own], dim=-1).softmax(-1)  # [Bd, Hq, P + L]
    o = torch.bmm(p[:, :, width:], v_own.float()).view(num_dec, num_kv_heads, group, num_kv_heads, head_dim)
    o = o.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).contiguous()  # head h's block: [Bd, Hkv, G, D]
    for grp, v_pre in zip(plan.groups, v_pres):
        n, ctx = grp.end - grp.start, grp.num_tokens
        p_grp = p[grp.start : grp.end, :, :ctx].view(n, num_kv_heads, group, ctx).transpose(0, 1)
        o_pre = torch.bmm(p_grp.reshape(num_kv_heads, n * group, ctx), v_pre.transpose(0, 1))  # [Hkv, n*G, D]
        o[grp.start : grp.end] += o_pre.view(num_kv_heads, n, group, head_dim).transpose(0, 1)
    return o.view(num_dec, num_heads, head_dim).to(out_dtype)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _make_plan(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    min_shared_keys: int | None,
    window: int | None = None,
) -> _TorchPlan:
    """Split one step's batch into its single-token rows (planned together) and its prefill chunks; with a
    ``window``, each attends over the blocks that hold its queries' windows."""
    device = meta.block_tables.device
    starts = _host(meta.query_start_loc).astype(np.int64)
    seq_lens = _host(meta.seq_lens).astype(np.int64)
    block_tables = _host(meta.block_tables)
    query_lens = np.diff(starts)
    decode_rows = np.flatnonzero(query_lens == 1)
    decode = None
    if len(decode_rows):
        decode = _plan_decode(
            decode_rows, starts, seq_lens, block_tables, block_size, min_shared_keys, window, dtype, device
        )
    prefills = []
    for i in np.flatnonzero(query_lens > 1).tolist():
        start, end, ctx_len = int(starts[i]), int(starts[i + 1]), int(seq_lens[i])
        first_q = ctx_len - (end - start)  # position of the chunk's first query
        # keys from the first block any query of the chunk sees
        first_key = 0 if window is None else max(0, first_q - window + 1) // block_size * block_size
        ctx_slots = mask = None
        if first_q > first_key:  # keys cached before the chunk: attend over its context gathered from the cache
            num_blocks = -(-ctx_len // block_size) - first_key // block_size
            blocks = block_tables[i, first_key // block_size :][:num_blocks]
            blocks = torch.from_numpy(blocks.astype(np.int64)).to(device)
            offsets = torch.arange(block_size, device=device)
            ctx_slots = (blocks[:, None] * block_size + offsets).reshape(-1)[: ctx_len - first_key]
        if first_q > first_key or (window is not None and end - start > window):
            q_pos = torch.arange(first_q, ctx_len, device=device)[:, None]
            k_pos = torch.arange(first_key if ctx_slots is not None else first_q, ctx_len, device=device)[None, :]
            mask = k_pos <= q_pos  # [S, ctx]
            if window is not None:
                mask &= k_pos > q_pos - window
        prefills.append((start, end, ctx_slots, mask))
    return _TorchPlan(decode, prefills)


def _prefix_groups(
    seq_lens: np.ndarray, tables: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Single-token rows grouped by the blocks their tables begin with.

    Returns ``(order, firsts, ends, prefix)``: rows ``order[firsts[g]:ends[g]]`` start with the
    same block, and their contexts agree over their first ``prefix[g]`` keys (``common_prefix``).
    """
    order = np.argsort(tables[:, 0], kind="stable")  # rows with the same first block side by side
    sorted_tables, sorted_lens = tables[order], seq_lens[order]
    firsts = np.flatnonzero(np.r_[True, sorted_tables[1:, 0] != sorted_tables[:-1, 0]])
    ends = np.r_[firsts[1:], len(order)]
    return order, firsts, ends, common_prefix(sorted_lens, sorted_tables, firsts, block_size)


def _plan_decode(
    rows: np.ndarray,
    starts: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    min_shared_keys: int | None,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> _DecodePlan:
    seq_lens, tables = seq_lens[rows], block_tables[rows]
    shared = np.zeros(len(rows), dtype=np.int64)  # tokens of each row served by its group's prefix
    groups: list[tuple[int, int, int]] = []
    if min_shared_keys is not None and len(rows) > 1:
        order, firsts, ends, prefix = _prefix_groups(seq_lens, tables, block_size)
        keep = (ends - firsts > 1) & (prefix >= block_size) & ((ends - firsts - 1) * prefix >= min_shared_keys)
        if keep.any():
            rows, seq_lens, tables = rows[order], seq_lens[order], tables[order]
            for a, b, n in zip(firsts[keep].tolist(), ends[keep].tolist(), prefix[keep].tolist()):
                shared[a:b] = n
                groups.append((a, b, n))
    #   keys of row i:  | shared prefix (group) | own suffix: blocks first .. last       |
    #   gathered:                  | block first | ... | block last | padding blocks    |
    #   bias 0 where shared[i] <= position < seq_lens[i], -inf elsewhere
    # (with a window there is no shared prefix, and the row's keys start at seq_lens[i] - window)
    if window is not None:
        shared = np.maximum(seq_lens - window, 0)
    first = shared // block_size
    num_own = -(-seq_lens // block_size) - first
    width = max(int(num_own.max()), 1)  # at least one (masked) block, so shapes stay well defined
    cols = first[:, None] + np.arange(width)  # [Bd, W] logical block of each gathered block
    own_blocks = np.take_along_axis(tables, np.minimum(cols, tables.shape[1] - 1), axis=1)
    pos = (cols[:, :, None] * block_size + np.arange(block_size)).reshape(len(rows), -1)
    valid = (pos >= shared[:, None]) & (pos < seq_lens[:, None])
    bias = np.where(valid, np.float32(0), np.float32(-np.inf))[:, None, None, :]
    tokens = None
    if len(rows) != len(starts) - 1 or (np.diff(rows) < 0).any():
        tokens = torch.from_numpy(starts[rows]).to(device)
    return _DecodePlan(
        tokens=tokens,
        blocks=torch.from_numpy(own_blocks.reshape(-1).astype(np.int64)).to(device),
        bias=torch.from_numpy(bias).to(device=device, dtype=dtype),
        groups=[
            _PrefixGroup(a, b, torch.from_numpy(tables[a, : -(-n // block_size)].astype(np.int64)).to(device), n)
            for a, b, n in groups
        ],
    )
