"""Engine test fixtures shared across folders."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture()
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model-metadata cache (``PAGED_CACHE``), so a test sees the first load."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGED_CACHE", str(cache))
    return cache
