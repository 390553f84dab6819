"""PagedChat against LangChain's standard integration suite, on the bundled model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from paged_chat_capabilities import PagedChatCapabilities

from sdk import Runtime

# NOTE: the jokes' strings have no length bound, and greedy decoding on a 135M model can loop
# inside one; a mild repetition penalty lets the reply close its JSON within max_tokens.
STRUCTURED_PARAMS = {"max_tokens": 128, "repetition_penalty": 1.1}

RUNTIME = Runtime()
"""The bundled model's engine, shared by every model the suite builds (loaded once, on first use)."""


@pytest.fixture(scope="module", autouse=True)
def _close_runtime() -> Iterator[None]:
    yield
    RUNTIME.close()


class TestPagedChatIntegration(PagedChatCapabilities, ChatModelIntegrationTests):
    """The standard suite; tools, model override and non-text inputs are switched off."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # NOTE: short greedy replies keep the suite fast on CPU; every test but the
        # structured-output ones (STRUCTURED_PARAMS) only needs non-empty text.
        return {"max_tokens": 8, "temperature": 0, "runtime": RUNTIME}

    @property
    def supports_model_override(self) -> bool:
        return False

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Give the structured-output tests' model room for a whole JSON reply."""
        name = metafunc.function.__name__
        if name.startswith("test_structured_output") or name == "test_json_mode":
            metafunc.parametrize("model", [STRUCTURED_PARAMS], indirect=True, ids=["structured"])
