"""Chat streams' inter-token latency with an embedding burst beside them, on one `paged serve` (chat + embedder).

A real server in a subprocess (`paged serve [--model CHAT] --pooling-model EMBEDDER`). Each round runs two
phases, alternating: ``--streams`` streaming chat requests alone (greedy, EOS ignored, ``--max-tokens`` each),
then the same streams with ``--embeddings`` concurrent `/v1/embeddings` requests (one ``--chunk-tokens``-token
chunk each) sent once every stream has its first tokens. The chat ITL p50 / p99 of each phase (the client's
gaps between content events, as `paged bench --base-url` takes them) and their ratio are reported.

    python benchmarks/bench_embed_beside_chat.py --pooling-model MINILM_DIR --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from integrations.bench.embed import make_chunks
from integrations.bench.http_runs import RequestRecord, Target, send, warm_up
from integrations.bench.machine import machine_info
from integrations.bench.report import summarize

SYSTEM = "You are a helpful assistant. Answer in full sentences, with one example for each point you make."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serving(root: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Returns once ``/health`` answers 200; raises if the server exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"paged serve exited with status {proc.returncode}")
            try:
                async with client.get(root + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)  # NOTE: polling a subprocess's readiness; nothing to wait on in-process
    raise RuntimeError(f"paged serve did not serve within {timeout_s:.0f} s")


async def _embed(client: aiohttp.ClientSession, root: str, model: str, text: str) -> float:
    start = time.perf_counter()
    async with client.post(root + "/v1/embeddings", json={"model": model, "input": text}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/v1/embeddings: HTTP {resp.status}: {(await resp.text())[:200]}")
        await resp.json()
    return time.perf_counter() - start


async def _phase(
    client: aiohttp.ClientSession, target: Target, root: str, embedder: str, chunks: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """One phase: the chat streams, with the embedding burst when ``chunks`` is not empty."""
    question = "how does a library catalogue work?"
    turns = [{"system": SYSTEM, "user": f"Question {i}: {question}"} for i in range(args.streams)]
    started = asyncio.Event()
    seen = 0

    def progress(n: int) -> None:
        nonlocal seen
        seen += n
        if seen >= 2 * args.streams:  # every stream past its first token, on average
            started.set()

    start = time.perf_counter()
    chats = asyncio.gather(*(send(client, target, t, args.max_tokens, progress) for t in turns))
    embed_s: list[float] = []
    if chunks:
        await started.wait()
        embed_start = time.perf_counter()
        embed_s = list(await asyncio.gather(*(_embed(client, root, embedder, c) for c in chunks)))
        embed_wall = time.perf_counter() - embed_start
    records: list[RequestRecord] = await chats
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} chat streams failed, first: {failed[0]}")
    return {
        "wall_s": time.perf_counter() - start,
        "itl_s": summarize([gap for r in records for gap in r.itl_s]),
        "embeddings": len(chunks),
        "embed_wall_s": embed_wall if chunks else None,
        "embed_latency_s": summarize(embed_s) if chunks else None,
    }


async def _run(args: argparse.Namespace, root: str, proc: subprocess.Popen) -> dict[str, Any]:
    await _serving(root, proc)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as client:
        async with client.get(root + "/v1/models") as resp:
            names = [m["id"] for m in (await resp.json())["data"]]
        embedder = Path(args.pooling_model).name
        chat = next(n for n in names if n != embedder)
        target = Target(root + "/v1", chat, {})
        await warm_up(client, target)
        from transformers import AutoTokenizer

        chunks = make_chunks(AutoTokenizer.from_pretrained(args.pooling_model), args.embeddings, args.chunk_tokens)
        await _embed(client, root, embedder, chunks[0])
        rounds = []
        for i in range(args.rounds):
            alone = await _phase(client, target, root, embedder, [], args)
            beside = await _phase(client, target, root, embedder, chunks, args)
            rounds.append({"alone": alone, "beside": beside})
            print(  # noqa: T201
                f"round {i + 1}: ITL p50 / p99 alone {alone['itl_s']['p50'] * 1000:.0f} / "
                f"{alone['itl_s']['p99'] * 1000:.0f} ms, beside {args.embeddings} embeddings "
                f"{beside['itl_s']['p50'] * 1000:.0f} / {beside['itl_s']['p99'] * 1000:.0f} ms "
                f"({beside['itl_s']['p99'] / alone['itl_s']['p99']:.2f}x p99); the burst took "
                f"{beside['embed_wall_s']:.2f} s",
                flush=True,
            )
    return {"chat_model": chat, "embedder": embedder, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the chat model (default: the bundled one)")
    parser.add_argument("--pooling-model", required=True, help="the embedder's Hugging Face directory")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--embeddings", type=int, default=100)
    parser.add_argument("--chunk-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--pooling-time-fraction", type=float, default=None,
        help="the server's --pooling-time-fraction (share of a chat step the embedder may run between two); "
        "default: the engine's",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    port = _free_port()
    command = [sys.executable, "-m", "integrations.cli", "serve", "--port", str(port)]
    command += ["--pooling-model", args.pooling_model] + (["--model", args.model] if args.model else [])
    if args.pooling_time_fraction is not None:
        command += ["--pooling-time-fraction", str(args.pooling_time_fraction)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        report = asyncio.run(_run(args, f"http://127.0.0.1:{port}", proc))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report["machine"] = machine_info()
    p99 = [r["beside"]["itl_s"]["p99"] / r["alone"]["itl_s"]["p99"] for r in report["rounds"]]
    print(f"ITL p99 beside / alone, by round: {' / '.join(f'{x:.2f}x' for x in p99)}")  # noqa: T201
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
