"""Verifying a step's drafts: position by position, each request's tokens sampled as without speculation.

A request with drafts ``d_1 .. d_k`` got logits at ``k + 1`` positions in one forward pass: after its
last token, and after each draft. Position ``j`` is sampled with the request in the state it would
have had without speculation (the accepted ``d_1 .. d_j`` appended: penalties, ``min_tokens``, the
grammar's mask, stop strings and ``max_tokens`` all see them), by the sampler every step uses.
Draft ``d_{j+1}`` is accepted when the token sampled at position ``j`` is ``d_{j+1}``; the first
position whose token differs ends the request's step, that token (the target's own) emitted in
the draft's place; with every draft accepted, position ``k`` emits one more token.

Why this is the rejection rule of speculative sampling: with a one-hot draft ``q = δ_d`` (an
n-gram's), the rule accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and otherwise
samples from ``max(0, p - q)`` renormalized, i.e. ``p`` without ``d``. Sampling ``x ~ p`` and
accepting iff ``x == d`` does exactly that: ``P(accept) = p(d)``, and ``x`` given ``x != d`` is ``p``
without ``d``. So greedy rows emit the argmax as always, sampled rows are distributed as ``p``, and
a seeded request draws the same numbers in the same order as without speculation: its tokens are
the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.request import Request

# sample(logits [rows, vocab], requests) -> {req_id: token}: samples, records and appends one token per row
SampleFn = Callable[[torch.Tensor, list[Request]], Mapping[str, int]]


class Verified(NamedTuple):
    """One request's drafts in a step: how many it verified, how many were accepted."""

    req_id: str
    num_drafts: int
    num_accepted: int


def verify_drafts(
    logits: torch.Tensor, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request], sample: SampleFn
) -> list[Verified]:
    """Samples every position a step computed logits for, in order, stopping each request at its first rejection.

    Args:
        logits: ``[num_logits, vocab]``: each ``needs_logits`` request's ``1 + num_draft_tokens`` rows, in batch order.
        scheduled: The step's requests, in batch order.
        requests: The unfinished requests by id.
        sample: Samples one position of some requests and appends the tokens (the engine's step).

    Returns:
        For each request that had drafts: how many, and how many were accepted.
    """
    entries: list[tuple[Request, int, list[int]]] = []  # (request, its first logits row, its drafts)
    row = 0
    for share in scheduled:
        if share.needs_logits:
            entries.append((requests[share.req_id], row, share.draft_token_ids))
            row += share.num_logits
    num_accepted = dict.fromkeys((r.req_id for r, _, drafts in entries if drafts), 0)
    active = entries
    position = 0
    while active:
        index = torch.tensor([first + position for _, first, _ in active], device=logits.device)
        tokens = sample(logits.index_select(0, index), [request for request, _, _ in active])
        still = []
        for entry in active:
            request, _, drafts = entry
            if position < len(drafts) and tokens.get(request.req_id) == drafts[position]:
                num_accepted[request.req_id] += 1
                if not request.is_finished:  # a stop token, stop string or max_tokens ends it here
                    still.append(entry)
        active = still
        position += 1
    return [Verified(r.req_id, len(drafts), num_accepted[r.req_id]) for r, _, drafts in entries if drafts]
