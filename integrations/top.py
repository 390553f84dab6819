"""``paged top``: a terminal monitor of a running server, read from its ``/metrics``.

Every ``--interval`` seconds it scrapes ``/metrics`` (with the API key) and shows requests
running and waiting, KV blocks used and cached, token utilization, prefix hit rate, output
tokens/s, pooling (embedding, rerank, score) requests and tokens read per second and inputs per
batch, TTFT / ITL / end-to-end p50 and p99 (and each pooling kind's queue and compute time),
preemptions and per-tenant load; a server of several chat models (``paged serve --model A --model B``)
adds a row per model, the other figures summing over them. Rates and
"last 10 s" quantiles come from the difference between this scrape and the oldest one kept
within ``WINDOW_S``; quantiles are interpolated inside histogram buckets, as Prometheus'
``histogram_quantile`` does. A metric the server does not export shows as ``-``.

On a terminal it redraws in place on the alternate screen (plain escape codes, so it works
over SSH) until ``q`` or Ctrl-C; ``--once``, or a stdout that is not a terminal, prints
plain frames instead.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from integrations.errors import CommandError

WINDOW_S = 10.0  # how far back rates and recent quantiles look
PLAIN_WIDTH = 120  # columns of a plain frame written to a pipe or a file
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
LATENCIES = {  # row label -> histogram (paged_<name>_seconds)
    "TTFT": "paged_ttft_seconds",
    "ITL": "paged_itl_seconds",
    "e2e": "paged_e2e_request_latency_seconds",
    "queue": "paged_request_queue_time_seconds",
}

# a pooling kind's rows (embed, score), shown for the kinds that ran: phase -> histogram, labelled by kind
POOLING_LATENCIES = {"queue": "paged_pooling_queue_time_seconds", "compute": "paged_pooling_compute_time_seconds"}

Labels = dict[str, str]


class ScrapeError(CommandError):
    """``/metrics`` could not be read; ``fatal`` when retrying cannot help (the key was refused)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root (default: %(default)s)")
    parser.add_argument(
        "--api-key", default=os.environ.get("PAGED_API_KEY"), help="the server's API key (default: $PAGED_API_KEY)"
    )
    parser.add_argument("--interval", type=_positive_float, default=1.0, help="seconds between scrapes (default: 1)")
    parser.add_argument(
        "--once", action="store_true", help="print one plain frame (two scrapes an interval apart) and exit"
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


# ------------------------------------------------------------------------------------ scraping


@dataclass
class Scrape:
    """One read of ``/metrics``: samples by sample name (``paged_x_total``, ``paged_y_bucket``)."""

    time: float
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, at: float) -> Scrape:
        from prometheus_client.parser import text_string_to_metric_families

        scrape = cls(at)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                scrape.samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        return scrape

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of ``name``'s samples whose labels include ``labels``; None when there are none."""
        found = [v for sample_labels, v in self.samples.get(name, ()) if labels.items() <= sample_labels.items()]
        return sum(found) if found else None

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({lbls[label] for lbls, _ in self.samples.get(name, ()) if label in lbls})

    def buckets(self, histogram: str, **labels: str) -> list[tuple[float, float]]:
        """Cumulative ``(le, count)`` pairs of a histogram, by bound (``+Inf`` last), summed over the label sets
        that include ``labels``."""
        counts: dict[float, float] = {}
        for lbls, v in self.samples.get(histogram + "_bucket", ()):
            if "le" in lbls and labels.items() <= lbls.items():
                counts[float(lbls["le"])] = counts.get(float(lbls["le"]), 0.0) + v
        return sorted(counts.items())


def scrape(url: str, api_key: str | None, timeout: float = 5.0) -> Scrape:
    """Read ``url``/metrics once.

    Raises:
        ScrapeError: the server is unreachable, answered other than 200, or refused the key
            (401/403, ``fatal``).
    """
    target = url.rstrip("/").removesuffix("/v1") + "/metrics"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(target, headers=headers), timeout=timeout) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            hint = "the key was refused" if api_key else "it needs a key: pass --api-key or set PAGED_API_KEY"
            raise ScrapeError(f"{target} answered {exc.code}: {hint}", fatal=True) from None
        raise ScrapeError(f"{target} answered {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ScrapeError(f"cannot reach {target}: {reason}") from None
    try:
        return Scrape.parse(text, time.monotonic())
    except ValueError as exc:
        raise ScrapeError(f"{target} is not Prometheus text: {exc}") from None


# ------------------------------------------------------------------------------------ figures


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0-1) of cumulative ``(le, count)`` buckets, linear within a bucket; None if empty.

    A rank in the ``+Inf`` bucket gives the largest finite bound (Prometheus does the same).
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = (le if not math.isinf(le) else lower), count
    return lower


def _delta(now: float | None, then: float | None) -> float | None:
    if now is None:
        return None
    if then is None or now < then:  # absent before, or the server restarted (counters reset)
        return now
    return now - then


@dataclass
class Figures:
    """What one frame shows, from the latest scrape and the window's base (None = not exported)."""

    current: Scrape
    base: Scrape | None

    @property
    def window_s(self) -> float | None:
        return self.current.time - self.base.time if self.base else None

    def value(self, name: str, **labels: str) -> float | None:
        return self.current.value(name, **labels)

    def increase(self, name: str, **labels: str) -> float | None:
        if self.base is None:
            return None
        return _delta(self.current.value(name, **labels), self.base.value(name, **labels))

    def rate(self, name: str, **labels: str) -> float | None:
        increase, window = self.increase(name, **labels), self.window_s
        return None if increase is None or not window else increase / window

    def finished_rate(self) -> float | None:
        """Finished requests/s: the engine's success + aborted counters, else HTTP 200s on the generation routes."""
        success = self.rate("paged_request_success_total")
        if success is not None:
            return success + (self.rate("paged_requests_aborted_total") or 0.0)
        rates = [self.rate("paged_http_requests_total", route=r, status="200") for r in GENERATION_ROUTES]
        rates = [r for r in rates if r is not None]
        return sum(rates) if rates else None

    def pooling_rate(self, name: str) -> float | None:
        """The rate of a pooling counter (``paged_pooling_*_total``) over every route; None when not exported."""
        rates = [self.rate(name, route=r) for r in self.current.label_values(name, "route")]
        rates = [r for r in rates if r is not None]
        return sum(rates) if rates else None

    def pooling_kinds(self) -> list[str]:
        """The pooling kinds (``embed``, ``score``) whose engines ran inputs since the server started."""
        kinds = self.current.label_values("paged_pooling_inputs_total", "kind")
        return [k for k in kinds if self.value("paged_pooling_inputs_total", kind=k)]

    def pooling_batch_size(self) -> float | None:
        """Mean inputs per pooling batch over the window, every kind together; None without a batch in it."""
        inputs, batches = self.increase("paged_pooling_batch_size_sum"), self.increase("paged_pooling_batch_size_count")
        return None if not batches or inputs is None else inputs / batches

    def window_hit_rate(self) -> float | None:
        queries = self.increase("paged_prefix_cache_queries_total")
        hits = self.increase("paged_prefix_cache_hits_total")
        return None if not queries or hits is None else hits / queries

    def quantile(self, histogram: str, q: float, recent: bool, **labels: str) -> float | None:
        now = self.current.buckets(histogram, **labels)
        if not recent:
            return histogram_quantile(q, now)
        if self.base is None:
            return None
        then = dict(self.base.buckets(histogram, **labels))
        recent_buckets = [(le, _delta(count, then.get(le)) or 0.0) for le, count in now]
        return histogram_quantile(q, recent_buckets)

    def models(self) -> list[str]:
        """The chat models of a server that serves several (its engine metrics carry a ``model`` label)."""
        return self.current.label_values("paged_kv_blocks_total", "model")

    def tenants(self) -> list[str]:
        names = set(self.current.label_values("paged_tenant_requests", "tenant"))
        names.update(self.current.label_values("paged_tenant_computed_tokens_total", "tenant"))
        return sorted(names)


class History:
    """The scrapes within ``WINDOW_S`` of the latest; the oldest is the base of rates."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._scrapes: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> Figures:
        self._scrapes.append(scrape)
        # NOTE: keep one scrape at or beyond the window's start, so a long interval still has a base.
        while len(self._scrapes) > 2 and self._scrapes[1].time <= scrape.time - self.window_s:
            self._scrapes.popleft()
        return Figures(scrape, self._scrapes[0] if len(self._scrapes) > 1 else None)


# ------------------------------------------------------------------------------------ rendering


def _num(value: float | None, spec: str = ".0f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def render(figures: Figures, url: str, problem: str | None = None) -> Any:
    """The frame for ``figures``: a header line and the request, KV, throughput, latency and tenant tables."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    f = figures
    window = f.window_s
    header = Text(f"paged top  {url}  {datetime.now():%H:%M:%S}", style="bold")
    header.append(f"  rates over {window:.1f} s" if window else "  rates after the next scrape")
    header.append("  (q or Ctrl-C quits)", style="dim")
    status = Text(problem or "", style="bold red")

    def pairs(title: str, rows: list[tuple[str, str]]) -> Table:
        table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(justify="right", no_wrap=True)
        for label, value in rows:
            table.add_row(label, value)
        return table

    total_blocks, used_blocks = f.value("paged_kv_blocks_total"), f.value("paged_kv_blocks_used")
    preempt = f.value("paged_num_preemptions_total")
    requests = pairs("Requests", [
        ("running", _num(f.value("paged_num_requests_running"))),
        ("waiting", _num(f.value("paged_num_requests_waiting"))),
        ("finished/s", _num(f.finished_rate(), ".2f")),
        ("received", _num(f.value("paged_requests_received_total"))),
        ("aborted", _num(f.value("paged_requests_aborted_total"))),
        ("rejected", _num(f.value("paged_requests_rejected_total"))),
    ])  # fmt: skip
    kv = pairs("KV cache", [
        ("blocks used / total", f"{_num(used_blocks)} / {_num(total_blocks)}"),
        ("blocks cached", _num(f.value("paged_kv_blocks_cached"))),
        ("block usage", _num(f.value("paged_kv_cache_usage"), ".1%")),
        ("token utilization", _num(f.value("paged_kv_token_usage"), ".1%")),
        ("evictions", _num(f.value("paged_kv_evictions_total"))),
    ])  # fmt: skip
    throughput = pairs("Throughput", [
        ("output tok/s", _num(f.rate("paged_generation_tokens_total"), ".1f")),
        ("prompt tok/s computed", _num(f.rate("paged_prompt_tokens_computed_total"), ".1f")),
        ("prefix hit (window)", _num(f.window_hit_rate(), ".1%")),
        ("prefix hit (total)", _num(f.value("paged_prefix_cache_hit_rate"), ".1%")),
        ("preemptions", f"{_num(preempt)} (+{_num(f.increase('paged_num_preemptions_total'))})"),
        ("engine restarts", _num(f.value("paged_engine_restarts_total"))),
        ("pooling req/s", _num(f.pooling_rate("paged_pooling_requests_total"), ".2f")),
        ("pooling tok/s", _num(f.pooling_rate("paged_pooling_prompt_tokens_total"), ".1f")),
        ("pooling batch (window)", _num(f.pooling_batch_size(), ".1f")),
        ("requests resumed", _num(f.value("paged_requests_resumed_total"))),
    ])  # fmt: skip

    latency = Table(title="Latency", title_justify="left", box=None, pad_edge=False)
    latency.add_column("", style="cyan")
    for name in ("p50 window", "p99 window", "p50 total", "p99 total"):
        latency.add_column(name, justify="right")
    rows: list[tuple[str, str, dict[str, str]]] = [(label, histogram, {}) for label, histogram in LATENCIES.items()]
    for kind in f.pooling_kinds():
        rows += [(f"{kind} {phase}", histogram, {"kind": kind}) for phase, histogram in POOLING_LATENCIES.items()]
    for label, histogram, labels in rows:
        cells = [_ms(f.quantile(histogram, q, recent, **labels)) for recent in (True, False) for q in (0.5, 0.99)]
        latency.add_row(label, *cells)

    tenants = Table(title="Tenants", title_justify="left", box=None, pad_edge=False)
    for name in ("tenant", "running", "waiting", "computed tok/s"):
        tenants.add_column(name, justify="left" if name == "tenant" else "right")
    names = f.tenants()
    for tenant in names:
        tenants.add_row(
            tenant,
            _num(f.value("paged_tenant_requests", tenant=tenant, state="running")),
            _num(f.value("paged_tenant_requests", tenant=tenant, state="waiting")),
            _num(f.rate("paged_tenant_computed_tokens_total", tenant=tenant), ".1f"),
        )
    if not names:
        tenants.add_row("-", "-", "-", "-")

    top_row = Table.grid(padding=(0, 4))
    top_row.add_row(requests, kv, throughput)
    parts = [header, status, top_row, Text(""), latency, Text(""), tenants]
    if f.models():  # NOTE: the tables above sum over the models; this one shows each
        models = Table(title="Models", title_justify="left", box=None, pad_edge=False)
        for name in ("model", "running", "waiting", "output tok/s", "blocks used / total", "TTFT p99 window"):
            models.add_column(name, justify="left" if name == "model" else "right")
        for model in f.models():
            models.add_row(
                model,
                _num(f.value("paged_num_requests_running", model=model)),
                _num(f.value("paged_num_requests_waiting", model=model)),
                _num(f.rate("paged_generation_tokens_total", model=model), ".1f"),
                f"{_num(f.value('paged_kv_blocks_used', model=model))} / "
                f"{_num(f.value('paged_kv_blocks_total', model=model))}",
                _ms(f.quantile("paged_ttft_seconds", 0.99, True, model=model)),
            )
        parts += [Text(""), models]
    return Group(*parts)


# ------------------------------------------------------------------------------------ the loop


class _Keys:
    """Single key presses from a terminal's stdin (cbreak mode; Ctrl-C still raises KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None

    @contextlib.contextmanager
    def cbreak(self) -> Iterator[_Keys]:
        if self.fd is None:
            yield self
            return
        import termios
        import tty

        saved = termios.tcgetattr(self.fd)
        try:
            tty.setcbreak(self.fd)
            yield self
        finally:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)

    def wait(self, timeout: float) -> str | None:
        """The key pressed within ``timeout`` seconds, else None (after sleeping ``timeout``)."""
        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        key = os.read(self.fd, 1).decode(errors="replace")
        if not key:  # the terminal closed its input: stop reading it
            self.fd = None
        return key or None


def run(args: argparse.Namespace) -> int:
    """Monitor ``args.url`` until ``q`` / Ctrl-C (0), or print one frame with ``--once``.

    Raises:
        ScrapeError: the first scrape failed, or the key was refused at any time (``paged`` prints
            the message and exits 1).
    """
    from rich.console import Console

    history = History()
    try:
        figures = history.add(scrape(args.url, args.api_key))
        if args.once or not sys.stdout.isatty():
            # NOTE: a frame for a log or a pipe is as wide as it needs, not the 80 columns rich assumes there
            width = None if sys.stdout.isatty() else PLAIN_WIDTH
            return _plain(args, history, figures, Console(highlight=False, width=width))
        return _live(args, history, figures)
    except KeyboardInterrupt:
        return 0


def _plain(args: argparse.Namespace, history: History, figures: Figures, console: Any) -> int:
    while True:
        time.sleep(args.interval)
        figures, problem = _next(args, history, figures)
        console.print(render(figures, args.url, problem))
        if args.once:
            return 0
        console.print()


def _live(args: argparse.Namespace, history: History, figures: Figures) -> int:
    from rich.console import Console
    from rich.live import Live

    keys = _Keys()
    console = Console()
    with keys.cbreak(), Live(render(figures, args.url), console=console, screen=True, auto_refresh=False) as live:
        while keys.wait(args.interval) not in ("q", "Q"):
            figures, problem = _next(args, history, figures)
            live.update(render(figures, args.url, problem), refresh=True)
    return 0


def _next(args: argparse.Namespace, history: History, last: Figures) -> tuple[Figures, str | None]:
    """The next frame's figures; a server gone away keeps the last figures and says so (a refused key ends)."""
    try:
        return history.add(scrape(args.url, args.api_key)), None
    except ScrapeError as exc:
        if exc.fatal:
            raise
        return last, f"{exc} (retrying every {args.interval:g} s)"
