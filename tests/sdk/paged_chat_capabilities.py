"""What PagedChat declares to LangChain's standard suites, shared by the unit and integration suites."""

from __future__ import annotations

from sdk.integrations.langchain import PagedChat


class PagedChatCapabilities:
    """Tool calling (with tool_choice), structured output (JSON schema and JSON mode) and usage
    metadata are on; image inputs are off."""

    @property
    def chat_model_class(self) -> type[PagedChat]:
        return PagedChat

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True
