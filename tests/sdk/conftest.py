"""SDK fixtures: the bundled tokenizer, a fake engine in a runtime, clients and adapters over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeAsyncEngine  # tests/sdk is on sys.path (rootdir-relative imports)

from sdk import AsyncClient, Runtime


@pytest.fixture(scope="session")
def tokenizer(bundled_model_dir: Path) -> Any:
    """The bundled model's tokenizer (real chat template, real detokenization)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(bundled_model_dir)


@pytest.fixture
def fake_engine(tokenizer: Any) -> FakeAsyncEngine:
    """A fresh fake engine: 4-token blocks, no step delay."""
    return FakeAsyncEngine(tokenizer)


@pytest.fixture
def fake_runtime(fake_engine: FakeAsyncEngine) -> Iterator[Runtime]:
    """A runtime serving the fake engine: give it to clients and adapters as ``runtime=``."""
    with Runtime(engine=fake_engine) as runtime:
        yield runtime


@pytest.fixture
def make_client(fake_runtime: Runtime):
    """``make_client(**kwargs) -> AsyncClient`` over the fake engine."""

    def make(**kwargs: Any) -> AsyncClient:
        return AsyncClient(runtime=fake_runtime, **kwargs)

    return make
