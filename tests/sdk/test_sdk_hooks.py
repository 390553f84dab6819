"""Hooks on the request path: input filters, output filters, audit records and failure semantics."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from sdk import ChatMessage, ContentBlocked, HookFailed, InvalidRequestError, RequestTimeout
from sdk.hooks import AuditChainBroken
from sdk.hooks import AuditLog, Hook, RegexFilter, RequestContext, Stop

SECRET = "sk-ABCDEF123456"


class Recorder(Hook):
    """Records what it saw at each hook point."""

    def __init__(self, events: list[str], tag: str) -> None:
        self.events, self.tag = events, tag
        self.messages: list[ChatMessage] | None = None
        self.finished: list[RequestContext] = []

    async def on_request(self, ctx: RequestContext) -> None:
        self.events.append(f"{self.tag}.request")
        self.messages = ctx.messages

    async def on_finish(self, ctx: RequestContext) -> None:
        self.events.append(f"{self.tag}.finish")
        self.finished.append(ctx)


class Exploding(Hook):
    async def on_request(self, ctx: RequestContext) -> None:
        raise RuntimeError("boom")


class ExplodingAudit(Hook):
    fail_closed = False

    async def on_finish(self, ctx: RequestContext) -> None:
        raise OSError("disk full")


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_blocked_input_allocates_nothing(make_client, fake_engine, tmp_path):
    """A blocked input raises ContentBlocked before the engine sees it: no request, no KV block."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    client = make_client(hooks=[RegexFilter(r"sk-[A-Za-z0-9]+", on="input"), audit])
    with pytest.raises(ContentBlocked) as info:
        await client.chat(f"my key is {SECRET}")
    assert info.value.hook == "RegexFilter"
    assert fake_engine.requests_seen == []
    assert client.stats()["kv_blocks_used"] == 0
    (record,) = _records(audit.path)
    assert record["error"] == "ContentBlocked" and record["decisions"][0]["action"] == "block"
    assert SECRET not in audit.path.read_text()


async def test_redaction_rewrites_prompt_before_later_hooks(make_client):
    """A redacting input filter rewrites the messages that later hooks and the engine get."""
    events: list[str] = []
    recorder = Recorder(events, "r")
    client = make_client(hooks=[RegexFilter(SECRET, action="redact", replacement="<key>"), recorder])
    await client.chat([("system", "Be safe."), ("user", f"use {SECRET} please")], max_tokens=1)
    assert recorder.messages[1].content == "use <key> please"
    assert recorder.finished[0].decisions[0].action == "redact"


async def test_output_filter_stops_stream_and_frees_blocks(make_client, fake_engine):
    """An output filter stops the stream mid-way with content_filter; the engine request is aborted."""
    client = make_client(hooks=[RegexFilter(r"secret", on="output")])
    deltas = [d async for d in client.stream("hi", max_tokens=100)]
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "content_filter"
    assert "secret" not in text and text.startswith(" The quick brown fox")
    assert deltas[-1].request_id in fake_engine.aborted
    assert fake_engine.stats()["kv_blocks_used"] == 0
    result = await client.chat("hi", max_tokens=100)
    assert result.finish_reason == "content_filter" and result.text == text


async def test_output_filter_catches_match_across_deltas(make_client):
    """A pattern split over several deltas still stops the stream."""
    client = make_client(hooks=[RegexFilter(r"brown fox", on="output")])
    result = await client.chat("hi", max_tokens=100)
    assert result.finish_reason == "content_filter"
    assert result.text == " The quick brown"


async def test_one_audit_record_per_request_for_every_outcome(make_client, fake_engine, tmp_path):
    """Finished, blocked, rejected, aborted and cancelled requests each write exactly one chained record.

    (Options that fail the request types' validation never become a request: no record.)
    """
    audit = AuditLog(tmp_path / "audit.jsonl")
    client = make_client(hooks=[RegexFilter("forbidden"), audit], tenant="acme")
    await client.chat("hello", max_tokens=3)
    with pytest.raises(ContentBlocked):
        await client.chat("forbidden words")
    with pytest.raises(InvalidRequestError):
        await client.chat("hello", top_p=5.0)
    with pytest.raises(InvalidRequestError):
        await client.complete("word " * 600)  # longer than the engine's max_model_len
    async with contextlib.aclosing(client.stream("hello", max_tokens=50)) as stream:
        async for _ in stream:
            break
    fake_engine.step_delay = 0.05
    task = asyncio.create_task(client.chat("hello", max_tokens=50))
    await asyncio.sleep(0.15)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    records = _records(audit.path)
    assert [(r["finish_reason"], r["error"]) for r in records] == [
        ("length", None),
        (None, "ContentBlocked"),
        (None, "InvalidRequestError"),
        ("abort", "GeneratorExit"),
        ("abort", "CancelledError"),
    ]
    assert len({r["request_id"] for r in records}) == 5
    assert all(r["tenant"] == "acme" and r["model"] == "fake-model" for r in records)
    assert records[0]["completion_tokens"] == 3 and records[0]["prompt_tokens"] > 0
    assert records[0]["latency_s"] >= records[0]["ttft_s"] > 0
    assert "hello" not in audit.path.read_text()
    assert AuditLog.verify(audit.path) == 5
    assert fake_engine.stats()["kv_blocks_used"] == 0


async def test_audit_chain_detects_tampering(make_client, tmp_path):
    """verify() names the line of an edited, removed or reordered record, its replay token ids included."""
    path = tmp_path / "audit.jsonl"
    client = make_client(hooks=[AuditLog(path, replay="inline")])
    for _ in range(3):
        await client.chat("hi", max_tokens=2)
    lines = path.read_text().splitlines(keepends=True)
    edited = json.loads(lines[1]) | {"completion_tokens": 999}
    path.write_text(lines[0] + json.dumps(edited) + "\n" + lines[2])
    with pytest.raises(AuditChainBroken, match="line 2: hash"):
        AuditLog.verify(path)
    edited = json.loads(lines[1])
    edited["replay"]["completion_token_ids"][0][0] += 1
    path.write_text(lines[0] + json.dumps(edited) + "\n" + lines[2])
    with pytest.raises(AuditChainBroken, match="line 2: hash"):
        AuditLog.verify(path)
    path.write_text(lines[0] + lines[2])
    with pytest.raises(AuditChainBroken, match="line 2: prev_hash"):
        AuditLog.verify(path)
    path.write_text("".join(lines))
    assert AuditLog.verify(path) == 3


async def test_audit_replay_part_inline_and_digest(make_client, tmp_path):
    """replay= adds the prompt and completion ids (or their digests, the ids in the store); none for a blocked request."""
    inline, digest = AuditLog(tmp_path / "a.jsonl", replay="inline"), AuditLog(tmp_path / "d.jsonl", replay="digest")
    client = make_client(hooks=[RegexFilter("forbidden"), inline, digest])
    deltas = [d async for d in client.stream(prompt="hello world", max_tokens=3, temperature=0.5, seed=11, stop=["zz"])]
    with pytest.raises(ContentBlocked):
        await client.chat("forbidden", max_tokens=2)
    (ok, blocked), (ok_d, _) = _records(inline.path), _records(digest.path)
    part = ok["replay"]
    assert part["prompt_token_ids"] == deltas[0].prompt_token_ids and part["prompt_token_ids"]
    assert part["completion_token_ids"] == [[t for d in deltas for t in d.token_ids]] and ok["completion_tokens"] == 3
    assert part["params"] | {"seed": 11, "n": 1, "stop": ["zz"], "temperature": 0.5, "top_p": 1.0} == part["params"]
    assert part["model_digest"] is None and part["structured_output"] is None  # a fake engine: no weights to name
    assert blocked["replay"] is None
    stored = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "d.jsonl.tokens").glob("*/*.json")}
    assert stored[ok_d["replay"]["prompt_digest"]] == part["prompt_token_ids"]
    assert [stored[d] for d in ok_d["replay"]["completion_digests"]] == part["completion_token_ids"]
    assert "prompt_token_ids" not in ok_d["replay"] and AuditLog.verify(digest.path) == 2
    with pytest.raises(ValueError, match="replay must be one of inline, digest"):
        AuditLog(tmp_path / "x.jsonl", replay="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="store .* needs replay='digest'"):
        AuditLog(tmp_path / "x.jsonl", replay="inline", store=tmp_path / "s")


async def test_audit_reopen_continues_chain_and_drops_torn_line(make_client, tmp_path):
    """Reopening a log continues its chain; a torn last line from a crash is cut off."""
    path = tmp_path / "audit.jsonl"
    await make_client(hooks=[AuditLog(path)]).chat("hi", max_tokens=1)
    with path.open("a") as f:
        f.write('{"request_id": "torn')
    await make_client(hooks=[AuditLog(path, include_text=True)]).chat("hi there", max_tokens=1)
    assert AuditLog.verify(path) == 2
    assert _records(path)[1]["messages"] == [{"role": "user", "content": "hi there"}]


async def test_raising_filter_fails_closed(make_client, fake_engine):
    """A filter hook that raises rejects the request (HookFailed) and the engine never sees it."""
    client = make_client(hooks=[Exploding()])
    with pytest.raises(HookFailed) as info:
        await client.chat("hi")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert fake_engine.requests_seen == []


async def test_raising_audit_is_counted_not_silent(make_client, caplog):
    """An audit hook that raises does not fail the request; it is logged and counted."""
    client = make_client(hooks=[ExplodingAudit()])
    result = await client.chat("hi", max_tokens=1)
    assert result.finish_reason == "length"
    assert client.stats()["hook_failures"] == 1
    assert "ExplodingAudit failed in on_finish" in caplog.text


async def test_a_timed_out_request_shows_the_hooks_the_callers_error(make_client, fake_engine, tmp_path):
    """One error per failure wherever it is seen: on_finish and the audit record get the caller's RequestTimeout."""
    recorder, audit = Recorder([], "a"), AuditLog(tmp_path / "audit.jsonl")
    fake_engine.step_delay = 0.05
    with pytest.raises(RequestTimeout) as caught:
        await make_client(hooks=[recorder, audit]).chat("hi", max_tokens=100, timeout=0.2)
    assert recorder.finished[0].error is caught.value
    assert [(r["finish_reason"], r["error"]) for r in _records(audit.path)] == [("abort", "RequestTimeout")]


async def test_hooks_run_in_order_once(make_client):
    """Hooks run in the order given; on_finish runs once per request."""
    events: list[str] = []
    client = make_client(hooks=[Recorder(events, "a"), Recorder(events, "b")])
    await client.chat("hi", max_tokens=2)
    assert events == ["a.request", "b.request", "a.finish", "b.finish"]


async def test_custom_chunk_hook_can_stop(make_client):
    """A Hook subclass returning Stop from on_chunk ends the stream with content_filter."""

    class StopAfterTwo(Hook):
        async def on_chunk(self, ctx, delta):
            return Stop("enough") if len(ctx.output_text) > 8 else None

    result = await make_client(hooks=[StopAfterTwo()]).chat("hi", max_tokens=50)
    assert result.finish_reason == "content_filter" and 8 < len(result.text) < 20


def test_regex_filter_rejects_output_redaction():
    """Output redaction is refused at construction: streamed text cannot be taken back."""
    with pytest.raises(ValueError, match="only block"):
        RegexFilter("x", on="output", action="redact")
