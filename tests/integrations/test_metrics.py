"""/metrics: the engine's stats() in Prometheus text format under the same names."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from integrations.openai_server.app import create_app
from integrations.openai_server.metrics import histogram_parts
from integrations.openai_server.serving import Serving
from engine.metrics import Histogram
from tests.integrations.fake_engine import FakeEngine


def _scrape(server) -> dict[str, list]:
    request = urllib.request.Request(server.root + "/metrics", headers={"Authorization": "Bearer k"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_expose_engine_stats(live_server, tokenizer):
    """Gauges, counters, derived ratios and latency histograms carry the stats() values under paged_<key>."""
    engine = FakeEngine(tokenizer)
    server = live_server(create_app(api_key="k", serving_factory=lambda: Serving(engine)))
    families = _scrape(server)

    def value(name: str, sample: str | None = None) -> float:
        return next(s.value for s in families[name] if s.name == (sample or name))

    assert value("paged_kv_blocks_total") == 8 and value("paged_kv_blocks_cached") == 2
    assert value("paged_num_requests_running") == 0
    assert value("paged_prefix_cache_hits", "paged_prefix_cache_hits_total") == 10
    assert value("paged_num_preemptions", "paged_num_preemptions_total") == 1
    assert value("paged_prefix_cache_hit_rate") == pytest.approx(0.25)
    assert value("paged_kv_cache_usage") == 0.0
    ttft = {s.labels.get("le"): s.value for s in families["paged_ttft_seconds"] if s.name.endswith("_bucket")}
    assert ttft["0.005"] == 1 and ttft["0.25"] == 2 and ttft["+Inf"] == 3
    assert value("paged_ttft_seconds", "paged_ttft_seconds_count") == 3
    assert value("paged_ttft_seconds", "paged_ttft_seconds_sum") == pytest.approx(3.204)
    assert value("paged_itl_seconds", "paged_itl_seconds_count") == 0
    # the scrape itself is not counted yet; the first one shows up in the second scrape
    http = {(s.labels["route"], s.labels["status"]): s.value for s in _scrape(server)["paged_http_requests"] if s.name.endswith("_total")}
    assert http[("/metrics", "200")] == 1


def test_histogram_parts_matches_the_engine_histogram():
    """Object and snapshot forms give the same cumulative buckets, ending in +Inf = count."""
    hist = Histogram(bounds=(0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 9.0):
        hist.observe(value)
    expected = ([("0.1", 1.0), ("1.0", 3.0), ("+Inf", 4.0)], 4.0, 10.05)
    assert histogram_parts(hist) == expected
    assert histogram_parts(hist.snapshot()) == expected
