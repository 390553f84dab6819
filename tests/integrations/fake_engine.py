"""A scripted stand-in for ``engine.AsyncEngine``: the same interface, deterministic tokens, fault switches.

The real engine serves most server tests; this one makes the rare paths (overload, an engine
fault mid-stream, a slow queue) exact and instant.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.errors import EngineError, EngineOverloaded, RequestRejected
from engine.metrics import Histogram
from engine.outputs import Delta, TokenLogprob, TopLogprob, Usage


class FakeEngine:
    """Emits ``params.max_tokens`` copies of the token " ok" (one per ``delay`` seconds) in each of ``params.n`` completions.

    Args:
        tokenizer: a real tokenizer (chat templates and prompt lengths are real).
        delay: seconds per generated token.
        overloaded: every ``generate`` raises ``EngineOverloaded``.
        fail_after: raise ``EngineError`` after this many tokens.
    """

    model_name = "fake-model"
    max_model_len = 256

    def __init__(self, tokenizer: Any, *, delay: float = 0.0, overloaded: bool = False, fail_after: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.delay = delay
        self.overloaded = overloaded
        self.fail_after = fail_after
        self.running: dict[str, asyncio.Event] = {}
        self.num_finished = 0
        self.is_running = True
        self.token_id = tokenizer.encode(" ok", add_special_tokens=False)[0]
        self.accepts_images = False  # a LLaVA-like stand-in when True: "<image>" stands for an image
        self.image_placeholder = "<image>"
        self.images_seen: list[list[Any]] = []  # per multimodal request, the PIL images it was given

    async def stream(
        self, prompt: Any, params: Any, request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
        tenant: str | None = None, weight: float = 1.0,
    ):  # fmt: skip
        if isinstance(prompt, dict):  # vLLM's multimodal form, as the real engine takes it
            if not self.accepts_images:
                raise RequestRejected("multi_modal_data.image: this model takes no images")
            self.images_seen.append(list(prompt["multi_modal_data"]["image"]))
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        if not ids or len(ids) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(ids)} tokens does not fit max_model_len {self.max_model_len}")
        if self.overloaded:
            raise EngineOverloaded("admission queue is full (max_queued_requests)")
        aborted = self.running[request_id] = asyncio.Event()
        top = [TopLogprob(" ok", -0.5, self.token_id, 1), TopLogprob("<x>", -1.5, 0, 2)]
        try:
            for i in range(params.max_tokens):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if aborted.is_set():
                    for delta in self._deltas(request_id, ids, i == 0, i, [], None, "abort", params.n):
                        yield delta
                    return
                if self.fail_after is not None and i >= self.fail_after:
                    raise EngineError("the step failed")
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [TokenLogprob(" ok", -0.5, top[: params.logprobs], self.token_id, 1)]
                finish = "length" if i == params.max_tokens - 1 else None
                for delta in self._deltas(request_id, ids, i == 0, i + 1, [self.token_id], logprobs, finish, params.n):
                    yield delta
        finally:
            del self.running[request_id]
            self.num_finished += 1

    def _deltas(
        self, request_id: str, prompt_ids: list[int], first: bool, num_tokens: int, new: list[int], logprobs: Any,
        finish: str | None, n: int,
    ) -> list[Delta]:  # fmt: skip
        """One step's delta per completion: the new " ok", the prompt on the request's first, usage on its last."""
        deltas = [Delta(request_id, i, " ok" * len(new), list(new), logprobs, finish) for i in range(n)]
        if first:
            deltas[0].prompt_token_ids, deltas[0].num_cached_tokens = prompt_ids, 0
        if finish is not None:
            deltas[-1].usage = Usage(len(prompt_ids), n * num_tokens, 0)
        return deltas

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running[request_id].set()

    def stats(self) -> dict[str, Any]:
        ttft = Histogram()
        for value in (0.004, 0.2, 3.0):
            ttft.observe(value)
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": 0,
            "kv_blocks_total": 8,
            "kv_blocks_used": len(self.running),
            "kv_blocks_cached": 2,
            "prefix_cache_queries": 40,
            "prefix_cache_hits": 10,
            "prompt_tokens_computed": 30,
            "generation_tokens": 7,
            "num_preemptions": 1,
            "ttft_seconds": ttft,
            "itl_seconds": Histogram().snapshot(),
        }

    async def shutdown(self) -> None:
        self.is_running = False
