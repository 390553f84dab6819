"""SamplingParams: the per-request generation knobs, validated once on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TOKENS_LIMIT = 1 << 20
MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_ABS_PENALTY = 2.0  # presence / frequency, the OpenAI range
MAX_SEED = (1 << 63) - 1
SAMPLING_EPS = 1e-5  # temperatures below this are greedy


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completion(s).

    Validation happens in ``__post_init__`` and costs microseconds whatever is passed:
    every limit is checked by size before anything is iterated or copied.

    Raises:
        ValueError: a field is of the wrong type, not finite, or outside its limit; the
            message names the field and the limit.
    """

    max_tokens: int | None = 256  # None = until max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens exist
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # over prompt and output tokens; 1 = off
    presence_penalty: float = 0.0  # over output tokens; [-2, 2]
    frequency_penalty: float = 0.0  # over output tokens; [-2, 2]
    seed: int | None = None  # same seed, same output whatever else is in the batch
    stop: tuple[str, ...] = ()  # a str is accepted and becomes a 1-tuple; never in the output text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = the sampled token's logprob plus the top k
    n: int = 1  # completions per prompt; they share the prompt's KV blocks

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens or MAX_TOKENS_LIMIT)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        _check_int("top_k", self.top_k, 0, MAX_TOKENS_LIMIT)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]; got 0")
        _check_float("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool; got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_int("n", self.n, 1, MAX_N)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}]; got {_short(value)}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number; got {type(value).__name__}")
    # NOTE: an int compares exactly, however large; math.isfinite would overflow converting it.
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}]; got {_short(value)}")


def _short(value: int | float) -> str:
    """A value for an error message: huge ints are not spelled out (nor echoed back to a client)."""
    return str(value) if not isinstance(value, int) or abs(value) < 10**30 else "a number out of range"


def _check_stop(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (tuple, list)):
        raise ValueError(f"stop must be a str or a list of str; got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds at most {MAX_STOP_STRINGS} strings; got {len(stop)}")
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must hold only str; got {type(s).__name__}")
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters each; got {len(s)}"
            )
    return tuple(stop)


def _check_stop_token_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, (tuple, list)):
        raise ValueError(f"stop_token_ids must be a list of int; got {type(ids).__name__}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids; got {len(ids)}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"stop_token_ids must hold integers >= 0; got {i!r}")
    return tuple(ids)
