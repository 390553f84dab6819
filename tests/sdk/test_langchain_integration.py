"""PagedChat against LangChain's standard integration suite, on the bundled model."""

from __future__ import annotations

from typing import Any

from langchain_tests.integration_tests import ChatModelIntegrationTests
from paged_chat_capabilities import PagedChatCapabilities


class TestPagedChatIntegration(PagedChatCapabilities, ChatModelIntegrationTests):
    """The standard suite; tools, structured output, JSON mode and non-text inputs are switched off."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # NOTE: short greedy replies keep the suite fast on CPU; every test only needs non-empty text.
        return {"max_tokens": 8, "temperature": 0}

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False
