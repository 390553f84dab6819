"""Run a snippet in a fresh interpreter: what a module imports shows only where nothing was imported before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str, *args: str) -> dict:
    """Runs ``code`` (with ``args`` as ``sys.argv[1:]``) in a new interpreter at the repository root.

    Returns:
        The JSON of its last stdout line.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])
