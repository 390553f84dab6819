"""``paged figures``: the benchmark tables of the README, docs/benchmarks.md and docs/performance.md, rendered from
the results file that ``paged bench --record`` appends to; ``--check`` only says which pages differ (for CI)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from integrations.bench.figures import PAGES, render_page
from integrations.bench.records import RESULTS_FILE, load_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root", type=Path, default=Path("."), help=f"the project's folder, holding {', '.join(PAGES)} (default: .)"
    )
    parser.add_argument(
        "--results", type=Path, default=None, help=f"the results file (default: {RESULTS_FILE} under --root)"
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming each page whose tables differ from the file"
    )


def run(args: argparse.Namespace) -> int:
    """Render every page's figure blocks; with ``--check``, report the pages that would change instead.

    Raises:
        RecordError: a line of the results file is not a record.
        FiguresError: a page's markers are malformed or name no known figure.
    """
    records = load_records(args.results or args.root / RESULTS_FILE)
    stale = []
    for page in PAGES:
        path = args.root / page
        text = path.read_text()
        rendered = render_page(text, records, page)
        if rendered == text:
            continue
        stale.append(page)
        if not args.check:
            path.write_text(rendered)
    if args.check and stale:
        message = f"tables not rendered from the results file: {', '.join(stale)} (run `paged figures`)"
        print(message, file=sys.stderr)  # noqa: T201
        return 1
    print(f"{'rendered' if stale else 'unchanged'}: {', '.join(stale or PAGES)}")  # noqa: T201
    return 0
