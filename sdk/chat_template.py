"""Messages -> prompt token ids through the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sdk.errors import InvalidRequestError
from sdk.types import ChatMessage


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    The template is rendered to text, then tokenized without adding special tokens (the
    template writes its own), so a conversation's ids start with the ids of any prefix of
    its messages rendered without a generation prompt: that is what prefix pinning relies on.

    Raises:
        InvalidRequestError: the tokenizer has no chat template, or the template rejects the
            conversation (e.g. a role order it does not allow).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the model's tokenizer has no chat template; use complete() with a raw prompt")
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja raises TemplateError (and others) for conversations it rejects
        raise InvalidRequestError(f"the chat template rejected the conversation: {exc}") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))
