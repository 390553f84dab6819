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
import weakref
from collections.abc import Sequence
from typing import Any

from sdk.errors import InvalidRequestError
from sdk.tools import CALL_BEGIN, CALL_END, ToolSpec, format_call
from sdk.types import ChatMessage

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
) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered with the tokenizer's chat template.

    ``chat_template_kwargs`` are extra template variables (Qwen3's ``enable_thinking``); a
    template that does not read one ignores it.

    The template is rendered to text, then tokenized without adding special tokens (the
    template writes its own), so a conversation's ids start with the ids of any prefix of
    its messages rendered without a generation prompt: that is what prefix pinning relies on.

    Raises:
        InvalidRequestError: the tokenizer has no chat template, the template rejects the
            conversation (e.g. a role order it does not allow), or the rendered text cannot
            fit ``max_model_len`` by its characters (``check_prompt_chars``, before tokenizing).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("the model's tokenizer has no chat template; use complete() with a raw prompt")
    extra: dict[str, Any] = dict(chat_template_kwargs or {})
    if renders_tools(template):
        conversation = [_native(m) for m in messages]
        if tools:
            extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    else:
        conversation = _with_default_tool_prompt(messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as exc:  # jinja raises TemplateError (and others) for conversations it rejects
        raise InvalidRequestError(f"the chat template rejected the conversation: {exc}") from exc
    if max_model_len is not None:
        check_prompt_chars(tokenizer, len(text), max_model_len)
    return list(tokenizer.encode(text, add_special_tokens=False))


def renders_tools(template: str) -> bool:
    """Whether a chat template renders tools and Hermes-style calls itself."""
    return "tools" in template and CALL_BEGIN in template


def _native(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it (OpenAI's shape, arguments as a dict)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
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


def _with_default_tool_prompt(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: every message plain text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":  # NOTE: one user turn per result keeps every shorter conversation a prefix
            out.append({"role": "user", "content": f"<tool_response>\n{m.content or ''}\n</tool_response>"})
            continue
        content = m.content or ""
        if m.tool_calls:  # NOTE: as the model wrote them: its text, then the calls, back to back
            content += "".join(format_call(c) for c in m.tool_calls)
        out.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    if tools:
        section = DEFAULT_TOOL_PROMPT.format(
            tools="\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools),
            begin=CALL_BEGIN, end=CALL_END,
        )  # fmt: skip
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
