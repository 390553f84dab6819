"""``paged top``: figures from /metrics (today's names and the agreed new ones), and the live screen in a pty."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from integrations.cli import main
from integrations.openai_server.app import create_app
from integrations.top import Figures, History, Scrape, histogram_quantile

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-top"

# Two scrapes 2 s apart of a server exporting the agreed new metrics too (tenants, e2e latency).
BEFORE = """
paged_kv_blocks_total 100
paged_generation_tokens_total 1000
paged_prefix_cache_queries_total 400
paged_prefix_cache_hits_total 100
paged_request_success_total{finished_reason="stop"} 10
paged_request_success_total{finished_reason="length"} 5
paged_tenant_computed_tokens_total{tenant="alice"} 50
paged_e2e_request_latency_seconds_bucket{le="0.5"} 0
paged_e2e_request_latency_seconds_bucket{le="1.0"} 10
paged_e2e_request_latency_seconds_bucket{le="+Inf"} 10
paged_pooling_requests_total{route="/v1/embeddings"} 4
paged_pooling_requests_total{route="/v1/rerank"} 0
paged_pooling_prompt_tokens_total{route="/v1/embeddings"} 400
paged_pooling_prompt_tokens_total{route="/v1/rerank"} 0
paged_pooling_inputs_total{kind="embed"} 4
paged_pooling_inputs_total{kind="score"} 0
paged_pooling_batch_size_sum{kind="embed"} 4
paged_pooling_batch_size_count{kind="embed"} 1
paged_pooling_queue_time_seconds_bucket{kind="embed",le="0.01"} 4
paged_pooling_queue_time_seconds_bucket{kind="embed",le="0.1"} 4
paged_pooling_queue_time_seconds_bucket{kind="embed",le="+Inf"} 4
paged_pooling_queue_time_seconds_bucket{kind="score",le="0.01"} 0
paged_pooling_queue_time_seconds_bucket{kind="score",le="0.1"} 0
paged_pooling_queue_time_seconds_bucket{kind="score",le="+Inf"} 0
"""
AFTER = """
paged_kv_blocks_total 100
paged_kv_token_usage 0.75
paged_generation_tokens_total 1300
paged_prefix_cache_queries_total 600
paged_prefix_cache_hits_total 250
paged_request_success_total{finished_reason="stop"} 14
paged_request_success_total{finished_reason="length"} 7
paged_tenant_requests{tenant="alice",state="running"} 3
paged_tenant_requests{tenant="alice",state="waiting"} 1
paged_tenant_computed_tokens_total{tenant="alice"} 250
paged_e2e_request_latency_seconds_bucket{le="0.5"} 10
paged_e2e_request_latency_seconds_bucket{le="1.0"} 20
paged_e2e_request_latency_seconds_bucket{le="+Inf"} 20
paged_pooling_requests_total{route="/v1/embeddings"} 8
paged_pooling_requests_total{route="/v1/rerank"} 2
paged_pooling_prompt_tokens_total{route="/v1/embeddings"} 800
paged_pooling_prompt_tokens_total{route="/v1/rerank"} 200
paged_pooling_inputs_total{kind="embed"} 16
paged_pooling_inputs_total{kind="score"} 0
paged_pooling_batch_size_sum{kind="embed"} 16
paged_pooling_batch_size_count{kind="embed"} 4
paged_pooling_queue_time_seconds_bucket{kind="embed",le="0.01"} 4
paged_pooling_queue_time_seconds_bucket{kind="embed",le="0.1"} 16
paged_pooling_queue_time_seconds_bucket{kind="embed",le="+Inf"} 16
paged_pooling_queue_time_seconds_bucket{kind="score",le="0.01"} 100
paged_pooling_queue_time_seconds_bucket{kind="score",le="0.1"} 100
paged_pooling_queue_time_seconds_bucket{kind="score",le="+Inf"} 100
"""


def test_histogram_quantile_interpolates_within_buckets():
    """Ranks fall linearly inside their bucket; the +Inf bucket gives the largest finite bound; empty gives None."""
    buckets = [(0.1, 10.0), (0.2, 30.0), (float("inf"), 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_figures_rates_and_windowed_quantiles():
    """Rates and recent quantiles are over the window; new metric names (tenants, e2e, token usage) are read."""
    history = History()
    assert history.add(Scrape.parse(BEFORE, at=10.0)).base is None
    f = history.add(Scrape.parse(AFTER, at=12.0))
    assert f.window_s == 2.0
    assert f.rate("paged_generation_tokens_total") == pytest.approx(150.0)
    assert f.finished_rate() == pytest.approx(3.0)  # 6 more successes over 2 s
    assert f.window_hit_rate() == pytest.approx(0.75)
    assert f.pooling_rate("paged_pooling_requests_total") == pytest.approx(3.0)  # 4 + 2 more over 2 s
    assert f.pooling_rate("paged_pooling_prompt_tokens_total") == pytest.approx(300.0)
    assert Figures(Scrape.parse("", at=1.0), f.current).pooling_rate("paged_pooling_requests_total") is None  # not exported
    # pooling batches: 12 inputs in 3 batches over the window; the embed kind's own queue times, not the score kind's
    assert f.pooling_batch_size() == pytest.approx(4.0) and f.pooling_kinds() == ["embed"]
    assert f.quantile("paged_pooling_queue_time_seconds", 0.5, recent=True, kind="embed") == pytest.approx(0.055)
    assert f.quantile("paged_pooling_queue_time_seconds", 0.5, recent=True) == pytest.approx(0.01 * 56 / 100)
    assert f.value("paged_kv_token_usage") == 0.75 and f.value("paged_kv_cache_usage") is None
    assert f.tenants() == ["alice"]
    assert f.value("paged_tenant_requests", tenant="alice", state="waiting") == 1
    assert f.rate("paged_tenant_computed_tokens_total", tenant="alice") == pytest.approx(100.0)
    # The window saw 10 requests, all in (0, 0.5]; since start half were in (0.5, 1].
    assert f.quantile("paged_e2e_request_latency_seconds", 0.5, recent=True) == pytest.approx(0.25)
    assert f.quantile("paged_e2e_request_latency_seconds", 0.5, recent=False) == pytest.approx(0.5)
    assert f.quantile("paged_ttft_seconds", 0.5, recent=True) is None
    # The base is the newest scrape at or before the window's start (the oldest one after a gap).
    assert history.add(Scrape.parse(AFTER, at=30.0)).base.time == 12.0
    assert history.add(Scrape.parse(AFTER, at=31.0)).base.time == 12.0
    assert history.add(Scrape.parse(AFTER, at=41.0)).base.time == 31.0


def test_several_models_sum_and_each_has_a_row():
    """A server of several chat models labels its engine metrics by model: the figures sum them, and a Models
    table shows each one's load."""
    from rich.console import Console

    from integrations.top import render

    def scrape(tokens: int, at: float) -> Scrape:
        lines = [
            f'paged_{name}{{model="{model}"}} {value}'
            for model, scale in (("llama", 1), ("qwen", 2))
            for name, value in (("kv_blocks_total", 64), ("kv_blocks_used", 4 * scale), ("num_requests_running", scale),
                                ("generation_tokens_total", tokens * scale))
        ]  # fmt: skip
        return Scrape.parse("\n".join(lines) + "\n", at=at)

    history = History()
    history.add(scrape(100, at=10.0))
    f = history.add(scrape(200, at=12.0))
    assert f.models() == ["llama", "qwen"] and f.value("paged_kv_blocks_total") == 128
    assert f.rate("paged_generation_tokens_total") == pytest.approx(150.0)
    assert f.rate("paged_generation_tokens_total", model="qwen") == pytest.approx(100.0)
    console = Console(width=160, record=True)
    console.print(render(f, "http://x"))
    rows = {line.split()[0]: line.split() for line in console.export_text().splitlines() if line.split()[:1] in (["llama"], ["qwen"])}
    assert rows["llama"][1:4] == ["1", "-", "50.0"] and rows["qwen"][1:4] == ["2", "-", "100.0"]
    assert f.value("paged_num_requests_running") == 3 and not Figures(Scrape.parse("", at=1.0), None).models()


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """One keyed server over a tiny llama."""
    from tests.integrations.conftest import LiveServer

    app = create_app(str(tiny_model_factory("llama")), api_key=KEY, num_blocks=128, max_num_seqs=8, max_model_len=256)
    live = LiveServer(app).start()
    yield live
    live.stop()


def _metric(server, name: str) -> float:
    from integrations.top import scrape

    value = scrape(server.root, KEY).value(name)
    assert value is not None
    return value


def test_once_prints_plain_figures_and_errors_are_messages(server, capsys):
    """--once prints a plain frame with the server's figures; a refused key and a dead port are one-line errors."""
    assert main(["top", "--url", server.root, "--api-key", KEY, "--once", "--interval", "0.1"]) == 0
    out = capsys.readouterr().out
    total = int(_metric(server, "paged_kv_blocks_total"))
    assert re.search(rf"blocks used / total\s+0 / {total}\b", out), out
    assert "\x1b[" not in out  # plain: no escape codes
    for argv, message in [
        (["--api-key", "wrong"], "answered 401: the key was refused"),
        (["--api-key", ""], "answered 401: it needs a key"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["top", "--url", server.root, "--once", *argv])
        assert exc.value.code == 1 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["top", "--url", "http://127.0.0.1:9", "--once"])
    assert exc.value.code == 1 and "cannot reach http://127.0.0.1:9/metrics" in capsys.readouterr().err


def _load(server, stop: threading.Event) -> None:
    client = server.openai(KEY)
    while not stop.is_set():
        client.completions.create(
            model=server.model_name, prompt="Tell me a long story.", max_tokens=48, extra_body={"ignore_eos": True}
        )


def test_live_screen_under_load_in_a_pty(server):
    """Under load the live screen shows the KV total and fill, running requests, output tok/s, TTFT and e2e, a tenant; Ctrl-C exits 0."""
    pexpect = pytest.importorskip("pexpect")
    pyte = pytest.importorskip("pyte")
    stop = threading.Event()
    workers = [threading.Thread(target=_load, args=(server, stop), daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    screen = pyte.Screen(150, 40)
    stream = pyte.ByteStream(screen)
    env = {**os.environ, "PAGED_API_KEY": KEY, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
    # NOTE: Ctrl-C's default action restored in the child: a runner started in the background by a shell without
    # job control ignores SIGINT, which the monitor would inherit (and Python then leaves ignored).
    child = pexpect.spawn(
        sys.executable, ["-m", "integrations.cli", "top", "--url", server.root, "--interval", "0.3"],
        cwd=str(ROOT), env=env, dimensions=(40, 150),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    total = int(_metric(server, "paged_kv_blocks_total"))
    try:
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not {"tok/s", "running", "TTFT", "e2e", "fill", "tenant"} <= seen.keys():
            try:
                stream.feed(child.read_nonblocking(1 << 16, timeout=0.3))
            except pexpect.TIMEOUT:
                continue
            text = "\n".join(screen.display)
            if match := re.search(rf"blocks used / total\s+(\d+) / {total}\b", text):
                seen["kv"] = int(match.group(1))
            if (match := re.search(r"output tok/s\s+([\d.]+)", text)) and float(match.group(1)) > 0:
                seen["tok/s"] = float(match.group(1))
            if (match := re.search(r"running\s+(\d+)", text)) and int(match.group(1)) > 0:
                seen["running"] = int(match.group(1))
            for label in ("TTFT", "e2e"):
                row = next((line for line in screen.display if line.startswith(label)), "")
                if row and re.split(r"\s{2,}", row.strip())[3].endswith("s"):  # p50 since start, in ms or s
                    seen[label] = 1
            if match := re.search(r"token utilization\s+([\d.]+)%", text):
                seen["fill"] = float(match.group(1))
            if re.search(r"^\s*\S+\s+[1-8]\s+\d+\s+[\d.]+\s*$", text.split("Tenants", 1)[-1], re.M):
                seen["tenant"] = 1  # a tenant's row: running, waiting, computed tok/s
        assert {"kv", "tok/s", "running", "TTFT", "e2e", "fill", "tenant"} <= seen.keys(), "\n".join(screen.display)
        assert 0 < seen["fill"] <= 100
        assert 0 <= seen["kv"] <= total and seen["running"] <= 8  # max_num_seqs
        start = time.monotonic()
        child.sendintr()
        child.expect(pexpect.EOF, timeout=5)
        child.close()
        assert child.exitstatus == 0 and time.monotonic() - start < 5
        child = pexpect.spawn(sys.executable, ["-m", "integrations.cli", "top", "--url", server.root], cwd=str(ROOT),
                              env=env, dimensions=(40, 150))  # fmt: skip
        child.expect("blocks used / total", timeout=20)
        child.send("q")
        child.expect(pexpect.EOF, timeout=5)
        child.close()
        assert child.exitstatus == 0
    finally:
        stop.set()
        if child.isalive():
            child.terminate(force=True)
        for w in workers:
            w.join(30)
