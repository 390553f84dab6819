"""SpeculativeConfig: the speculative-decoding settings, in vLLM's ``speculative_config`` shape."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParameterError
from engine.knobs import check_knobs, knob

MAX_SPECULATIVE_TOKENS = 16  # drafts verified per request and step
MAX_PROMPT_LOOKUP = 64  # longest n-gram looked up


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed; ``EngineConfig.speculative_config`` takes one, or the same as a dict.

    Raises:
        ParameterError: a field outside its bounds (``param`` is ``speculative_config.<field>``), or
            ``prompt_lookup_min`` above ``prompt_lookup_max``.
    """

    mode: str = knob(
        "auto",
        "When drafts are proposed: auto = per step, only for requests whose measured acceptance pays for the "
        "drafts' share of the step's measured cost (on at small batches, off at large ones); always = every step "
        "that finds drafts (each request still backs off after rejections).",
        choices=("auto", "always"),
    )
    method: str = knob("ngram", "How drafts are proposed: ngram = prompt lookup in the request's own tokens.",
                       choices=("ngram",))
    num_speculative_tokens: int = knob(3, "Drafts proposed per request and step.", ge=1, le=MAX_SPECULATIVE_TOKENS)
    prompt_lookup_max: int = knob(4, "Longest n-gram of the last tokens looked up.", ge=1, le=MAX_PROMPT_LOOKUP)
    prompt_lookup_min: int = knob(2, "Shortest n-gram of the last tokens looked up.", ge=1, le=MAX_PROMPT_LOOKUP)

    def __post_init__(self) -> None:
        try:
            check_knobs(self)
        except ParameterError as exc:
            raise ParameterError(f"speculative_config.{exc.param}", f"speculative_config.{exc}") from None
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ParameterError(
                "speculative_config.prompt_lookup_min",
                f"speculative_config.prompt_lookup_min must be <= prompt_lookup_max ({self.prompt_lookup_max}); "
                f"got {self.prompt_lookup_min}",
            )
