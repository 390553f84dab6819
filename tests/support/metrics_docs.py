"""docs/server.md's metrics table, the list /metrics and the Grafana dashboard are checked against."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def documented_metrics() -> dict[str, str]:
    """Every row of the Metrics section's table: exposed name (counters with ``_total``) -> type."""
    text = (DOCS / "server.md").read_text()
    section = text[text.index("## Metrics") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = re.findall(r"^\| `(paged_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", section, re.M)
    assert rows, "docs/server.md has no metrics table"
    return dict(rows)
