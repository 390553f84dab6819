"""``paged bench --base-url``: timing against a stub OpenAI server with known delays; a run against `paged serve`."""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from integrations.bench.workloads import load_turns
from integrations.cli import main
from tests.support.serve_process import serve_process

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-stub"
TTFT_S, ITL_S = 0.15, 0.03  # the stub's delays
PROMPT_TOKENS, CACHED_TOKENS = 10, 4


class Stub:
    """A streaming /v1/chat/completions that sleeps TTFT_S, then sends one content event per ITL_S."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []
        self.in_flight_at_arrival: list[int] = []
        self.in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    @staticmethod
    def _authorized(request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {KEY}"

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.perf_counter())
        self.in_flight += 1
        self.in_flight_at_arrival.append(self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(event: dict) -> None:
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())

            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(TTFT_S)
            n = body["max_tokens"]
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                await send({"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]})
            await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n,
                     "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}  # fmt: skip
            await send({"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
def stub(live_server):
    stub = Stub()
    stub.server = live_server(stub.app(), wait_healthy=False)
    return stub


def _bench(stub_or_url, tmp_path: Path, *argv: str) -> dict:
    url = stub_or_url if isinstance(stub_or_url, str) else stub_or_url.server.root
    out = tmp_path / "http.json"
    assert main(["bench", "--base-url", url, "--no-progress", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_all_at_once_timing_counts_and_slo(stub, tmp_path):
    """TTFT, ITL and e2e fall within the stub's delays; tokens come from usage; the SLO share follows the bounds."""
    report = _bench(stub, tmp_path, "--api-key", KEY, "--num-requests", "6", "--max-tokens", "5", "--slo-ttft", "0.5")
    (result,) = report["results"]
    (run,) = report["http"]["runs"]
    assert result["name"] == "HTTP, all at once" and result["num_requests"] == 6 and result["num_new_tokens"] == 30
    assert run["num_requests"] == 6 and run["num_failed"] == 0 and run["load"] == "all at once"
    assert TTFT_S <= result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] < TTFT_S + 0.2
    assert result["itl_s"]["count"] == 6 * 4 and ITL_S * 0.8 <= result["itl_s"]["p50"] < ITL_S + 0.05
    e2e = TTFT_S + 4 * ITL_S
    assert e2e <= run["e2e_s"]["p50"] < e2e + 0.3 and run["e2e_s"]["count"] == 6
    assert result["prefix_cache_hit_rate"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)
    assert result["prompt_tokens_computed"] == 6 * (PROMPT_TOKENS - CACHED_TOKENS)
    assert run["slo_fraction"] == 1.0 and run["goodput_rps"] == pytest.approx(6 / run["wall_s"])
    # What was sent: the workload's turns, streaming with usage, greedy, EOS ignored (warm-up first).
    turns = load_turns("shared-prefix")
    body = stub.bodies[1]
    assert body["model"] == "stub-model" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["messages"] == [{"role": "system", "content": turns[0]["system"]}, {"role": "user", "content": turns[0]["user"]}]
    assert max(stub.in_flight_at_arrival) == 6
    strict = _bench(stub, tmp_path, "--api-key", KEY, "--num-requests", "2", "--max-tokens", "2", "--slo-ttft", "0.1")
    assert strict["http"]["runs"][0]["slo_fraction"] == 0.0 and strict["http"]["runs"][0]["goodput_rps"] == 0.0


def test_concurrency_sweep_and_seeded_poisson_arrivals(stub, tmp_path):
    """Each sweep level holds exactly c requests in flight; Poisson arrivals follow the seeded schedule."""
    report = _bench(stub, tmp_path, "--api-key", KEY, "--num-requests", "6", "--max-tokens", "2", "--concurrency", "1,3")
    assert [r["concurrency"] for r in report["http"]["runs"]] == [1, 3]
    assert [r["name"] for r in report["results"]] == ["HTTP, concurrency 1", "HTTP, concurrency 3"]
    seen = stub.in_flight_at_arrival[1:]  # after the warm-up
    assert max(seen[:6]) == 1 and max(seen[6:]) == 3
    assert report["http"]["runs"][0]["wall_s"] > 1.5 * report["http"]["runs"][1]["wall_s"]

    del stub.arrivals[:]
    rate, seed = 8.0, 3
    _bench(stub, tmp_path, "--api-key", KEY, "--num-requests", "5", "--max-tokens", "1", "--request-rate", str(rate),
           "--seed", str(seed))  # fmt: skip
    rng, expected, t = random.Random(seed), [], 0.0
    for _ in range(5):
        expected.append(t)
        t += rng.expovariate(rate)
    arrivals = stub.arrivals[1:]
    measured = [a - arrivals[0] for a in arrivals]
    assert measured == pytest.approx(expected, abs=0.05)


def test_unusable_server_and_flag_misuse_are_messages(stub, tmp_path, capsys):
    """A refused key and a dead port end with one-line errors; HTTP-only flags without --base-url are usage errors."""
    for argv, message in [
        (["--base-url", stub.server.root, "--api-key", "wrong"], "answered 401: the key was refused"),
        (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--no-progress", *argv])
        assert exc.value.code == 1 and message in capsys.readouterr().err
    for argv, message in [
        (["--request-rate", "2"], "--request-rate need --base-url"),
        (["--base-url", stub.server.root, "--workload", "structured"], "--workload structured does not run over HTTP"),
        (["--base-url", stub.server.root, "--compare-in-process", "--concurrency", "2"], "compares the all-at-once run"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["bench", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_paged_serve_against_in_process(tiny_model_factory, tmp_path):
    """Against a real `paged serve`: the in-process run's prompt and output token counts, and the throughput ratio."""
    model = str(tiny_model_factory("llama"))
    engine_flags = ["--model", model, "--num-blocks", "256", "--max-num-seqs", "8", "--max-model-len", "512"]
    flags = ["--log-level", "WARNING", "--drain-timeout", "0.5", *engine_flags]
    with serve_process(*flags, api_key="sk-serve") as (_, root):
        report = _bench(root, tmp_path, "--api-key", "sk-serve", "--num-requests", "4", "--max-tokens", "4",
                        "--compare-in-process", "--no-ceiling", *engine_flags)  # fmt: skip
    engine, http = report["results"]
    assert engine["name"] == "paged engine" and http["name"] == "HTTP, all at once"
    assert engine["num_new_tokens"] == http["num_new_tokens"] == 16
    # The server applies the same chat template: same prompt tokens, and the shared prefix is cached there too.
    assert http["num_prompt_tokens"] == engine["num_prompt_tokens"]
    assert 0 < http["prefix_cache_hit_rate"] < 1 and http["prompt_tokens_computed"] < http["num_prompt_tokens"]
    ratio = report["http"]["in_process_ratio"]
    assert ratio == pytest.approx(http["tokens_per_s"] / engine["tokens_per_s"]) and 0 < ratio
    assert http["ratio_to_engine"] == pytest.approx(ratio)
    assert report["protocol"]["engine"]["num_blocks"] == 256


LOCUSTFILE = ROOT / "examples" / "locustfile.py"


def test_locustfile_compiles():
    """The locust example is valid Python (locust itself is not a dependency)."""
    compile(LOCUSTFILE.read_text(), str(LOCUSTFILE), "exec")


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")
def test_locustfile_reports_ttft_against_the_stub(stub, tmp_path):
    """Headless locust on the example streams the workload from the stub and reports TTFT within its delay."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PAGED_API_KEY": KEY, "PAGED_MAX_TOKENS": "3", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", stub.server.root, "--headless",
           "--users", "2", "--spawn-rate", "2", "--run-time", "3s", "--csv", str(tmp_path / "run"), "--only-summary"]  # fmt: skip
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)
    with open(tmp_path / "run_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    ttft, stream = rows["time to first token"], rows["chat (stream)"]
    assert int(ttft["Request Count"]) == int(stream["Request Count"]) > 0 and int(stream["Failure Count"]) == 0
    assert TTFT_S * 1e3 <= float(ttft["Median Response Time"]) < (TTFT_S + 0.2) * 1e3
    assert stub.bodies[-1]["stream"] is True and stub.bodies[-1]["max_tokens"] == 3
