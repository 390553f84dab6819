"""llama.cpp as a contender (``--baselines llamacpp``): ``llama-bench`` at batch 1, ``llama-server`` batched.

Both run the GGUF file the engine runs, with the engine's thread count. ``llama-bench`` measures
prefill (``pp N``) and decode (``tg N``) of one sequence. ``llama-server`` with ``--llamacpp-slots``
slots gets the workload's token ids (the engine's chat-templated prompts, so both see the same
input) on its ``/completion`` endpoint, all at once, greedy, exactly ``max_tokens`` new tokens each
with EOS ignored, streamed so that TTFT and inter-token gaps are the client's; its start-up and a
warm-up request are not timed. Binaries come from ``--llamacpp-dir`` (``bin/llama-bench``,
``bin/llama-server``), else ``$PAGED_LLAMACPP_DIR``, else ``DEFAULT_DIR``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from integrations.bench.http_runs import StreamFailed, stream_events
from integrations.bench.report import RunResult
from integrations.engine_flags import FlagError
from integrations.errors import CommandError

LLAMACPP = "llamacpp"  # its name in --baselines
BENCH_TOOL, SERVER_TOOL = "llama-bench", "llama-server"  # the binaries under bin/
DIR_ENV_VAR = "PAGED_LLAMACPP_DIR"
DEFAULT_DIR = Path("~/.cache/paged-peers/llama.cpp")
BUILD_HINT = (
    "build llama.cpp's tools (cmake -S llama.cpp -B build -DGGML_NATIVE=ON && cmake --build build --target "
    "llama-bench llama-server), then pass --llamacpp-dir to the folder holding bin/, or set $" + DIR_ENV_VAR
)
SERVER_START_TIMEOUT_S = 900.0
WARM_UP_PROMPT = [1, 2, 3, 4]

Progress = Callable[[int], None]


class LlamaCppMissing(FlagError):
    """No llama.cpp binaries where ``--llamacpp-dir`` (or its default) points; the message says how to build them."""


class LlamaCppRunFailed(CommandError):
    """llama-bench or llama-server failed; the message has its last output lines and its log's path."""


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build: its ``bin`` folder."""

    bin_dir: Path

    @property
    def bench(self) -> Path:
        return self.bin_dir / BENCH_TOOL

    @property
    def server(self) -> Path:
        return self.bin_dir / SERVER_TOOL

    def version(self) -> str:
        """The build's ``--version`` line (``version: 1234 (abcdef0)``), or ``unknown``."""
        try:
            proc = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("version:")]
        return lines[0].removeprefix("version:").strip() if lines else "unknown"


def find_llamacpp(path: Path | None, tools: tuple[str, ...] = (BENCH_TOOL, SERVER_TOOL)) -> LlamaCpp:
    """llama.cpp's build under ``path``, else ``$PAGED_LLAMACPP_DIR``, else ``DEFAULT_DIR``, holding ``tools``
    (the binaries the run needs: llama-bench for batch1, llama-server for the offline workloads).

    Raises:
        LlamaCppMissing: one of ``tools`` is not an executable in ``bin/`` there.
    """
    source = "--llamacpp-dir"
    if path is None:
        env = os.environ.get(DIR_ENV_VAR)
        path, source = (Path(env), f"${DIR_ENV_VAR}") if env else (DEFAULT_DIR, "the default")
    build = LlamaCpp(path.expanduser() / "bin")
    missing = [name for name in tools if not ((p := build.bin_dir / name).is_file() and os.access(p, os.X_OK))]
    if missing:
        raise LlamaCppMissing(
            f"--llamacpp-dir: no {' or '.join(missing)} in {str(build.bin_dir)!r} ({source}); {BUILD_HINT}"
        )
    return build


def gguf_of(model: str | None) -> Path | None:
    """The GGUF file llama.cpp runs for the engine's ``--model``: the bundled one for None, the file itself for a
    ``.gguf``, None for a Hugging Face directory (llama.cpp reads GGUF only)."""
    if model is None:
        from engine.paths import bundled_gguf_path

        return bundled_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" else None


SKIP_HF_DIR = (
    "llama.cpp runs GGUF files and --model is a Hugging Face directory: bench a GGUF of it "
    "(paged make-model --gguf, or llama.cpp's convert_hf_to_gguf.py) to compare with llama.cpp"
)


# ------------------------------------------------------------------------------------------- llama-bench


def run_llama_bench(
    build: LlamaCpp, gguf: Path, threads: int, prompt_tokens: int, gen_tokens: int, repetitions: int, depth: int = 0
) -> dict[str, Any]:
    """``llama-bench -p prompt_tokens -n gen_tokens -t threads -r repetitions -o json`` on ``gguf``; with ``depth``,
    the decode is timed with ``depth`` tokens in the cache (``-d depth``) in a run of its own (``-p 0``), and the
    prefill runs alone (``-n 0``) on an empty cache.

    Returns:
        ``{"name", "prefill_tok_s", "decode_tok_s", "prefill_samples", "decode_samples", "build"}``: llama-bench's
        mean rates of ``pp`` and ``tg`` and each repetition's.

    Raises:
        LlamaCppRunFailed: it exited with an error or printed no result for pp or tg.
    """
    common = ["-m", str(gguf), "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    if depth == 0:
        entries = _bench_entries(build, ["-p", str(prompt_tokens), "-n", str(gen_tokens), *common])
    else:
        entries = _bench_entries(build, ["-p", str(prompt_tokens), "-n", "0", *common])
        entries += _bench_entries(build, ["-p", "0", "-n", str(gen_tokens), "-d", str(depth), *common])
    prefill = next((e for e in entries if e.get("n_prompt") == prompt_tokens and not e.get("n_gen")), None)
    decode = next(
        (e for e in entries if e.get("n_gen") == gen_tokens and not e.get("n_prompt") and e.get("n_depth", 0) == depth),
        None,
    )
    if prefill is None or decode is None:
        raise LlamaCppRunFailed(f"llama-bench printed no {'pp' if prefill is None else 'tg'} result")
    return {
        "name": "llama.cpp llama-bench",
        "prefill_tok_s": float(prefill["avg_ts"]),
        "decode_tok_s": float(decode["avg_ts"]),
        "prefill_samples": [float(v) for v in prefill.get("samples_ts") or [prefill["avg_ts"]]],
        "decode_samples": [float(v) for v in decode.get("samples_ts") or [decode["avg_ts"]]],
        "build": f"{decode.get('build_number', '?')} ({decode.get('build_commit', '?')})",
    }


def _bench_entries(build: LlamaCpp, options: list[str]) -> list[dict[str, Any]]:
    """llama-bench's JSON entries for ``options``.

    Raises:
        LlamaCppRunFailed: it exited with an error or printed no JSON list.
    """
    proc = subprocess.run([str(build.bench), *options], capture_output=True, text=True, check=False)
    try:
        entries = json.loads(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        entries = None
    if not isinstance(entries, list) or not entries:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise LlamaCppRunFailed(f"llama-bench exited with status {proc.returncode} without pp/tg results:\n{tail}")
    return entries


# ------------------------------------------------------------------------------------------- llama-server


@dataclass
class _Request:
    tokens: list[int]
    num_tokens: int = 0  # new tokens, as the server counts them (``tokens`` can miss some: _complete)
    ttft_s: float | None = None
    itl_s: list[float] | None = None
    num_evaluated: int | None = None  # prompt tokens the server computed (the rest came from its slot's cache)
    error: str | None = None


@dataclass
class _Server:
    """A running ``llama-server``: its base URL, its log, and the seconds it took to answer ``/health``."""

    base: str
    log: Path
    startup_s: float


@contextlib.contextmanager
def _llama_server(build: LlamaCpp, gguf: Path, options: list[str]) -> Iterator[_Server]:
    """``llama-server -m gguf`` with ``options`` on a free local port, stopped on leaving; its log is removed when
    the block ends without an error and kept (and named in the error) when it raises.

    Raises:
        LlamaCppRunFailed: the server exited or did not answer ``/health`` in time.
    """
    workdir = Path(tempfile.mkdtemp(prefix="paged-bench-llamacpp-"))
    log = workdir / "llama-server.log"
    port = _free_port()
    command = [str(build.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *options]
    start = time.perf_counter()
    with log.open("w") as out:
        server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        asyncio.run(_wait_healthy(base, server, log))
        yield _Server(base, log, time.perf_counter() - start)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    shutil.rmtree(workdir)


def run_llama_server(
    build: LlamaCpp,
    gguf: Path,
    prompts: list[list[int]],
    max_tokens: int,
    slots: int,
    threads: int,
    progress: Progress = lambda n: None,
) -> RunResult:
    """The workload through ``llama-server`` with ``slots`` parallel slots, every request submitted at once.

    Raises:
        LlamaCppRunFailed: the server did not start, or a request failed; its log is kept and named.
    """
    per_slot = max(len(p) for p in prompts) + max_tokens + 16
    options = ["-np", str(slots), "-c", str(per_slot * slots), "-t", str(threads)]
    with _llama_server(build, gguf, options) as server:
        requests, wall_s = asyncio.run(_run_all(server.base, prompts, max_tokens, progress))
        failed = [r for r in requests if r.error is not None]
        if failed:
            raise LlamaCppRunFailed(
                f"llama-server: {len(failed)} of {len(requests)} requests failed, first: {failed[0].error}; "
                f"its log: {server.log}"
            )
    return _to_run_result(requests, prompts, wall_s, server.startup_s, slots, threads, build.version(), gguf)


EMBED_SLOTS = 8  # llama-server --embedding's parallel sequences: 8 chunks of 200 tokens fill one 2,048-token batch
EMBED_REQUEST_INPUTS = 32  # inputs a /v1/embeddings request, as a client sends batches


def run_llama_server_embed(
    build: LlamaCpp, gguf: Path, texts: list[str], threads: int, rounds: int, query: str, num_queries: int,
    keep: int = 8,
) -> dict[str, Any]:  # fmt: skip
    """``texts`` embedded by ``llama-server --embedding`` (``EMBED_SLOTS`` sequences at once, requests of
    ``EMBED_REQUEST_INPUTS`` inputs all sent at once), ``rounds`` times after a warm-up, then ``query`` alone
    ``num_queries`` times.

    Returns:
        ``{"rounds_s", "query_s", "startup_s", "version", "embeddings"}``: the first ``keep`` texts' vectors.

    Raises:
        LlamaCppRunFailed: the server did not start, or a request failed; its log is kept and named.
    """
    options = ["-np", str(EMBED_SLOTS), "-c", str(512 * EMBED_SLOTS), "-b", "2048", "-ub", "2048", "-t", str(threads),
               "--embedding"]  # fmt: skip
    with _llama_server(build, gguf, options) as server:
        result = asyncio.run(_embed_rounds(server.base, texts, rounds, query, num_queries, server.log))
    return {
        **result, "startup_s": server.startup_s, "version": build.version(), "embeddings": result["embeddings"][:keep]
    }


async def _embed_rounds(
    base: str, texts: list[str], rounds: int, query: str, num_queries: int, log: Path
) -> dict[str, Any]:  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as client:

        async def embed(inputs: list[str]) -> list[list[float]]:
            async with client.post(base + "/v1/embeddings", json={"input": inputs}) as resp:
                if resp.status != 200:
                    raise LlamaCppRunFailed(f"llama-server /v1/embeddings: {resp.status} {await resp.text()}; log: {log}")
                data = sorted((await resp.json())["data"], key=lambda d: d["index"])
                return [d["embedding"] for d in data]

        async def all_of(inputs: list[str]) -> list[list[float]]:
            parts = [inputs[i : i + EMBED_REQUEST_INPUTS] for i in range(0, len(inputs), EMBED_REQUEST_INPUTS)]
            return [v for part in await asyncio.gather(*(embed(p) for p in parts)) for v in part]

        vectors = await all_of(texts[: min(len(texts), 2 * EMBED_REQUEST_INPUTS)])  # warm-up
        rounds_s = []
        for _ in range(rounds):
            started = time.perf_counter()
            await all_of(texts)
            rounds_s.append(time.perf_counter() - started)
        query_s = []
        for _ in range(num_queries):
            started = time.perf_counter()
            await embed([query])
            query_s.append(time.perf_counter() - started)
    return {"rounds_s": rounds_s, "query_s": query_s, "embeddings": vectors}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.perf_counter() + SERVER_START_TIMEOUT_S
    async with aiohttp.ClientSession() as client:
        while time.perf_counter() < deadline:
            if server.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-5:])
                raise LlamaCppRunFailed(f"llama-server exited with status {server.returncode}:\n{tail}\nits log: {log}")
            try:
                async with client.get(base + "/health") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.2)
    raise LlamaCppRunFailed(f"llama-server did not answer /health within {SERVER_START_TIMEOUT_S:.0f} s; its log: {log}")


async def _run_all(
    base: str, prompts: list[list[int]], max_tokens: int, progress: Progress
) -> tuple[list[_Request], float]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=3600)
    # NOTE: a connection a request: one kept alive from the warm-up can be closed by the server's keep-alive timer
    # just as a timed request goes out on it (aiohttp's ServerDisconnectedError, 1 request in 64 in a run)
    connector = aiohttp.TCPConnector(limit=len(prompts) + 1, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        warm = await _complete(client, base, WARM_UP_PROMPT, 2, lambda n: None)
        if warm.error is not None:
            raise LlamaCppRunFailed(f"llama-server: the warm-up request failed: {warm.error}")
        start = time.perf_counter()
        requests = await asyncio.gather(*(_complete(client, base, p, max_tokens, progress) for p in prompts))
        return list(requests), time.perf_counter() - start


async def _complete(
    client: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int, progress: Progress
) -> _Request:
    """One streamed ``/completion`` request, timed from just before it is sent; a failure is recorded."""
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "stream": True, "return_tokens": True, "cache_prompt": True}  # fmt: skip
    request = _Request(tokens=[], itl_s=[])
    start = last = time.perf_counter()
    try:
        async for event in stream_events(client, base + "/completion", body):
            new = [int(t) for t in event.get("tokens") or ()]
            # NOTE: llama-server holds back a token that ends inside a UTF-8 character and streams it with the next
            # one, listing only the latter's id in "tokens"; its "tokens_predicted" counts both
            predicted = event.get("tokens_predicted")
            count = predicted - request.num_tokens if isinstance(predicted, int) else len(new)
            if count > 0:
                now = time.perf_counter()
                if request.ttft_s is None:
                    request.ttft_s = now - start
                else:
                    request.itl_s.append(now - last)  # type: ignore[union-attr]
                last = now
                request.num_tokens += count
                progress(count)
            request.tokens.extend(new)
            if event.get("stop"):
                request.num_evaluated = (event.get("timings") or {}).get("prompt_n")  # the stream's last event
    except StreamFailed as exc:
        request.error = str(exc)
        return request
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        request.error = f"{type(exc).__name__}: {exc}"
        return request
    if request.num_tokens != max_tokens:
        request.error = f"{request.num_tokens} new tokens where {max_tokens} were asked for"
    return request


def _to_run_result(
    requests: list[_Request], prompts: list[list[int]], wall_s: float, startup_s: float, slots: int, threads: int,
    version: str, gguf: Path,
) -> RunResult:  # fmt: skip
    num_prompt = sum(len(p) for p in prompts)
    evaluated = [r.num_evaluated for r in requests]
    computed = None if None in evaluated else sum(evaluated)  # type: ignore[arg-type]
    return RunResult(
        name=f"llama.cpp llama-server, {slots} slots",
        num_requests=len(requests),
        num_new_tokens=sum(r.num_tokens for r in requests),
        wall_s=wall_s,
        num_prompt_tokens=num_prompt,
        ttft_s=[r.ttft_s for r in requests if r.ttft_s is not None],
        itl_s=[gap for r in requests for gap in r.itl_s or ()],
        prompt_tokens_computed=computed,
        prefix_cache_hit_rate=None if computed is None else 1 - computed / num_prompt,
        startup_s=startup_s,
        notes=(
            f"build {version}, {gguf.name}, {threads} threads, /completion with the engine's token ids; "
            f"start-up {startup_s:.0f} s (not timed)"
        ),
        # the ids only where the stream listed every one: else no agreement with the engine is claimed
        output_token_ids=[r.tokens for r in requests] if all(len(r.tokens) == r.num_tokens for r in requests) else [],
        prompt_indices=list(range(len(prompts))),
    )
