"""A real ``paged serve`` process on a free loopback port, for tests that need the command itself (signals, ranks)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(root: str) -> bool:
    """Whether ``root``/health answers 200."""
    try:
        with urllib.request.urlopen(root + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serve_process(*flags: str, api_key: str = "", timeout: float = 90.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """``paged serve --port P *flags`` started and healthy: yields the process and its root URL; killed on the way
    out unless it already ended. The process's stderr is in the failure message when it dies before it is healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "integrations.cli", "serve", "--port", str(port), *flags]
    env = {**os.environ, "PAGED_API_KEY": api_key}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not healthy(root):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.2)
        yield proc, root
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
