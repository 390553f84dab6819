"""Fixtures: the real server on a loopback port, run on a thread of its own so sync clients work too."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

LOOPBACK = "127.0.0.1"


class LiveServer:
    """An aiohttp app served on 127.0.0.1:<free port> by an event loop on a background thread."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=15.0)
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def model_name(self) -> str:
        """The model id the server serves."""
        from integrations.openai_server.state import STATE

        return self.app[STATE].serving.model_name

    def openai(self, api_key: str) -> Any:
        """The official (sync) openai client for this server."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, wait_healthy: bool = True) -> LiveServer:
        self.thread.start()

        async def up() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, LOOPBACK, 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        self.port = self.call(up())
        if wait_healthy:
            self.wait_phase("serving")
        return self

    def wait_phase(self, phase: str, timeout: float = 60.0) -> None:
        from integrations.openai_server.state import STATE

        deadline = time.monotonic() + timeout
        while self.app[STATE].phase.value != phase:
            if time.monotonic() > deadline:
                raise TimeoutError(f"server stayed {self.app[STATE].phase.value}, wanted {phase}")
            time.sleep(0.02)

    def stop(self) -> None:
        try:
            self.call(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def live_server() -> Iterator[Callable[..., LiveServer]]:
    """``live_server(app)``: start ``app`` on a loopback port; stopped (gracefully) at teardown."""
    servers: list[LiveServer] = []

    def start(app: web.Application, wait_healthy: bool = True) -> LiveServer:
        server = LiveServer(app)
        servers.append(server)
        return server.start(wait_healthy)

    yield start
    for server in servers:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture(scope="session")
def tokenizer(bundled_model_dir):
    """The bundled model's tokenizer (real chat template) for fake engines."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_dir, local_files_only=True)
