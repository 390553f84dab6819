"""Ready-made content filters."""

from __future__ import annotations

import re
from typing import Literal

from sdk.errors import ContentBlocked
from sdk.hooks.base import Hook, RequestContext, Stop
from sdk.types import ChatMessage, Delta, TextPart


class RegexFilter(Hook):
    """Block or redact text matching a regular expression.

    On input (``on="input"``) the pattern is searched in every message (or the text
    prompt): ``action="block"`` rejects the request with ``ContentBlocked`` before any KV
    block is allocated; ``action="redact"`` replaces each match with ``replacement``.
    A token-id prompt cannot be inspected, so an input filter blocks it (fails closed).
    An embed, rerank or score request's query and inputs are searched each on its own; a
    block names the first that matched (``ContentBlocked.param``: ``input.3``, ``documents.1``, ``query``).

    On output (``on="output"``) the pattern is searched in the text generated so far,
    delta by delta, so matches that span deltas are caught; at the first match the
    delta is withheld and the stream ends with ``finish_reason="content_filter"``. Text
    emitted before that delta may hold the start of the match. Output supports
    ``action="block"`` only: text already streamed cannot be redacted.

    Args:
        pattern: a regular expression (string or compiled).
        on: ``"input"`` or ``"output"``.
        action: ``"block"`` or (input only) ``"redact"``.
        replacement: what redaction writes in place of each match.
        name: the name in errors and audit decisions (default ``RegexFilter``).

    Raises:
        ValueError: an unknown ``on`` / ``action`` or an output redaction.
    """

    def __init__(
        self,
        pattern: str | re.Pattern[str],
        on: Literal["input", "output"] = "input",
        action: Literal["block", "redact"] = "block",
        *,
        replacement: str = "[REDACTED]",
        name: str | None = None,
    ) -> None:
        if on not in ("input", "output"):
            raise ValueError(f"on must be 'input' or 'output'; got {on!r}")
        if action not in ("block", "redact"):
            raise ValueError(f"action must be 'block' or 'redact'; got {action!r}")
        if on == "output" and action == "redact":
            raise ValueError("output filters can only block: streamed text cannot be redacted")
        self.pattern = re.compile(pattern)
        self.on = on
        self.action = action
        self.replacement = replacement
        self._name = name

    @property
    def name(self) -> str:
        return self._name or super().name

    async def on_request(self, ctx: RequestContext) -> None:
        if self.on != "input":
            return
        if ctx.inputs is not None:
            self._filter_inputs(ctx)
            return
        if ctx.messages is not None:
            texts = [m.text for m in ctx.messages]  # NOTE: text parts only: images are not text
        elif isinstance(ctx.prompt, str):
            texts = [ctx.prompt]
        else:
            raise ContentBlocked("token-id prompts cannot be inspected by the input filter", hook=self.name)
        num_matches = sum(len(self.pattern.findall(t)) for t in texts)
        if num_matches == 0:
            return
        if self.action == "block":
            raise ContentBlocked(f"input matched the {self.name} filter", hook=self.name)
        if ctx.messages is not None:
            ctx.messages = [self._redacted(m) for m in ctx.messages]
        else:
            ctx.prompt = self.pattern.sub(self.replacement, texts[0])
        ctx.record(self.name, "input", "redact", f"{num_matches} match(es)")

    def _filter_inputs(self, ctx: RequestContext) -> None:
        """A pooling request's query and inputs, each on its own: a block names the first that matched."""
        if isinstance(ctx.query, list):  # pairs: one query per input
            named: list[tuple[str, str | list[int]]] = [(f"query.{i}", q) for i, q in enumerate(ctx.query)]
        else:
            named = [("query", ctx.query)] if ctx.query is not None else []
        named += [(f"{ctx.input_field}.{i}", item) for i, item in enumerate(ctx.inputs or ())]
        num_matches = 0
        for param, item in named:
            if not isinstance(item, str):
                raise ContentBlocked(f"{param} is token ids, which the input filter cannot inspect", hook=self.name, param=param)
            found = len(self.pattern.findall(item))
            if found and self.action == "block":
                raise ContentBlocked(f"{param} matched the {self.name} filter", hook=self.name, param=param)
            num_matches += found
        if num_matches == 0:
            return
        if isinstance(ctx.query, list):
            ctx.query = [self.pattern.sub(self.replacement, q) for q in ctx.query]
        elif ctx.query is not None:
            ctx.query = self.pattern.sub(self.replacement, ctx.query)
        ctx.inputs = [self.pattern.sub(self.replacement, item) for item in ctx.inputs]  # type: ignore[arg-type, union-attr]
        ctx.record(self.name, "input", "redact", f"{num_matches} match(es)")

    def _redacted(self, message: ChatMessage) -> ChatMessage:
        """``message`` with its text (a string, or each text part) redacted; image parts kept."""
        content = message.content
        if content is None:
            return message
        if isinstance(content, str):
            return message.model_copy(update={"content": self.pattern.sub(self.replacement, content)})
        parts = [p.model_copy(update={"text": self.pattern.sub(self.replacement, p.text)}) if isinstance(p, TextPart) else p for p in content]
        return message.model_copy(update={"content": parts})

    async def on_chunk(self, ctx: RequestContext, delta: Delta) -> Stop | None:
        if self.on != "output" or not (delta.text or delta.reasoning or delta.tool_calls):
            return None
        if delta.text and self.pattern.search("".join(ctx.output_pieces[delta.index]) + delta.text):
            return Stop(f"output matched the {self.name} filter")
        if delta.reasoning and self.pattern.search("".join(ctx.reasoning_pieces[delta.index]) + delta.reasoning):
            return Stop(f"the reasoning matched the {self.name} filter")
        if delta.tool_calls:  # the arguments' JSON text so far
            sent = "".join(d.arguments for d in ctx.tool_call_deltas[delta.index])
            if self.pattern.search(sent + "".join(d.arguments for d in delta.tool_calls)):
                return Stop(f"a tool call's arguments matched the {self.name} filter")
        return None
