"""``/metrics``: the engine's ``stats()`` in Prometheus text format, read at scrape time.

Names are ``paged_`` + the ``Engine.stats()`` key; monotonic figures are counters (the
exposition adds ``_total``), the rest gauges, the ``*_seconds`` latencies histograms. Four
labelled families: ``paged_request_success_total{finished_reason}``,
``paged_tenant_requests{tenant,state}``, ``paged_tenant_computed_tokens_total{tenant}`` and
``paged_spec_decode_num_accepted_tokens_per_pos_total{position}``.
Two derived gauges: ``paged_kv_cache_usage`` (used / total blocks) and
``paged_prefix_cache_hit_rate`` (hit tokens / queried tokens). The server adds its own
``paged_http_requests_total{route,status}``, ``paged_pooling_requests_total{route}``,
``paged_pooling_prompt_tokens_total{route}`` and ``paged_requests_continued_total`` (the fleet's failover). The pooling engines' batches (``stats()["pooling"]``, every
engine of the server together) are ``paged_pooling_{inputs,tokens,batches}_total{kind}`` and the histograms
``paged_pooling_{queue_time_seconds,compute_time_seconds,batch_size}{kind}``. docs/server.md lists them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

PREFIX = "paged_"

GAUGES = {
    "num_requests_running": "Requests running in the current batch.",
    "num_requests_waiting": "Requests waiting for admission into the batch.",
    "kv_blocks_total": "KV cache blocks in the pool.",
    "kv_blocks_used": "KV cache blocks referenced by running requests.",
    "kv_blocks_cached": "Free KV cache blocks that still hold a reusable prefix.",
    "kv_token_usage": "Tokens held in the used KV blocks / the slots of those blocks.",
}
COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "prompt_tokens_computed": "Prompt tokens run through the model.",
    "generation_tokens": "Tokens generated.",
    "num_preemptions": "Requests preempted for lack of KV blocks.",
    "engine_restarts": "Fresh engines started (or tried) after the engine's driver died.",
    "requests_resumed": "Requests in flight at a driver death re-queued on the fresh engine, their streams going on.",
    "requests_poisoned": "Requests failed with RequestPoisoned: in flight at too many driver deaths.",
    "kv_evictions": "Cached KV blocks evicted to make room.",
    "requests_received": "Requests the engine took.",
    "requests_aborted": "Requests that ended aborted (cancelled, disconnected or failed).",
    "requests_rejected": "Requests refused before entering the engine (invalid, or admission limits full).",
    "spec_decode_num_draft_tokens": "Draft tokens verified (speculative decoding).",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted (speculative decoding).",
    "mm_encoder_runs": "Images the vision encoder encoded (multimodal models).",
    "mm_encoder_cache_hits": "Images whose embeddings came from the encoder cache (multimodal models).",
}
HISTOGRAMS = {
    "ttft_seconds": "Time to first token.",
    "itl_seconds": "Inter-token latency.",
    "e2e_request_latency_seconds": "Request latency, arrival to finish.",
    "request_queue_time_seconds": "Time from arrival to first scheduled.",
    "request_prefill_time_seconds": "Time from first scheduled to first token.",
    "request_decode_time_seconds": "Time from first token to finish.",
}
# NOTE: always exposed, so a dashboard's series exist before the first request ends that way.
SUCCESS_REASONS = ("stop", "length")

POOLING_ROUTES = ("/v1/embeddings", "/v1/rerank", "/v1/score")  # /rerank and /score count as their /v1 twins
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labelled(
    family: type[Any], name: str, doc: str, labels: list[str], samples: Iterable[tuple[list[str], float]]
) -> Any:
    """A metric family of labelled samples: ``(label values, value)`` each."""
    metric = family(PREFIX + name, doc, labels=labels)
    for values, value in samples:
        metric.add_metric(values, float(value))
    return metric


class EngineCollector(Collector):
    """A collector over a ``stats()`` callable; reports nothing until one is bound."""

    def __init__(self) -> None:
        self._stats: Callable[[], Mapping[str, Any]] | None = None

    def bind(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        if self._stats is None:
            return
        stats = self._stats()
        for key, doc in GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(PREFIX + key, doc, value=float(stats[key]))
        for key, doc in COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(PREFIX + key, doc, value=float(stats[key]))
        total, used = stats.get("kv_blocks_total"), stats.get("kv_blocks_used")
        if total:
            yield GaugeMetricFamily(
                PREFIX + "kv_cache_usage", "Fraction of KV blocks in use.", value=used / total
            )
        queries, hits = stats.get("prefix_cache_queries"), stats.get("prefix_cache_hits")
        if queries is not None and hits is not None:
            yield GaugeMetricFamily(
                PREFIX + "prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / prompt tokens queried.",
                value=hits / queries if queries else 0.0,
            )
        if "request_success" in stats:
            counts = {reason: 0 for reason in SUCCESS_REASONS} | dict(stats["request_success"])
            yield _labelled(
                CounterMetricFamily, "request_success", "Requests finished, by finish reason (aborts apart).",
                ["finished_reason"], (([reason], n) for reason, n in counts.items()),
            )  # fmt: skip
        if "tenant_requests" in stats:
            yield _labelled(
                GaugeMetricFamily, "tenant_requests", "Requests of each active tenant, running or waiting.",
                ["tenant", "state"],
                (([tenant, state], states[state]) for tenant, states in stats["tenant_requests"].items()
                 for state in ("running", "waiting")),
            )  # fmt: skip
        if "tenant_computed_tokens" in stats:
            yield _labelled(
                CounterMetricFamily, "tenant_computed_tokens",
                "Tokens computed for each tenant (its fair-share usage).", ["tenant"],
                (([tenant], n) for tenant, n in stats["tenant_computed_tokens"].items()),
            )  # fmt: skip
        if "spec_decode_num_accepted_tokens_per_pos" in stats:
            yield _labelled(
                CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the drafts.", ["position"],
                (([str(position)], n) for position, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"])),
            )  # fmt: skip
        for key, doc in HISTOGRAMS.items():
            if key in stats:
                buckets, _, total_sum = histogram_parts(stats[key])
                yield HistogramMetricFamily(
                    PREFIX + key, doc, buckets=buckets, sum_value=total_sum
                )
        if "pooling" in stats:
            yield from _pooling_families(stats["pooling"])


# the pooling engines' figures by kind (engine.pooling.pooling_stats): stats key -> (exported name, help)
POOLING_COUNTERS = {
    "inputs": ("pooling_inputs", "Inputs the pooling models ran (embeddings, scored pairs), by kind."),
    "tokens": ("pooling_tokens", "Tokens of the inputs the pooling models ran, by kind."),
    "batches": ("pooling_batches", "Batches the pooling models ran, by kind."),
}
POOLING_HISTOGRAMS = {
    "queue_time_seconds": ("pooling_queue_time_seconds", "Pooling input's wait from arrival to its batch's start, by kind."),
    "compute_time_seconds": ("pooling_compute_time_seconds", "Run time of the pooling input's batch, by kind."),
    "batch_size": ("pooling_batch_size", "Inputs per pooling batch, by kind."),
}


def _pooling_families(pooling: Mapping[str, Mapping[str, Any]]) -> Iterator[Any]:
    """``paged_pooling_*{kind}``: every kind's counters and histograms."""
    for key, (name, doc) in POOLING_COUNTERS.items():
        yield _labelled(CounterMetricFamily, name, doc, ["kind"], (([kind], figures[key]) for kind, figures in pooling.items()))
    for key, (name, doc) in POOLING_HISTOGRAMS.items():
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["kind"])
        for kind, figures in pooling.items():
            buckets, _, total_sum = histogram_parts(figures[key])
            family.add_metric([kind], buckets, total_sum)
        yield family


def histogram_parts(hist: Any) -> tuple[list[tuple[str, float]], float, float]:
    """Cumulative ``(le, count)`` buckets ending in ``+Inf``, the count and the sum of a histogram.

    Takes ``engine.metrics.Histogram`` or its ``snapshot()`` dict (cumulative ``[le, count]``
    pairs under ``buckets``).
    """
    if hasattr(hist, "snapshot"):
        hist = hist.snapshot()
    count = float(hist["count"])
    buckets = [(repr(float(le)), float(c)) for le, c in hist["buckets"] if not math.isinf(le)]
    buckets.append(("+Inf", count))
    return buckets, count, float(hist["sum"])


class ServerMetrics:
    """The server's own registry: the engine collector plus HTTP request counts."""

    def __init__(self, collector: EngineCollector) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.pooling_requests = Counter(
            PREFIX + "pooling_requests", "Embedding, rerank and score requests answered, by route.", ["route"],
            registry=self.registry,
        )  # fmt: skip
        self.pooling_tokens = Counter(
            PREFIX + "pooling_prompt_tokens", "Tokens the pooling model read, by route.", ["route"],
            registry=self.registry,
        )  # fmt: skip
        self.requests_continued = Counter(
            PREFIX + "requests_continued",
            "Streams continued here from the tokens their client received from a replica that died (a fleet's).",
            registry=self.registry,
        )
        for route in POOLING_ROUTES:  # NOTE: the series exist before the first request
            self.pooling_requests.labels(route)
            self.pooling_tokens.labels(route)

    def render(self) -> bytes:
        return generate_latest(self.registry)
