"""docs/grafana/paged.json: a valid dashboard whose queries use only metrics docs/server.md lists."""

from __future__ import annotations

import json
import re

from tests.support.metrics_docs import DOCS, documented_metrics

HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def test_every_dashboard_query_uses_documented_metrics() -> None:
    """Each panel's exprs name only documented series; TTFT, ITL and e2e have p50 and p99; every family is charted."""
    dashboard = json.loads((DOCS / "grafana" / "paged.json").read_text())
    documented = documented_metrics()
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    assert exprs and all(p.get("targets") for p in dashboard["panels"] if p["type"] != "row")
    used = set()
    for expr in exprs:
        for series in re.findall(r"\bpaged_[a-z0-9_]+", expr):
            name = series
            if series.endswith(HISTOGRAM_SERIES) and series.rsplit("_", 1)[0] in documented:
                name = series.rsplit("_", 1)[0]
                assert documented[name] == "histogram", f"{expr}: {series} of a {documented[name]}"
            assert name in documented, f"{expr}: {series} is not in docs/server.md's metrics table"
            assert documented[name] != "histogram" or name != series, f"{expr}: a histogram is read by its series"
            used.add(name)
    for histogram in ("paged_ttft_seconds", "paged_itl_seconds", "paged_e2e_request_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[" in "\n".join(exprs)
    assert used == set(documented), f"not charted: {sorted(set(documented) - used)}"
