"""The scheduler -> runner contract: everything the runner needs for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.multimodal.inputs import ImageInput


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes ``token_ids`` at positions ``num_computed_tokens ..
    num_computed_tokens + len(token_ids) - 1``, writes their K/V into the slots that
    ``block_ids`` address, and attends over the request's first
    ``num_computed_tokens + len(token_ids)`` tokens (a sliding-window layer: over its window).
    ``block_ids`` holds one table per KV cache group (``KVCacheManager.sliding_windows``); a
    sliding group's entries before its window are ``NULL_BLOCK`` (-1), which nothing reads.
    A decode with drafts ends ``token_ids`` with its ``num_draft_tokens`` draft tokens, and
    needs logits at each of its last ``1 + num_draft_tokens`` positions.
    """

    req_id: str
    token_ids: list[int]  # tokens to compute this step (a prefill chunk, or the one decode token)
    num_computed_tokens: int  # tokens already in the KV cache; the first new token's position
    block_ids: tuple[list[int], ...]  # per KV cache group, the whole block table (logical block i -> physical block)
    needs_logits: bool  # True when this step reaches the end of the request's known tokens
    num_draft_tokens: int = 0  # speculative tokens at the end of token_ids (not yet the request's)
    images: tuple[ImageInput, ...] = ()  # a prefill's: the request's images (the runner takes the rows it computes)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @property
    def num_logits(self) -> int:
        """Rows of logits this request gets: one per draft plus one, when it needs logits."""
        return 1 + self.num_draft_tokens if self.needs_logits else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """Built only by ``Scheduler.schedule()``; the runner reads it and never calls back."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops per-request state for these

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def num_logits(self) -> int:
        return sum(r.num_logits for r in self.scheduled)
