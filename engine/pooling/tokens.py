"""Pooling inputs tokenized in batches, each text cut before the tokenizer sees more of it than is kept.

A text longer than its token limit could hold is first cut at a whitespace (``_CHARS_PER_TOKEN``
characters a token, a bound few tokens pass): the tokens of text cut at a whitespace are a prefix of
the whole text's, so when the cut text still fills the limit the result is the same; when it does
not, the whole text is tokenized again. A page of a megabyte costs the tokenizer a few kilobytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import ParameterError, RequestRejected
from engine.pooling.model_config import PoolingConfig
from engine.pooling.params import PoolingParams

_CHARS_PER_TOKEN = 12  # a bound on the characters of one token, for the cut before tokenizing

EmbedInput = str | list[int]


@dataclass(frozen=True, slots=True)
class PoolingInput:
    """One input as the model reads it: token ids and, for a BERT pair, their segment ids (None: all 0)."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(frozen=True, eq=False)
class PoolingTokenizer:
    """Embedding and scoring inputs -> ``PoolingInput``s; one thread at a time (the tokenizer's rule)."""

    tokenizer: Any
    config: PoolingConfig

    def check(self, params: PoolingParams | None) -> PoolingParams:
        """``params`` (None = the defaults), checked against the model.

        Raises:
            ParameterError: not a PoolingParams; ``dimensions`` on a model that declares no Matryoshka
                sizes, or not one of those it declares, or over its embedding size.
        """
        if params is None:
            return PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ParameterError("pooling_params", f"pooling_params must be a PoolingParams; got {type(params).__name__}")
        dims, allowed = params.dimensions, self.config.matryoshka_dimensions
        if dims is not None:
            if allowed is None:
                raise ParameterError.about("dimensions", "is not served: the model declares no Matryoshka dimensions")
            if dims > self.config.hidden_size or (allowed and dims not in allowed):
                sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {self.config.hidden_size}"
                raise ParameterError.about("dimensions", f"must be one of the model's sizes ({sizes}); got {dims}")
        return params

    def limit(self, params: PoolingParams) -> int | None:
        """Most tokens kept of one input; None: no truncation (a longer one is refused)."""
        if params.truncate_prompt_tokens is None:
            return None
        if params.truncate_prompt_tokens == -1:
            return self.config.max_length
        return min(params.truncate_prompt_tokens, self.config.max_length)

    def prefix(self, params: PoolingParams) -> str:
        """The prompt prefix ``params.prompt_name`` (or the model's default) names; "" without one."""
        name = params.prompt_name or self.config.default_prompt_name
        if name is None:
            return ""
        if name not in self.config.prompts:
            known = ", ".join(sorted(self.config.prompts)) or "none"
            raise ParameterError.about("prompt_name", f"{name!r} is not one of the model's prompts ({known})")
        return self.config.prompts[name]

    def embed_inputs(self, prompts: Sequence[EmbedInput], params: PoolingParams) -> list[PoolingInput]:
        """Each prompt (text, or token ids read as they are) tokenized with its prefix, cut to the limit.

        Raises:
            RequestRejected: an empty prompt, token ids outside the vocabulary; one over the model's length with
                truncation off.
        """
        limit = self.limit(params)
        prefix = self.prefix(params)
        texts = {i: prefix + p for i, p in enumerate(prompts) if isinstance(p, str)}
        for i, p in enumerate(prompts):
            if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
                raise ParameterError("prompt", f"prompt {i} must be a string or a list of token ids")
            if len(p) == 0:
                raise RequestRejected(f"prompt {i} is empty")
            if not isinstance(p, str) and not all(0 <= t < self.config.vocab_size for t in p):
                raise RequestRejected(f"prompt {i}'s token ids must be in the vocabulary [0, {self.config.vocab_size})")
        encoded = self._encode(list(texts.values()), None, limit)
        by_index = dict(zip(texts, encoded))
        inputs = [by_index[i] if i in by_index else PoolingInput(list(p)[: limit or len(p)]) for i, p in enumerate(prompts)]
        self._check_lengths(inputs, "prompt")
        return inputs

    def pair_inputs(self, query: str, documents: Sequence[str], params: PoolingParams) -> list[PoolingInput]:
        """(query, document) pairs as a cross-encoder reads them, cut longest-first to the limit.

        Raises:
            RequestRejected: an empty query or document; a pair over the model's length with truncation off.
        """
        if not isinstance(query, str) or not query:
            raise RequestRejected("query must be a non-empty string", param="query")
        for i, d in enumerate(documents):
            if not isinstance(d, str) or not d:
                raise RequestRejected(f"document {i} must be a non-empty string", param="documents")
        inputs = self._encode([query] * len(documents), list(documents), self.limit(params))
        self._check_lengths(inputs, "documents")
        return inputs

    def _encode(self, texts: list[str], pairs: list[str] | None, limit: int | None) -> list[PoolingInput]:
        if not texts:
            return []
        bound = None if limit is None else limit * _CHARS_PER_TOKEN
        cut_texts = [_cut(t, bound) for t in texts]
        cut_pairs = None if pairs is None else [_cut(t, bound) for t in pairs]
        inputs = self._call(cut_texts, cut_pairs, limit)
        # NOTE: a text cut short of the limit lost tokens it would have kept: tokenize it whole
        redo = [
            i for i, item in enumerate(inputs)
            if (limit is None or len(item.token_ids) < limit)
            and (cut_texts[i] is not texts[i] or (pairs is not None and cut_pairs[i] is not pairs[i]))
        ]  # fmt: skip
        if redo:
            whole = self._call([texts[i] for i in redo], None if pairs is None else [pairs[i] for i in redo], limit)
            for i, item in zip(redo, whole):
                inputs[i] = item
        return inputs

    def _call(self, texts: list[str], pairs: list[str] | None, limit: int | None) -> list[PoolingInput]:
        truncation: Any = "longest_first" if limit is not None else False
        batch = self.tokenizer(
            texts, pairs, truncation=truncation, max_length=limit, return_attention_mask=False,
            return_token_type_ids=pairs is not None,
        )  # fmt: skip
        types = batch["token_type_ids"] if pairs is not None else [None] * len(texts)
        return [PoolingInput(ids, tt) for ids, tt in zip(batch["input_ids"], types)]

    def _check_lengths(self, inputs: list[PoolingInput], param: str) -> None:
        for i, item in enumerate(inputs):
            if len(item.token_ids) > self.config.max_length:
                raise RequestRejected(
                    f"{param} {i} has {len(item.token_ids)} tokens, over the model's {self.config.max_length} "
                    "(truncate_prompt_tokens=None turns truncation off)",
                    param=param,
                )


def _cut(text: str, bound: int | None) -> str:
    """``text`` up to the last whitespace within ``bound`` characters; itself when shorter or without one."""
    if bound is None or len(text) <= bound:
        return text
    end = max(text.rfind(" ", 0, bound), text.rfind("\n", 0, bound))
    return text[:end] if end > 0 else text
