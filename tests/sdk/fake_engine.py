"""A fake AsyncEngine with the real one's interface: scripted output, block and prefix-cache bookkeeping."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineOverloaded, RequestRejected
from engine.outputs import Delta, Usage
from engine.sampling_params import SamplingParams

SCRIPT = " The quick brown fox jumps over the lazy dog. It was a sunny day and the secret code is 42."


@dataclass
class PinnedPrefix:
    pin_id: str
    num_tokens: int
    num_cached_tokens: int


class FakeAsyncEngine:
    """Emits SCRIPT token by token; tracks blocks per request and a prefix cache of full blocks."""

    def __init__(self, tokenizer: Any, block_size: int = 4, max_model_len: int = 512, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.step_delay = step_delay
        self.script_ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.cached: set[tuple[int, ...]] = set()  # full-block prefixes computed so far
        self.pins: dict[str, list[int]] = {}
        self.blocks_in_use: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.requests_seen: list[str] = []
        self.overloaded_times = 0  # the next N generate() calls raise EngineOverloaded
        self.counters = dict(prefix_cache_queries=0, prefix_cache_hits=0, prompt_tokens_computed=0, generation_tokens=0)
        self.accepts_images = False  # a LLaVA-like stand-in when True: "<image>" stands for an image
        self.image_placeholder = "<image>"
        self.images_seen: list[list[Any]] = []  # per multimodal request, the PIL images it was given
        self._pin_ids = itertools.count()

    def _num_cached(self, ids: list[int]) -> int:
        n = 0
        while n + self.block_size < len(ids) and tuple(ids[: n + self.block_size]) in self.cached:
            n += self.block_size
        return n

    def _cache(self, ids: list[int]) -> None:
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            self.cached.add(tuple(ids[:end]))

    async def stream(
        self, prompt: str | list[int] | dict[str, Any], params: SamplingParams, request_id: str | None = None,
        priority: int = 0, cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        request_id = request_id or f"fake-{len(self.requests_seen)}"
        if isinstance(prompt, dict):  # vLLM's multimodal form, as the real engine takes it
            if not self.accepts_images:
                raise RequestRejected("multi_modal_data.image: this model takes no images")
            self.images_seen.append(list(prompt["multi_modal_data"]["image"]))
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) >= self.max_model_len:
            raise RequestRejected(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if self.overloaded_times:
            self.overloaded_times -= 1
            raise EngineOverloaded("queue full")
        self.requests_seen.append(request_id)
        num_cached = self._num_cached(ids)
        self.counters["prefix_cache_queries"] += len(ids)
        self.counters["prefix_cache_hits"] += num_cached
        self.counters["prompt_tokens_computed"] += len(ids) - num_cached
        self._cache(ids)
        self.blocks_in_use[request_id] = -(-len(ids) // self.block_size)
        out_ids: list[int] = []
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        finish = None
        num_sent_chars = 0
        try:
            while True:
                await asyncio.sleep(self.step_delay)
                if request_id in self.aborted:
                    return
                out_ids.append(self.script_ids[len(out_ids) % len(self.script_ids)])
                self.counters["generation_tokens"] += 1
                self.blocks_in_use[request_id] = -(-(len(ids) + len(out_ids)) // self.block_size)
                text = self.tokenizer.decode(out_ids)
                finish = None
                for stop in params.stop:
                    if (cut := text.find(stop)) >= 0:
                        text, finish = text[:cut], "stop"
                        break
                if finish is None and len(out_ids) >= max_tokens:
                    finish = "length"
                delta = Delta(request_id, 0, text[num_sent_chars:], out_ids[-1:], finish_reason=finish)
                num_sent_chars = max(num_sent_chars, len(text))
                if len(out_ids) == 1:
                    delta.prompt_token_ids, delta.num_cached_tokens = ids, num_cached
                if finish is not None:
                    delta.usage = Usage(len(ids), len(out_ids), num_cached)
                yield delta
                if finish is not None:
                    return
        finally:
            if finish is None:  # closed or aborted before the end: the real engine aborts too
                self.aborted.add(request_id)
            del self.blocks_in_use[request_id]

    async def abort(self, request_id: str) -> None:
        if request_id in self.blocks_in_use:
            self.aborted.add(request_id)

    async def pin_prefix(self, prompt: str | list[int], cache_salt: str | None = None) -> PinnedPrefix:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        num_cached = self._num_cached(ids)
        self._cache(ids)
        pin_id = f"pin-{next(self._pin_ids)}"
        self.pins[pin_id] = ids
        return PinnedPrefix(pin_id, len(ids), num_cached)

    async def unpin_prefix(self, pin_id: str) -> None:
        self.pins.pop(pin_id, None)

    def stats(self) -> dict[str, Any]:
        used = sum(self.blocks_in_use.values())
        return dict(
            num_requests_running=len(self.blocks_in_use),
            num_requests_waiting=0,
            kv_blocks_total=1024,
            kv_blocks_used=used,
            kv_blocks_cached=len(self.cached),
            num_preemptions=0,
            **self.counters,
        )

    async def shutdown(self) -> None:
        pass

