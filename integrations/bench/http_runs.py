"""The benchmark's HTTP client: workload turns as streaming chat requests to any OpenAI-compatible server.

Each request is ``POST /v1/chat/completions`` with the turn's system and user messages,
greedy, ``max_tokens``, ``ignore_eos`` (an extension ``paged serve`` and vLLM accept), and
``stream_options.include_usage``; nothing else server-specific is asked for or read. Timing
is the client's own, from just before the request is sent:

- TTFT: until the first event carrying content;
- ITL: between consecutive content events (a server that sends several tokens per event
  shows one gap for them);
- e2e: until the end of the stream.

Output tokens are the usage event's ``completion_tokens`` (the content events' count when the
server sends no usage), cached prompt tokens its ``prompt_tokens_details.cached_tokens``.

Three arrival patterns: every request at once (the in-process protocol), open-loop Poisson
arrivals at a rate (seeded), and a closed loop holding ``c`` requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from integrations.bench.report import RunResult, summarize
from integrations.errors import CommandError
from sdk.http_transport import sse_events

Turn = dict[str, str]
Progress = Callable[[int], None]


class ServerUnusable(CommandError):
    """The server cannot be benchmarked: unreachable, the key refused, no model, or the warm-up failed."""


@dataclass(frozen=True)
class Target:
    """Where requests go: ``base`` ends in ``/v1``."""

    base: str
    model: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Slo:
    """Latency bounds a request must meet to count as good (None = no bound); ITL is the request's mean gap."""

    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.itl_s, self.e2e_s))


@dataclass
class RequestRecord:
    """One request as the client saw it; ``error`` set when it did not finish."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    error: str | None = None

    def within(self, slo: Slo) -> bool:
        if self.error is not None or self.ttft_s is None or self.e2e_s is None:
            return False
        mean_itl = sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0
        return all(
            bound is None or value <= bound
            for value, bound in ((self.ttft_s, slo.ttft_s), (mean_itl, slo.itl_s), (self.e2e_s, slo.e2e_s))
        )


@dataclass
class LoadRun:
    """The records of one arrival pattern, in submission order, and its wall time."""

    load: str  # "all at once", "poisson 2 req/s", "concurrency 4"
    records: list[RequestRecord]
    wall_s: float
    rate: float | None = None
    concurrency: int | None = None

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    def to_run_result(self, name: str) -> RunResult:
        """The run as a row of the bench's results table."""
        ok = self.ok
        prompt = [r.num_prompt_tokens for r in ok]
        cached = [r.num_cached_tokens for r in ok]
        num_prompt = sum(p for p in prompt if p is not None)
        num_cached = None if None in cached or None in prompt else sum(cached)  # type: ignore[arg-type]
        failed = [r for r in self.records if r.error is not None]
        return RunResult(
            name=name,
            num_requests=len(ok),
            num_new_tokens=sum(r.num_output_tokens for r in ok),
            wall_s=self.wall_s,
            num_prompt_tokens=num_prompt,
            ttft_s=[r.ttft_s for r in ok if r.ttft_s is not None],
            itl_s=[gap for r in ok for gap in r.itl_s],
            prompt_tokens_computed=None if num_cached is None else num_prompt - num_cached,
            prefix_cache_hit_rate=num_cached / num_prompt if num_cached is not None and num_prompt else None,
            notes=f"{len(failed)} of {len(self.records)} requests failed, first: {failed[0].error}" if failed else "",
        )

    def summary(self, slo: Slo) -> dict[str, Any]:
        """The run's row of the report's ``http.runs``."""
        ok = self.ok
        tokens = sum(r.num_output_tokens for r in ok)
        within = sum(r.within(slo) for r in self.records) if slo.is_set else None
        return {
            "load": self.load,
            "rate": self.rate,
            "concurrency": self.concurrency,
            "num_requests": len(self.records),
            "num_failed": len(self.records) - len(ok),
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_s": summarize([gap for r in ok for gap in r.itl_s]),
            "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
            "slo_fraction": None if within is None else within / len(self.records),
            "goodput_rps": None if within is None or self.wall_s <= 0 else within / self.wall_s,
        }


def session(num_connections: int) -> aiohttp.ClientSession:
    """A client session that opens up to ``num_connections`` connections (aiohttp's default caps them at 100)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(num_connections, 1)), timeout=timeout)


async def resolve_target(
    client: aiohttp.ClientSession, base_url: str, api_key: str | None, model: str | None
) -> Target:
    """The server's ``/v1`` root, the model to ask for (``model``, else the first ``/v1/models`` lists) and headers.

    Raises:
        ServerUnusable: the server is unreachable, refuses the key, or lists no model.
    """
    root = base_url.rstrip("/")
    base = root if root.endswith("/v1") else root + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with client.get(base + "/models", headers=headers) as resp:
            if resp.status in (401, 403):
                hint = "the key was refused" if api_key else "it needs a key: pass --api-key or set PAGED_API_KEY"
                raise ServerUnusable(f"{base}/models answered {resp.status}: {hint}")
            if resp.status != 200:
                raise ServerUnusable(f"{base}/models answered {resp.status}: {(await resp.text())[:200]}")
            cards = (await resp.json(content_type=None)).get("data") or []
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise ServerUnusable(f"cannot reach {base}: {exc or type(exc).__name__}") from None
    if model is None:
        if not cards:
            raise ServerUnusable(f"{base}/models lists no model; pass --served-model-name")
        model = str(cards[0]["id"])
    return Target(base=base, model=model, headers=headers)


class StreamFailed(Exception):
    """A streamed request answered with an HTTP error status or an error event (the message says which)."""


async def stream_events(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The server-sent events of one streamed POST.

    Raises:
        StreamFailed: a status other than 200, or an event carrying ``error``.
    """
    async with client.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise StreamFailed(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for event in sse_events(resp):
            if "error" in event:
                raise StreamFailed(f"error event: {str(event['error'])[:200]}")
            yield event


async def send(
    client: aiohttp.ClientSession, target: Target, turn: Turn, max_tokens: int, progress: Progress = lambda n: None
) -> RequestRecord:
    """One streaming chat request, timed; a failure is recorded, never raised."""
    body = {
        "model": target.model,
        "messages": [{"role": "system", "content": turn["system"]}, {"role": "user", "content": turn["user"]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord()
    num_events = 0
    usage: dict[str, Any] | None = None
    start = last = time.perf_counter()
    try:
        async for event in stream_events(client, target.base + "/chat/completions", body, target.headers):
            usage = event.get("usage") or usage
            if not any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                continue
            now = time.perf_counter()
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - last)
            last = now
            num_events += 1
            progress(1)
    except StreamFailed as exc:
        record.error = str(exc)
        return record
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - start
    if record.ttft_s is None:
        record.error = "the stream ended without content"
    if usage:
        record.num_output_tokens = int(usage.get("completion_tokens") or num_events)
        record.num_prompt_tokens = usage.get("prompt_tokens")
        record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        record.num_output_tokens = num_events
    return record


async def warm_up(client: aiohttp.ClientSession, target: Target) -> None:
    """One short request unrelated to the workloads (its costs are not measured).

    Raises:
        ServerUnusable: it failed (the message is the server's answer).
    """
    record = await send(client, target, {"system": "Warm-up.", "user": "Hi"}, 2)
    if record.error is not None:
        raise ServerUnusable(f"{target.base}/chat/completions: the warm-up request failed: {record.error}")


async def at_once(
    client: aiohttp.ClientSession, target: Target, turns: Sequence[Turn], max_tokens: int, progress: Progress
) -> LoadRun:
    """Every request submitted at once, as the in-process protocol does."""
    start = time.perf_counter()
    records = await asyncio.gather(*(send(client, target, t, max_tokens, progress) for t in turns))
    return LoadRun("all at once", list(records), time.perf_counter() - start)


async def poisson(
    client: aiohttp.ClientSession,
    target: Target,
    turns: Sequence[Turn],
    max_tokens: int,
    rate: float,
    seed: int,
    progress: Progress,
) -> LoadRun:
    """Open loop: request ``i`` is sent at the ``i``-th arrival of a Poisson process of ``rate`` req/s, whatever
    is still in flight; the first at time 0."""
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in turns:
        delays.append(t)
        t += rng.expovariate(rate)
    start = time.perf_counter()

    async def one(turn: Turn, delay: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        return await send(client, target, turn, max_tokens, progress)

    records = await asyncio.gather(*(one(turn, d) for turn, d in zip(turns, delays)))
    return LoadRun(f"poisson {rate:g} req/s", list(records), time.perf_counter() - start, rate=rate)


async def closed_loop(
    client: aiohttp.ClientSession,
    target: Target,
    turns: Sequence[Turn],
    max_tokens: int,
    concurrency: int,
    progress: Progress,
) -> LoadRun:
    """``concurrency`` workers, each sending its next request when its last one ends, until ``turns`` run out."""
    records: list[RequestRecord | None] = [None] * len(turns)
    pending = iter(range(len(turns)))

    async def worker() -> None:
        for i in pending:
            records[i] = await send(client, target, turns[i], max_tokens, progress)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(turns)))))
    done = [r for r in records if r is not None]
    return LoadRun(f"concurrency {concurrency}", done, time.perf_counter() - start, concurrency=concurrency)
