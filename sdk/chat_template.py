"""Messages (and tools) -> prompt token ids through the model's own chat template.

Tools and tool turns render through the template when it writes Hermes-style calls (Qwen2,
Qwen2.5, Qwen3, Hermes: its source mentions ``<tool_call>``). Any other template (the bundled
SmolLM2's among them) gets the default tool prompt: the tools and the call format appended to
the system message, assistant calls written as the model writes them (``sdk.tools.format_call``)
and tool results as user turns in ``<tool_response>`` tags. Either way a conversation re-sent
with one more turn starts with the same tokens, so its earlier turns come from the prefix cache.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Sequence
from typing import Any

from sdk.errors import InvalidRequestError
from sdk.tools import CALL_BEGIN, CALL_END, ToolSpec, format_call
from sdk.types import ChatMessage, TextPart

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more of these tools. Each line describes one tool as JSON:
{tools}

To call a tool, reply with its name and arguments as JSON inside {begin}{end} tags, one call per tag:
{begin}
{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}
{end}
Tool results come back in <tool_response></tool_response> tags."""


_LONGEST_TOKEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (computed once per tokenizer; ~0.1 s).

    A token's vocabulary string has at least as many characters as its text: byte-level
    tokens spell each byte as one character, SentencePiece tokens their text.
    """
    found = _LONGEST_TOKEN.get(tokenizer)
    if found is None:
        found = _LONGEST_TOKEN[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return found


def check_prompt_chars(tokenizer: Any, num_chars: int, max_model_len: int) -> None:
    """Refuse a prompt whose characters alone show it cannot fit ``max_model_len`` tokens.

    A text of more than ``max_model_len`` times the longest token's characters has more than
    ``max_model_len`` tokens whatever it says (for tokenizers that do not drop characters,
    which Llama-family ones do not). Prompts of at most ``max_model_len`` characters pass
    without looking at the vocabulary.

    Raises:
        InvalidRequestError: past the bound (``param="prompt"``), naming it.
    """
    if num_chars <= max_model_len:
        return
    longest = longest_token_chars(tokenizer)
    if num_chars > max_model_len * longest:
        raise InvalidRequestError(
            f"prompt has {num_chars} characters; at most {max_model_len * longest} can fit max_model_len "
            f"({max_model_len} tokens of at most {longest} characters)",
            param="prompt",
        )


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    tools: Sequence[ToolSpec] | None = None,
    max_model_len: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    image_placeholder: str | None = None,
) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered with the tokenizer's chat template.

    ``chat_template_kwargs`` are extra template variables (Qwen3's ``enable_thinking``); a
    template that does not read one ignores it.

    ``image_placeholder`` is the text that stands for one image in a prompt of a model that
    takes images (None: it takes none, and a message with an image part is refused). A
    template that reads content parts (as Hugging Face processors' templates do) gets every
    message's content as parts, an image as ``{"type": "image"}``; any other template gets
    strings, each image's placeholder before the message's text. Either way the prompt must
    hold the placeholder once per image, in order: text that spells it is refused.

    The template is rendered to text, then tokenized without adding special tokens (the
    template writes its own), so a conversation's ids start with the ids of any prefix of
    its messages rendered without a generation prompt: that is what prefix pinning relies on.

    Raises:
        InvalidRequestError: the tokenizer has no chat template, the template rejects the
            conversation (e.g. a role order it does not allow), an image for a model that takes
            none (naming its part), placeholders that are not one per image, or the rendered text
            cannot fit ``max_model_len`` by its characters (``check_prompt_chars``, before tokenizing).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("the model's tokenizer has no chat template; use complete() with a raw prompt")
    image_fields = [f"messages.{i}.content.{j}" for i, m in enumerate(messages) for j, _ in m.image_parts]
    if image_fields and image_placeholder is None:
        raise InvalidRequestError.about(image_fields[0], "this model takes no images (text only)")
    content = _Content(image_placeholder, image_placeholder is not None and reads_content_parts(template))
    extra: dict[str, Any] = dict(chat_template_kwargs or {})
    if renders_tools(template):
        conversation = [_native(m, content) for m in messages]
        if tools:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    else:
        conversation = _with_default_tool_prompt(messages, tools, content)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as exc:  # jinja raises TemplateError (and others) for conversations it rejects
        raise InvalidRequestError(f"the chat template rejected the conversation: {exc}") from exc
    if image_placeholder is not None and text.count(image_placeholder) != len(image_fields):
        raise InvalidRequestError(
            f"the prompt has {text.count(image_placeholder)} image placeholders ({image_placeholder!r}) for "
            f"{len(image_fields)} images: message text must not spell the placeholder",
            param="messages",
        )
    if max_model_len is not None:
        check_prompt_chars(tokenizer, len(text), max_model_len)
    return list(tokenizer.encode(text, add_special_tokens=False))


def reads_content_parts(template: str) -> bool:
    """Whether a chat template loops over a message's content (parts), as processors' templates do."""
    return _CONTENT_LOOP.search(template) is not None


_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content)")


class _Content:
    """How message content reaches the template: strings, or parts with ``{"type": "image"}`` per image."""

    def __init__(self, image_placeholder: str | None, as_parts: bool) -> None:
        self.image_placeholder = image_placeholder
        self.as_parts = as_parts

    def of(self, message: ChatMessage) -> str | list[dict[str, Any]]:
        content = message.content
        if self.as_parts:
            if not isinstance(content, list):
                return [{"type": "text", "text": content}] if content else []
            return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content]
        images = message.image_parts
        if not images:
            return message.text
        # NOTE: vLLM's string form: one placeholder per image, then the text
        return "\n".join([*(str(self.image_placeholder) for _ in images), message.text])


def renders_tools(template: str) -> bool:
    """Whether a chat template renders tools and Hermes-style calls itself."""
    return "tools" in template and CALL_BEGIN in template


def _native(message: ChatMessage, content: _Content) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it (OpenAI's shape, arguments as a dict)."""
    out: dict[str, Any] = {"role": message.role, "content": content.of(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _with_default_tool_prompt(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None, content: _Content
) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: tool turns and calls as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool" and not m.image_parts:  # NOTE: one user turn per result keeps every shorter conversation a prefix
            out.append({"role": "user", "content": f"<tool_response>\n{m.text}\n</tool_response>"})
            continue
        if m.role == "tool":  # an image result: its parts as a user turn, between the tags
            body = content.of(m)
            tagged = [{"type": "text", "text": "<tool_response>\n"}, *body, {"type": "text", "text": "\n</tool_response>"}]
            out.append({"role": "user", "content": tagged if isinstance(body, list) else f"<tool_response>\n{body}\n</tool_response>"})
            continue
        text = content.of(m)
        if m.tool_calls:  # NOTE: as the model wrote them: its text, then the calls, back to back
            calls = "".join(format_call(c) for c in m.tool_calls)
            text = [*text, {"type": "text", "text": calls}] if isinstance(text, list) else text + calls
        out.append({"role": m.role, "content": text, **({"name": m.name} if m.name else {})})
    if tools:
        section = DEFAULT_TOOL_PROMPT.format(
            tools="\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools),
            begin=CALL_BEGIN, end=CALL_END,
        )  # fmt: skip
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], list):
            out[0]["content"] = [*out[0]["content"], {"type": "text", "text": f"\n\n{section}"}]
        elif out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": [{"type": "text", "text": section}] if content.as_parts else section})
    return out
