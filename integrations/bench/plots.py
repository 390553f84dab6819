"""Plots of one run (matplotlib, Agg backend): throughput, throughput vs concurrency, latency distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from integrations.bench.report import RunResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(
    out_dir: Path,
    prefix: str,
    results: list[RunResult],
    report: dict[str, Any],
) -> list[Path]:
    """Write the PNGs that the run's data supports; returns their paths.

    Args:
        out_dir: folder to write into (created if missing).
        prefix: file-name prefix, e.g. ``shared-prefix-float32``.
        results: the contenders' raw results (their latency samples).
        report: the JSON document of the run (sweep and poisson sections).
    """
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    if results:
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(results)))
        names = [r.name for r in results]
        rates = [r.tokens_per_s for r in results]
        ax.barh(names[::-1], rates[::-1], color="tab:blue")
        ceiling = report.get("ceiling")
        if ceiling:
            ax.axvline(ceiling["tokens_per_s"], color="tab:red", linestyle="--", label="matmul ceiling")
            ax.legend(loc="lower right")
        ax.set_xlabel("output tokens/s")
        quantization = report["protocol"].get("engine", {}).get("quantization")
        weights = f" (the engine's weights {quantization})" if quantization else ""
        ax.set_title(f"{report['workload']['name']}, {report['protocol']['dtype']}{weights}")
        paths.append(_save(fig, plt, out_dir / f"{prefix}-throughput.png"))

    with_latency = [r for r in results if r.ttft_s or r.itl_s]
    if with_latency:
        fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
        for r in with_latency:
            if r.ttft_s:
                ax_ttft.ecdf(r.ttft_s, label=r.name)
            if r.itl_s:
                ax_itl.ecdf([s * 1e3 for s in r.itl_s], label=r.name)
        ax_ttft.set_xlabel("time to first token (s)")
        ax_itl.set_xlabel("inter-token latency (ms)")
        ax_itl.set_xscale("log")
        for ax in (ax_ttft, ax_itl):
            ax.set_ylabel("fraction of requests" if ax is ax_ttft else "fraction of tokens")
            ax.grid(alpha=0.3)
        ax_ttft.legend(fontsize=7)
        paths.append(_save(fig, plt, out_dir / f"{prefix}-latency.png"))

    sweep = (report.get("sweep") or {}).get("levels")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in sweep[0]["tokens_per_s"]:
            points = [(row["concurrency"], row["tokens_per_s"].get(name)) for row in sweep]
            points = [(c, t) for c, t in points if t is not None]
            ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, plt, out_dir / f"{prefix}-concurrency.png"))

    poisson = report.get("poisson")
    if poisson and poisson.get("runs"):
        fig, ax = plt.subplots(figsize=(6, 4))
        runs = sorted(poisson["runs"], key=lambda p: p["rate"])
        ax.plot([p["rate"] for p in runs], [p["itl_s"]["p99"] * 1e3 for p in runs], marker="o", label="ITL p99")
        ax.plot([p["rate"] for p in runs], [p["itl_s"]["p50"] * 1e3 for p in runs], marker="o", label="ITL p50")
        ax.axhline(poisson["itl_bound_s"] * 1e3, color="tab:red", linestyle="--", label="bound")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("inter-token latency (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, plt, out_dir / f"{prefix}-poisson.png"))
    return paths


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
