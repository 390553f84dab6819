"""What PagedChat declares to LangChain's standard suites, shared by the unit and integration suites."""

from __future__ import annotations

from sdk.integrations.langchain import PagedChat


class PagedChatCapabilities:
    """Tools, structured output and image inputs are off; usage metadata is on."""

    @property
    def chat_model_class(self) -> type[PagedChat]:
        return PagedChat

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True
