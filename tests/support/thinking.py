"""A thinking model's pieces for tests: chat templates that think, a scripted reply, a tool and its call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine.outputs import Delta, Usage
from engine.sampling_params import SamplingParams
from sdk.tools import to_tools
from tests.sdk.fake_engine import FakeAsyncEngine

# A Qwen3-style template: earlier turns lose their thinking, enable_thinking=False closes it in the prompt.
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' %}{{ (m.content or '').split('</think>')[-1].lstrip('\\n') }}"
    "{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
# DeepSeek-R1 distills' shape: the generation prompt opens the thinking.
R1_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- else %}<｜Assistant｜>{{ (m.content or '').split('</think>')[-1] }}<｜end▁of▁sentence｜>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜><think>\n{%- endif %}"
)
REPLY = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = to_tools([{"name": "add", "parameters": SCHEMA}])
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


class ScriptedReplyEngine(FakeAsyncEngine):
    """Replies ``reply`` token by token (markers split across deltas as the tokenizer splits them),
    then stops; keeps each request's prompt and sampling params."""

    def __init__(self, tokenizer: Any, reply: str) -> None:
        super().__init__(tokenizer)
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def stream(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
        priority: int = 0, cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        self.prompts.append(ids)
        self.params.append(params)
        num_sent_chars = 0
        for n in range(1, len(self.reply_ids) + 1):
            text = self.tokenizer.decode(self.reply_ids[:n])
            last = n == len(self.reply_ids)
            delta = Delta(request_id or "scripted", 0, text[num_sent_chars:], self.reply_ids[n - 1 : n],
                          finish_reason="stop" if last else None)  # fmt: skip
            num_sent_chars = len(text)
            if n == 1:
                delta.prompt_token_ids, delta.num_cached_tokens = ids, 0
            if last:
                delta.usage = Usage(len(ids), n, 0)
            yield delta
