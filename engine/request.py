"""Request: one sequence's inputs, token bookkeeping and status; the scheduler is its only writer."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.multimodal.inputs import ImageInput
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

    NOTE: one writer per field. The constructor sets the inputs, which never change; the
    scheduler alone writes ``status``, ``all_token_ids``, ``num_computed_tokens``,
    ``num_cached_tokens``, ``num_preemptions`` and the scheduling times
    (``first_scheduled_time``, ``preempted_seconds``, ``preempted_at``). What other parts keep per request (the
    output processor's text and timings, the sampler's generator and penalty counts) they
    keep in their own tables, keyed by ``req_id``.
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
        "images",
        "mm_spans",
        "tenant",
        "weight",
        "stop_token_ids",
        "max_num_tokens",
        "keep_blocks",
        "parent_id",
        "index",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "first_scheduled_time",
        "preempted_seconds",
        "preempted_at",
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
        images: tuple[ImageInput, ...] = (),
        tenant: str | None = None,
        weight: float = 1.0,
        stop_token_ids: frozenset[int] = frozenset(),
        max_num_tokens: int | None = None,
        keep_blocks: bool = False,
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
        # NOTE: the prompt's images, by position: the runner fills their rows, their hashes key their blocks.
        self.images = images
        self.mm_spans = tuple((image.offset, image.length, image.hash) for image in images)
        # NOTE: who the request is for and its share of the token budget (engine.core.fair_share).
        self.tenant = tenant
        self.weight = weight
        # NOTE: the ids that end the request: stop_token_ids plus EOS unless ignore_eos.
        self.stop_token_ids = stop_token_ids
        # NOTE: the hard cap on prompt + output tokens (max_model_len, and what the KV cache holds).
        self.max_num_tokens = max_num_tokens
        # A pinned prefix: its blocks outlive the request when it finishes normally.
        self.keep_blocks = keep_blocks
        self.parent_id = parent_id if parent_id is not None else req_id
        self.index = index  # which of its parent's n completions
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        # NOTE: perf_counter seconds, like arrival_time: first admission into the batch, the
        # time spent preempted (waiting to be readmitted), and when the current preemption began.
        self.first_scheduled_time: float | None = None
        self.preempted_seconds = 0.0
        self.preempted_at: float | None = None

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

    def is_stop_token(self, token_id: int, num_output_tokens: int) -> bool:
        """Whether ``token_id``, as output token number ``num_output_tokens``, ends the request.

        The one rule for stop tokens (EOS and ``stop_token_ids``): they count from ``min_tokens`` on.
        """
        return num_output_tokens >= self.sampling_params.min_tokens and token_id in self.stop_token_ids

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
