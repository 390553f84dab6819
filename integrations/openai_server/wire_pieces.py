"""Wire pieces built from the SDK's deltas (logprobs in both OpenAI formats, token ids, usage) and rate-limit headers."""

from __future__ import annotations

import math

from integrations.openai_server import protocol as p
from sdk.quota import RateLimitState
from sdk.types import Delta, RequestLatency, TokenLogprob


def chat_logprobs(deltas: list[Delta]) -> p.ChatLogprobs:
    """Chat format: per token its string, logprob, UTF-8 bytes and top candidates."""
    return p.ChatLogprobs(
        content=[
            p.TokenLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode()),
                top_logprobs=[
                    p.TopLogprob(token=c.token, logprob=c.logprob, bytes=list(c.token.encode())) for c in t.top_logprobs
                ],
            )
            for t in _infos(deltas)
        ]
    )


def completion_logprobs(deltas: list[Delta], offset: int = 0) -> p.CompletionLogprobs:
    """Legacy completions format: parallel lists, top candidates as {token: logprob}."""
    infos = _infos(deltas)
    offsets = []
    for t in infos:
        offsets.append(offset)
        offset += len(t.token)
    return p.CompletionLogprobs(
        tokens=[t.token for t in infos],
        token_logprobs=[t.logprob for t in infos],
        top_logprobs=[{c.token: c.logprob for c in t.top_logprobs} for t in infos],
        text_offset=offsets,
    )


def token_ids(deltas: list[Delta]) -> list[int]:
    return [t for c in deltas for t in c.token_ids]


def usage(finals: list[Delta]) -> p.Usage:
    """Usage over the request's prompts: each SDK request's totals (on its last delta) summed.

    The ``latency`` extension is the request's breakdown; over several prompts, each phase is
    the longest of theirs (they ran side by side) and the prompt token counts are summed.
    """
    prompt = cached = completion = 0
    latencies: list[RequestLatency] = []
    for delta in finals:
        if delta.usage is None:
            continue
        prompt += delta.usage.prompt_tokens
        cached += delta.usage.cached_tokens
        completion += delta.usage.completion_tokens
        if delta.usage.latency is not None:
            latencies.append(delta.usage.latency)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
        latency=_combined(latencies) if latencies and len(latencies) == len(finals) else None,
    )


def _combined(latencies: list[RequestLatency]) -> RequestLatency:
    if len(latencies) == 1:
        return latencies[0]

    def longest(name: str) -> float | None:
        values = [v for v in (getattr(lat, name) for lat in latencies) if v is not None]
        return max(values) if values else None

    return RequestLatency(
        e2e_s=longest("e2e_s"),
        queue_s=longest("queue_s"),
        prefill_s=longest("prefill_s"),
        decode_s=longest("decode_s"),
        preempted_s=max(lat.preempted_s for lat in latencies),
        computed_prompt_tokens=sum(lat.computed_prompt_tokens for lat in latencies),
        cached_prompt_tokens=sum(lat.cached_prompt_tokens for lat in latencies),
    )


def _infos(deltas: list[Delta]) -> list[TokenLogprob]:
    return [info for c in deltas for info in (c.logprobs or ())]


def rate_limit_headers(state: RateLimitState) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits a tenant has."""
    headers = {}
    for kind, quota in (("requests", state.requests), ("tokens", state.tokens)):
        if quota is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(quota.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(quota.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration(quota.reset)
    return headers


def duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest, 3):g}s"
