"""SDK fixtures: the bundled tokenizer, a fake engine behind the in-process transport, clients over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeAsyncEngine  # tests/sdk is on sys.path (rootdir-relative imports)

from sdk import AsyncClient
from sdk.transport import InProcessTransport


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
def make_client(fake_engine: FakeAsyncEngine):
    """``make_client(**kwargs) -> AsyncClient`` over the fake engine."""

    def make(**kwargs: Any) -> AsyncClient:
        return AsyncClient(transport=InProcessTransport(fake_engine), **kwargs)

    return make


@pytest.fixture
def shared_fake(monkeypatch: pytest.MonkeyPatch, fake_engine: FakeAsyncEngine) -> FakeAsyncEngine:
    """Make the process-wide engine registry hand out the fake engine (for adapters built by name)."""
    monkeypatch.setattr("sdk.transport.shared_engine", lambda model=None, **config: fake_engine)
    return fake_engine
