"""The tiny-model fixture builds every architecture the engine claims to support."""

import pytest
from tiny_models import TINY_ARCHS


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_tiny_model_builds_and_resolves(tiny_model_factory, arch: str) -> None:
    """Each tiny model is a valid HF directory that the loader accepts."""
    from engine.loader import resolve_model

    path = tiny_model_factory(arch)
    assert resolve_model(path) == path
