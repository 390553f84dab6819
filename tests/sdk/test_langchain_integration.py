"""PagedChat against LangChain's standard integration suite, on the bundled model."""

from __future__ import annotations

from typing import Any

from langchain_tests.integration_tests import ChatModelIntegrationTests

from sdk.integrations.langchain import PagedChat


class TestPagedChatIntegration(ChatModelIntegrationTests):
    """The standard suite; tools, structured output, JSON mode and non-text inputs are switched off."""

    @property
    def chat_model_class(self) -> type[PagedChat]:
        return PagedChat

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # NOTE: short greedy replies keep the suite fast on CPU; every test only needs non-empty text.
        return {"max_tokens": 8, "temperature": 0}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True
