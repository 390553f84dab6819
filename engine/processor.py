"""The intake: what a caller sends -> the engine's ``ProcessedRequest``, once, before the request is queued.

As vLLM v1's input ``Processor`` runs before ``EngineCore``: the prompt is tokenized (its images'
placeholders expanded and the images preprocessed, ``engine.multimodal.inputs``) and checked
against the model and the KV cache, the sampling params and the per-request options are checked,
and a structured-output constraint is compiled. ``Engine.add_request`` runs it on the engine's
thread; ``AsyncEngine`` runs it on the caller's (images on a worker thread, grammars on the
compiler's threads, never on the step loop). What it returns is queued as it is: nothing
downstream checks it again, only whether its request id is free.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Required, TypedDict

from engine.errors import ParameterError, RequestRejected, UnsupportedTask
from engine.multimodal.inputs import (
    ImageInput, ImagePrompts, ProcessedPrompt, attach_images, process_prompt, split_prompt,
)
from engine.request_options import RequestOptions, TenantOptions
from engine.sampling_params import SamplingParams
from engine.structured_output.compiler import MAX_COMPILE_SECONDS, GrammarCompiler, too_slow
from engine.structured_output.params import StructuredOutput


class MultiModalData(TypedDict, total=False):
    """A prompt's images: one PIL image or a list, in the order of their placeholders."""

    image: Any


class TextPrompt(TypedDict, total=False):
    """Text holding the model's image placeholder (``Engine.image_placeholder``) once per image, and the images."""

    prompt: Required[str]
    multi_modal_data: MultiModalData


class TokensPrompt(TypedDict, total=False):
    """Token ids holding the image token once per image (or each image's run, expanded), and the images."""

    prompt_token_ids: Required[list[int]]
    multi_modal_data: MultiModalData


# text, token ids, or either with images (vLLM's input form; ``engine.multimodal``)
Prompt = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A request as the engine queues it: checked, tokenized, its images preprocessed, its constraint compiled.

    Attributes:
        request_id: the caller's id; None: the engine names it when it queues it.
        prompt_token_ids: the prompt, each image's placeholder expanded to the image's tokens.
        params: how to sample.
        images: the prompt's images, by position.
        priority: smaller runs first.
        cache_salt: requests with different salts never share KV blocks.
        tenant: whose request it is, for the fair share; None = one shared tenant.
        weight: the tenant's share.
        grammar: ``params.structured_output``, compiled; None without one.
        pin: a prefix pin (``Engine.pin_prefix``): one greedy token, its blocks kept once computed.
    """

    request_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    images: tuple[ImageInput, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    weight: float = 1.0
    grammar: Any = None
    pin: bool = False


@dataclass(frozen=True, eq=False)
class Processor:
    """Turns a caller's prompt, params and options into a ``ProcessedRequest``; holds only immutable settings.

    Attributes:
        tokenizer: the model's Hugging Face tokenizer (one thread at a time: ``for_callers`` gives
            other threads a processor of their own).
        vocab_size: the model's vocabulary (columns of its logits).
        max_model_len: the longest sequence the model takes.
        max_num_tokens: the most tokens of one request the whole KV cache holds.
        image_prompts: the model's image inputs; None for a text-only model.
        grammars: the compiler of structured-output constraints (thread-safe).
        model_name, task: the model's name and what it does; a pooling model ("embed", "classify")
            refuses every generation request.
    """

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_num_tokens: int
    image_prompts: ImagePrompts | None
    grammars: GrammarCompiler
    model_name: str = ""
    task: str = "generate"

    def for_callers(self) -> Processor:
        """The same intake for callers' threads: a tokenizer of its own, the rest shared.

        NOTE: the engine's thread decodes with its tokenizer while callers encode, and a Rust
        tokenizer must not be borrowed by two threads at once.
        """
        return replace(self, tokenizer=copy.deepcopy(self.tokenizer))

    # ---------------------------------------------------------------------------- requests

    def process(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0,
        cache_salt: str | None = None, *, tenant: str | None = None, weight: float = 1.0, pin: bool = False,
    ) -> ProcessedRequest:  # fmt: skip
        """The request, checked and processed on this thread (the constraint waits for the compiler's threads).

        Args:
            request_id: unique among unfinished requests (the engine checks that); None = the engine names it.
            prompt: text, token ids, or either with images (``TextPrompt``, ``TokensPrompt``).
            params: how to sample; None = ``SamplingParams()``. Not used for a pin.
            priority, cache_salt: ``RequestOptions``.
            tenant, weight: ``TenantOptions``.
            pin: a prefix pin: computed by one greedy token, its blocks kept.

        Raises:
            RequestRejected: the prompt can never be served (``validate_prompt``), or its images cannot
                (``process_prompt``).
            ParameterError: ``params`` is not a SamplingParams; ``request_id``, ``priority``, ``cache_salt``,
                ``tenant`` or ``weight`` is of the wrong type or out of bounds; the structured-output
                constraint does not compile.
        """
        params = self._check(request_id, params, priority, cache_salt, tenant, weight, pin)
        processed = self.process_prompt(prompt)
        self.validate_prompt(processed.prompt_token_ids)
        grammar = None if params.structured_output is None else self.grammars.compile(params.structured_output)
        return ProcessedRequest(
            request_id, processed.prompt_token_ids, params, processed.images, priority, cache_salt, tenant, weight,
            grammar, pin,
        )  # fmt: skip

    async def process_async(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0,
        cache_salt: str | None = None, *, tenant: str | None = None, weight: float = 1.0, pin: bool = False,
    ) -> ProcessedRequest:  # fmt: skip
        """``process`` for an asyncio caller: images are preprocessed on a worker thread and the constraint is
        compiled on the compiler's threads, off the event loop. Arguments and errors as ``process``."""
        params = self._check(request_id, params, priority, cache_salt, tenant, weight, pin)
        text, images = split_prompt(prompt)
        token_ids = tokenize(self.tokenizer, text)
        if images and self.image_prompts is not None:
            processed = await asyncio.to_thread(attach_images, token_ids, images, self.image_prompts)
        else:
            processed = attach_images(token_ids, images, self.image_prompts)
        self.validate_prompt(processed.prompt_token_ids)
        grammar = None if params.structured_output is None else await self._compile(params.structured_output)
        return ProcessedRequest(
            request_id, processed.prompt_token_ids, params, processed.images, priority, cache_salt, tenant, weight,
            grammar, pin,
        )  # fmt: skip

    def _check(
        self, request_id: str | None, params: SamplingParams | None, priority: int, cache_salt: str | None,
        tenant: str | None, weight: float, pin: bool,
    ) -> SamplingParams:  # fmt: skip
        """The request's sampling params (a pin's own); raises ``ParameterError`` for a bad option."""
        if self.task != "generate":
            raise UnsupportedTask(self.model_name, "generate", self.task)
        params = SamplingParams(max_tokens=1, temperature=0.0) if pin else check_params(params)
        RequestOptions(request_id, priority, cache_salt)
        TenantOptions(tenant, weight)
        return params

    async def _compile(self, constraint: StructuredOutput) -> Any:
        """A structured-output constraint compiled on the compiler's threads: never on the caller's loop."""
        future = asyncio.wrap_future(self.grammars.submit(constraint))
        try:
            return await asyncio.wait_for(future, MAX_COMPILE_SECONDS)
        except TimeoutError:
            raise too_slow(constraint) from None

    # ---------------------------------------------------------------------------- prompts

    def process_prompt(self, prompt: Prompt) -> ProcessedPrompt:
        """A prompt's token ids and its images, preprocessed (``engine.multimodal.inputs.process_prompt``).

        Raises:
            RequestRejected: a malformed prompt; images for a text-only model, a non-PIL image, or images that do
                not match the placeholders (field ``multi_modal_data.image``).
        """
        return process_prompt(prompt, functools.partial(tokenize, self.tokenizer), self.image_prompts)

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Checks a prompt can ever be served.

        Raises:
            RequestRejected: Empty, a token id outside the vocabulary, too long for
                ``max_model_len`` or for the whole KV cache.
        """
        num = len(prompt_token_ids)
        if num == 0:
            raise RequestRejected("prompt is empty")
        # NOTE: sizes first, so an absurdly long prompt is turned away without reading it.
        if num >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {num} tokens; max_model_len is {self.max_model_len} (room for one generated token needed)"
            )
        if num >= self.max_num_tokens:
            raise RequestRejected(
                f"prompt has {num} tokens; the KV cache holds at most {self.max_num_tokens} tokens of one request"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise RequestRejected("prompt token ids must be integers")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in the vocabulary [0, {self.vocab_size})")


def check_params(params: SamplingParams | None) -> SamplingParams:
    """``params``, or the defaults for None.

    Raises:
        ParameterError: ``params`` is not a SamplingParams.
    """
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ParameterError("params", f"params must be a SamplingParams; got {type(params).__name__}")
    return params


def tokenize(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: a str is encoded (with the tokenizer's special tokens), ids pass through.

    Raises:
        RequestRejected: ``prompt`` is neither a str nor a list of ids.
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise RequestRejected(f"prompt must be a str or a list of token ids; got {type(prompt).__name__}")
    return list(prompt)
