"""Request: one sequence's token bookkeeping and status; the scheduler is its only writer."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status after ``PREEMPTED`` is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "abort",
}


class Request:
    """One sequence: prompt, generated tokens, how many of them sit in the KV cache.

    ``all_token_ids`` is prompt + output and only grows; ``num_computed_tokens`` counts the
    tokens whose K/V are cached (reset to 0 on preemption, which recomputes).
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "all_token_ids",
        "sampling_params",
        "priority",
        "arrival_seq",
        "arrival_time",
        "cache_salt",
        "stop_token_ids",
        "max_num_tokens",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "keep_blocks",
        "first_token_time",
        "last_token_time",
        "detokenizer",
        "sampling_state",
        "logprobs",
        "parent_id",
        "index",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        arrival_seq: int = 0,
        cache_salt: str | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        max_num_tokens: int | None = None,
        parent_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.arrival_time = time.perf_counter()
        self.cache_salt = cache_salt
        # NOTE: the ids that end the request: stop_token_ids plus EOS unless ignore_eos.
        self.stop_token_ids = stop_token_ids
        # NOTE: the hard cap on prompt + output tokens (max_model_len, and what the KV cache holds).
        self.max_num_tokens = max_num_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.keep_blocks = False  # a pinned prefix: its blocks outlive the request
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.detokenizer: Any = None  # set by the engine
        self.sampling_state: Any = None  # per-request sampler state (generator, penalty counts)
        self.logprobs: list[dict[int, Any]] | None = (
            [] if sampling_params.logprobs is not None else None
        )
        self.parent_id = parent_id if parent_id is not None else req_id
        self.index = index

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
