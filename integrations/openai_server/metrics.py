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
``paged_pooling_{queue_time_seconds,compute_time_seconds,batch_size}{kind}``. With several chat models
(``paged serve --model A --model B``) every engine family has a ``model`` label, one series per model (the pooling
families stay summed). docs/server.md lists them all.
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
    """A collector over a ``stats()`` callable; reports nothing until one is bound.

    ``bind`` takes one engine's ``stats()``; ``bind_models`` each chat model's by its served name. One
    model's figures are exported as they are; several models' carry a ``model`` label (vLLM's
    ``model_name``), one series per model in every family, so a sum over the label is the server's whole.
    """

    def __init__(self) -> None:
        self._stats: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None

    def bind(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = lambda: {"": stats()}

    def bind_models(self, stats: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        if self._stats is None:
            return
        by_model = self._stats()
        if not by_model:
            return
        labelled = len(by_model) > 1
        models = [([name] if labelled else [], stats) for name, stats in by_model.items()]
        extra = ["model"] if labelled else []

        def family(
            kind: type[Any], name: str, doc: str, labels: list[str], samples: Iterable[tuple[list[str], float]]
        ) -> Any:
            metric = kind(PREFIX + name, doc, labels=extra + labels)
            for values, value in samples:
                metric.add_metric(values, float(value))
            return metric

        for key, doc in GAUGES.items():
            samples = [(m, s[key]) for m, s in models if key in s]
            if samples:
                yield family(GaugeMetricFamily, key, doc, [], samples)
        for key, doc in COUNTERS.items():
            samples = [(m, s[key]) for m, s in models if key in s]
            if samples:
                yield family(CounterMetricFamily, key, doc, [], samples)
        usage = [(m, s["kv_blocks_used"] / s["kv_blocks_total"]) for m, s in models if s.get("kv_blocks_total")]
        if usage:
            yield family(GaugeMetricFamily, "kv_cache_usage", "Fraction of KV blocks in use.", [], usage)
        hit_rates = [
            (m, s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0)
            for m, s in models if s.get("prefix_cache_queries") is not None and s.get("prefix_cache_hits") is not None
        ]  # fmt: skip
        if hit_rates:
            yield family(
                GaugeMetricFamily, "prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / prompt tokens queried.", [], hit_rates,
            )  # fmt: skip
        if any("request_success" in s for _, s in models):
            yield family(
                CounterMetricFamily, "request_success", "Requests finished, by finish reason (aborts apart).",
                ["finished_reason"],
                ((m + [reason], n) for m, s in models if "request_success" in s
                 for reason, n in ({reason: 0 for reason in SUCCESS_REASONS} | dict(s["request_success"])).items()),
            )  # fmt: skip
        if any("tenant_requests" in s for _, s in models):
            yield family(
                GaugeMetricFamily, "tenant_requests", "Requests of each active tenant, running or waiting.",
                ["tenant", "state"],
                ((m + [tenant, state], states[state]) for m, s in models
                 for tenant, states in s.get("tenant_requests", {}).items() for state in ("running", "waiting")),
            )  # fmt: skip
        if any("tenant_computed_tokens" in s for _, s in models):
            yield family(
                CounterMetricFamily, "tenant_computed_tokens",
                "Tokens computed for each tenant (its fair-share usage).", ["tenant"],
                ((m + [tenant], n) for m, s in models for tenant, n in s.get("tenant_computed_tokens", {}).items()),
            )  # fmt: skip
        if any("spec_decode_num_accepted_tokens_per_pos" in s for _, s in models):
            yield family(
                CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the drafts.", ["position"],
                ((m + [str(position)], n) for m, s in models
                 for position, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", ()))),
            )  # fmt: skip
        for key, doc in HISTOGRAMS.items():
            present = [(m, s[key]) for m, s in models if key in s]
            if present:
                histogram = HistogramMetricFamily(PREFIX + key, doc, labels=extra)
                for m, hist in present:
                    buckets, _, total_sum = histogram_parts(hist)
                    histogram.add_metric(m, buckets, total_sum)
                yield histogram
        pooling = [s["pooling"] for _, s in models if "pooling" in s]
        if pooling:
            yield from _pooling_families(pooling[0])


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
