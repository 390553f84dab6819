"""An asyncio app: concurrent streaming answers, with an input filter, an output filter and an audit log.

    python examples/async_app.py [--max-tokens 40] [--audit audit.jsonl]

Each question streams on its own task; tokens are printed as they arrive, tagged by
question. One request is blocked by the input filter, and the audit log (one hash-chained
JSON line per request) is verified at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path

from sdk import AsyncClient, ChatMessage, ContentBlocked
from sdk.hooks import AuditLog, RegexFilter

SYSTEM = "You are a friendly tutor. Explain things simply, in two sentences at most."
QUESTIONS = [
    "Why is the sky blue?",
    "What is a prime number?",
    "How do plants make food?",
    "My card number is 4111 1111 1111 1111, can you store it?",  # blocked by the input filter
]


async def ask(client: AsyncClient, tag: str, messages: list[ChatMessage], max_tokens: int) -> None:
    try:
        async with contextlib.aclosing(client.stream(messages, max_tokens=max_tokens, temperature=0)) as deltas:
            async for delta in deltas:
                if delta.text:
                    print(f"[{tag}] {delta.text!r}")
                if delta.finish_reason is not None:
                    print(f"[{tag}] done: {delta.finish_reason}, {delta.usage.completion_tokens} tokens, "
                          f"{delta.usage.cached_tokens} prompt tokens from cache")  # fmt: skip
    except ContentBlocked as exc:
        print(f"[{tag}] blocked: {exc.reason}")


async def main(max_tokens: int, audit_path: Path) -> None:
    audit = AuditLog(audit_path)
    hooks = [RegexFilter(r"\b(?:\d[ -]?){13,16}\b", on="input"), RegexFilter(r"(?i)password", on="output"), audit]
    client = AsyncClient(hooks=hooks, tenant="demo")
    async with await client.prefix(SYSTEM) as system:
        tasks = [
            ask(client, f"q{i}", [*system.messages, ChatMessage(role="user", content=q)], max_tokens)
            for i, q in enumerate(QUESTIONS)
        ]
        await asyncio.gather(*tasks)
    audit.close()
    print(f"\naudit log {audit_path}: {AuditLog.verify(audit_path)} records, hash chain intact")
    print(f"hook failures: {client.stats()['hook_failures']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--audit", type=Path, default=None, help="audit log path (default: a temporary file)")
    args = parser.parse_args()
    path = args.audit or Path(tempfile.mkdtemp()) / "audit.jsonl"
    asyncio.run(main(args.max_tokens, path))
