"""``paged chat``: the terminal loop streams replies from a server and keeps the conversation."""

from __future__ import annotations

import argparse
import io
import json

from integrations.chat_command import add_arguments, chat_loop
from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk.hooks import AuditLog
from tests.integrations.fake_engine import FakeEngine


async def test_chat_loop_streams_replies_and_resets(live_server, tokenizer, tmp_path):
    """Each input line gets a streamed reply; /reset drops the history; end of input exits 0."""
    audit = tmp_path / "audit.jsonl"
    hooks = [AuditLog(audit, include_text=True)]
    engine = FakeEngine(tokenizer)
    server = live_server(create_app(hooks=hooks, serving_factory=lambda: Serving(engine, hooks=hooks)))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", server.base_url, "--max-tokens", "2", "--system", ""])
    out = io.StringIO()
    assert await chat_loop(args, io.StringIO("hi\nthere\n/reset\nagain\n"), out) == 0
    assert out.getvalue() == " ok ok\n ok ok\n ok ok\n"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in records][1] > records[0]["prompt_tokens"]  # history grew
    assert records[2]["prompt_tokens"] == records[0]["prompt_tokens"]  # reset
