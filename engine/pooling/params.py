"""PoolingParams: what a caller sets per embedding or scoring request (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParameterError


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """Per-request settings of an embedding or a score; None = the model's own (from its files).

    Attributes:
        dimensions: keep the first ``dimensions`` of each embedding (Matryoshka truncation, then
            normalization); refused for a model whose config does not declare it
            (``is_matryoshka`` or ``matryoshka_dimensions``, as vLLM reads them).
        normalize: L2-normalize each embedding; None = as the model's ``modules.json`` says
            (a ``Normalize`` module), or True for a decoder embedding model.
        truncate_prompt_tokens: most tokens kept of each input, special tokens included, cut at
            the end as sentence-transformers cuts (only what is kept is tokenized); -1 = the
            model's max length (the default); None = no truncation: a longer input is refused.
        use_activation: for a score, the sigmoid of a one-label cross-encoder's logit (as vLLM
            and sentence-transformers' ``CrossEncoder`` give it); False = the raw logit.
        prompt_name: the key of a prompt prefix in the model's ``config_sentence_transformers.json``
            (``"query"``, ``"document"``, ...); None = its ``default_prompt_name``, if any.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = -1
    use_activation: bool = True
    prompt_name: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ParameterError.about("dimensions", f"must be an integer >= 1; got {self.dimensions!r}")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or not (keep == -1 or keep >= 2)):
            raise ParameterError.about("truncate_prompt_tokens", f"must be -1 (the model's max length) or >= 2; got {keep!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParameterError.about("normalize", f"must be a bool or None; got {self.normalize!r}")
