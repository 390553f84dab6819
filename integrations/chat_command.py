"""``paged chat``: an interactive chat in the terminal, streaming over the SDK client.

In-process by default (the bundled model); ``--base-url`` talks to a ``paged serve`` (or any
OpenAI-compatible) endpoint instead. Commands: ``/reset`` forgets the conversation,
``/exit`` (or end of input) quits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from typing import TextIO


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF directory or .gguf file (default: the bundled model)"
    )
    parser.add_argument(
        "--base-url", default=None, help="chat with a remote OpenAI-compatible server instead"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("PAGED_API_KEY"),
        help="key for --base-url (default: $PAGED_API_KEY)",
    )
    parser.add_argument(
        "--system", default="You are a helpful assistant.", help="system prompt (empty for none)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="longest reply in tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="(default: %(default)s; 0 = greedy)"
    )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(chat_loop(args, sys.stdin, sys.stdout))


async def chat_loop(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    """Read a line, stream the reply, repeat until ``/exit`` or end of input."""
    from sdk.client import AsyncClient
    from sdk.errors import PagedError
    from sdk.types import ChatMessage

    if args.base_url:
        client = AsyncClient(args.model, base_url=args.base_url, api_key=args.api_key, route="chat")
    else:
        client = AsyncClient(args.model, route="chat")
    system = [ChatMessage(role="system", content=args.system)] if args.system else []
    history: list[ChatMessage] = []
    interactive = stdin.isatty()
    try:
        while True:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = await asyncio.to_thread(stdin.readline)
            if not line or line.strip() == "/exit":
                return 0
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                history.clear()
                continue
            history.append(ChatMessage(role="user", content=text))
            reply: list[str] = []
            try:
                stream = client.stream(
                    [*system, *history], max_tokens=args.max_tokens, temperature=args.temperature
                )
                async with contextlib.aclosing(stream):
                    async for delta in stream:
                        reply.append(delta.text)
                        stdout.write(delta.text)
                        stdout.flush()
            except PagedError as exc:
                history.pop()
                stdout.write(f"[error: {exc}]\n")
                continue
            stdout.write("\n")
            history.append(ChatMessage(role="assistant", content="".join(reply)))
    finally:
        await client.aclose()  # the connections, or the in-process engine
