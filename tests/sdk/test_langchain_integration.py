"""PagedChat against LangChain's standard integration suite, on the bundled model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from paged_chat_capabilities import PagedChatCapabilities

from sdk import Runtime

RUNTIME = Runtime()
"""The bundled model's engine, shared by every model the suite builds (loaded once, on first use)."""


@pytest.fixture(scope="module", autouse=True)
def _close_runtime() -> Iterator[None]:
    yield
    RUNTIME.close()


class TestPagedChatIntegration(PagedChatCapabilities, ChatModelIntegrationTests):
    """The standard suite; tools, structured output, JSON mode and non-text inputs are switched off."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # NOTE: short greedy replies keep the suite fast on CPU; every test only needs non-empty text.
        return {"max_tokens": 8, "temperature": 0, "runtime": RUNTIME}

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False
