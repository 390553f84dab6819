"""Two clients, one engine: a help desk and a search box share a Runtime.

    python examples/shared_runtime.py [--max-tokens 24]

Each client has its own tenant and hooks, but both are given the same ``Runtime``: the
model loads once, and the second client's request is served the system prompt that the
first one computed, from the shared prefix cache. Leaving the ``with`` block shuts the
engine down.
"""

from __future__ import annotations

import argparse

from sdk import Client, Runtime
from sdk.hooks import RegexFilter

SYSTEM = (
    "You are the assistant of the Riverside public library. It opens at 9 am and closes at 6 pm on "
    "weekdays, and from 10 am to 4 pm on Saturdays. Books are lent for three weeks. Answer in one sentence."
)


def main(max_tokens: int) -> None:
    with Runtime() as runtime:  # the engine loads on the first request
        desk = Client(runtime=runtime, tenant="help-desk")
        search = Client(runtime=runtime, tenant="search", hooks=[RegexFilter(r"(?i)password", on="input")])
        for client, question in [(desk, "When do you open on Saturday?"), (search, "How long can I keep a book?")]:
            result = client.chat([("system", SYSTEM), ("user", question)], max_tokens=max_tokens, temperature=0)
            usage = result.usage
            print(f"[{client.settings.tenant}] {question}\n  {result.text.strip()}")
            print(f"  prompt tokens from the shared cache: {usage.cached_tokens}/{usage.prompt_tokens}")
        print(f"\none engine for both clients: {desk.runtime.engine is search.runtime.engine}")
    print(f"runtime closed, engine shut down: {runtime.closed}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=24)
    main(parser.parse_args().max_tokens)
