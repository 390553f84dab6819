"""SamplingParams: the per-request generation knobs, declared once and validated on construction.

Each field is a knob (``engine.knobs``): its help and bounds are declared here and nowhere
else. The SDK's request types, the server's wire models and the framework adapters derive
their sampling fields from ``knobs_of(SamplingParams)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.errors import ParameterError
from engine.knobs import check_knobs, knob
from engine.structured_output.params import StructuredOutput

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
        ParameterError: a field is of the wrong type, not finite, or outside its limit; the
            message names the field and the limit, ``param`` the field.
    """

    max_tokens: int | None = knob(256, "Most tokens to generate; None = until max_model_len.", ge=1, le=MAX_TOKENS_LIMIT)
    min_tokens: int = knob(
        0, "EOS and stop_token_ids are suppressed until this many tokens exist (at most max_tokens).",
        ge=0, le=MAX_TOKENS_LIMIT,
    )  # fmt: skip
    temperature: float = knob(1.0, "Sampling temperature; 0 = greedy.", ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = knob(1.0, "Nucleus sampling: the smallest set of tokens whose mass reaches top_p; 1 = off.", gt=0.0, le=1.0)
    top_k: int = knob(0, "Sample among the k most likely tokens; 0 (or -1) = off.", ge=-1, le=MAX_TOKENS_LIMIT)
    min_p: float = knob(0.0, "Drop tokens below min_p times the most likely token's probability; 0 = off.", ge=0.0, le=1.0)
    repetition_penalty: float = knob(
        1.0, "Penalty on tokens of the prompt and the output so far; 1 = off.", gt=0.0, le=MAX_REPETITION_PENALTY
    )
    presence_penalty: float = knob(
        0.0, "Subtracted from the logits of tokens already in the output.", ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY
    )
    frequency_penalty: float = knob(
        0.0, "Subtracted per occurrence in the output so far.", ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY
    )
    seed: int | None = knob(None, "Per-request seed: the same seed gives the same output whatever else is in the batch.", ge=0, le=MAX_SEED)
    stop: tuple[str, ...] = knob(
        (), "Stop strings: the text ends right before the first one, which is not part of the output.",
        max_items=MAX_STOP_STRINGS, max_chars=MAX_STOP_STRING_CHARS,
    )  # fmt: skip
    stop_token_ids: tuple[int, ...] = knob(
        (), "Token ids that end the completion (besides EOS unless ignore_eos).", max_items=MAX_STOP_TOKEN_IDS, item_ge=0
    )
    ignore_eos: bool = knob(False, "Go on generating past EOS.")
    logprobs: int | None = knob(
        None, "Return each generated token's logprob and its k most likely candidates; None = none.", ge=0, le=MAX_LOGPROBS
    )
    n: int = knob(1, "Completions of the prompt; they share its KV blocks.", ge=1, le=MAX_N)
    # NOTE: not a knob (no bounds to derive): the SDK and the server map their own forms
    # (response_format, guided_*) onto it.
    structured_output: StructuredOutput | None = None  # a constraint the text is guaranteed to meet

    def __post_init__(self) -> None:
        check_knobs(self)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError("min_tokens", f"min_tokens must be in [0, {self.max_tokens}] (max_tokens); got {self.min_tokens}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ParameterError(
                    "structured_output",
                    f"structured_output must be a StructuredOutput; got {type(self.structured_output).__name__}",
                )
            if self.min_tokens:
                # NOTE: a finished structure allows only EOS, which min_tokens would forbid.
                raise ParameterError("min_tokens", "min_tokens cannot be combined with structured_output")
        if self.top_k == -1:
            self.top_k = 0

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

    def for_completion(self, index: int) -> SamplingParams:
        """The params of completion ``index`` of ``n``: one completion, seed ``seed + index`` (wrapping).

        The one seed rule for ``n`` > 1, whichever route the request came by.
        """
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)
