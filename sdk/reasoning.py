"""Reasoning: a thinking model's thoughts split from its answer, and constraints held until the answer.

Thinking models write their reasoning between markers before the answer (Qwen3, QwQ and the
DeepSeek-R1 distills: ``<think>`` ... ``</think>``). A ``ReasoningFormat`` is one family's
markers; ``reasoning_format`` picks it from the chat template (``"auto"``) or by name
(``REASONING_PARSERS``), ``"none"`` turns parsing off. Where the output starts depends on the
prompt (``ReasoningFormat.start_of``): a template may open the thinking in the generation
prompt (R1's, Qwen3's thinking variants), close it there (Qwen3 with ``enable_thinking``
false), or leave it to the model.

``ReasoningParser`` splits a completion's streamed text into (reasoning, answer) pieces;
``after_reasoning`` moves a decoding constraint (a JSON schema, a tool choice ...) past the
thinking, so the model thinks freely and only its answer is held to the constraint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from engine.structured_output import StructuredOutput
from sdk.errors import InvalidRequestError
from sdk.response_format import tag_format
from sdk.tools import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"
_DEEPSEEK_ASSISTANT = "<｜Assistant｜>"  # the full-width bars of DeepSeek's chat templates


class Start(enum.Enum):
    """Where a completion starts, as its prompt leaves it."""

    THINKING = "thinking"
    """Inside the reasoning: the prompt opened it (or the family always starts there)."""
    EITHER = "either"
    """The model may open the reasoning with the start marker, or answer straight away."""
    ANSWER = "answer"
    """In the answer: the prompt closed the reasoning; the text is left as it is."""


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One family's reasoning markers, and whether its output always starts inside the reasoning."""

    name: str
    start: str = THINK_START
    end: str = THINK_END
    always_starts_thinking: bool = False
    """DeepSeek-R1: the reasoning runs to ``end`` even when the output does not open it."""

    def start_of(self, prompt_tail: str) -> Start:
        """Where a completion of a prompt ending with ``prompt_tail`` (its last tokens' text) starts."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return Start.ANSWER
        if self.always_starts_thinking or tail.endswith(self.start):
            return Start.THINKING
        return Start.EITHER


class PromptReasoning(NamedTuple):
    """A chat prompt's reasoning: its model's format, and where its completions start."""

    format: ReasoningFormat
    start: Start

    def parser(self) -> ReasoningParser | None:
        """A parser for one completion; None when the prompt closed the reasoning (the text is all answer)."""
        return None if self.start is Start.ANSWER else ReasoningParser(self.format, self.start)


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_starts_thinking=True),
}
REASONING_PARSERS = ("auto", "none", *REASONING_FORMATS)
"""The names ``reasoning_parser`` takes: detect from the chat template, none, or a family."""


def check_parser_name(name: str) -> str:
    """``name`` if it is one of ``REASONING_PARSERS``.

    Raises:
        InvalidRequestError: another name (``param="reasoning_parser"``), listing the names.
    """
    if name not in REASONING_PARSERS:
        raise InvalidRequestError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}", param="reasoning_parser"
        )
    return name


def reasoning_format(name: str, chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning format ``name`` stands for; ``"auto"`` detects it from ``chat_template``.

    A template that strips ``</think>`` sections from earlier turns is a thinking model's:
    DeepSeek's (its ``<｜Assistant｜>`` turns) is ``deepseek_r1``, any other ``qwen3``.
    None for ``"none"``, or for a template without reasoning.

    Raises:
        InvalidRequestError: an unknown name (``check_parser_name``).
    """
    if check_parser_name(name) == "none":
        return None
    if name != "auto":
        return REASONING_FORMATS[name]
    if not chat_template or THINK_END not in chat_template:
        return None
    return REASONING_FORMATS["deepseek_r1" if _DEEPSEEK_ASSISTANT in chat_template else "qwen3"]


class ReasoningParser:
    """Splits one completion's streamed text into reasoning and answer.

    ``feed`` takes each new piece of text and returns ``(reasoning, answer)`` ready to send;
    ``finish`` returns what is held back at the end. Only a possible marker is held back (at
    most a marker's length less one), and the whitespace that opens the reasoning or the answer
    is dropped. The start marker counts only at the beginning of the output.

    Args:
        fmt: the family's markers.
        start: where the output starts (``ReasoningFormat.start_of``); not ``Start.ANSWER``,
            whose text needs no parser.
    """

    def __init__(self, fmt: ReasoningFormat, start: Start) -> None:
        if start is Start.ANSWER:
            raise ValueError("a completion that starts in the answer has no reasoning to parse")
        self._fmt = fmt
        self._at_head = True  # nothing but whitespace read yet: the start marker may still come
        self._thinking = start is Start.THINKING
        self._buffer = ""
        self._began = False  # the current section has sent a non-whitespace character

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._buffer:
            if self._at_head:
                head = self._buffer.lstrip()
                if self._fmt.start.startswith(head):
                    break  # whitespace or a partial start marker: undecided yet
                self._at_head = False
                if head.startswith(self._fmt.start):
                    self._thinking = True
                    self._buffer = head[len(self._fmt.start) :]
                continue
            if not self._thinking:
                answer.append(self._section(self._buffer))
                self._buffer = ""
                break
            end = self._buffer.find(self._fmt.end)
            if end < 0:
                keep = len(self._buffer) - partial_suffix(self._buffer, self._fmt.end)
                reasoning.append(self._section(self._buffer[:keep]))
                self._buffer = self._buffer[keep:]
                break
            reasoning.append(self._section(self._buffer[:end]))
            self._buffer = self._buffer[end + len(self._fmt.end) :]
            self._thinking, self._began = False, False
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is held back at the end (a partial marker), in the section the output ended in."""
        rest, self._buffer = self._buffer, ""
        if self._thinking:
            return self._section(rest), ""
        return "", self._section(rest)

    def _section(self, text: str) -> str:
        """``text`` as the next piece of the current section, without the whitespace that opens it."""
        if not self._began:
            text = text.lstrip()
            self._began = bool(text)
        return text


def after_reasoning(constraint: StructuredOutput | None, fmt: ReasoningFormat, start: Start) -> StructuredOutput | None:
    """``constraint`` applied after the reasoning: free text up to the end marker, then the constraint.

    A completion that starts inside the reasoning must close it first; one that may open it
    (``Start.EITHER``) may also answer straight away. Whitespace may separate the end marker
    from the answer. Returns ``constraint`` itself for ``Start.ANSWER`` or no constraint.
    """
    if constraint is None or start is Start.ANSWER:
        return constraint
    answer = tag_format(constraint)
    thinking = {"type": "tag", "begin": "" if start is Start.THINKING else fmt.start,
                "content": {"type": "any_text"}, "end": fmt.end}  # fmt: skip
    thought_then_answer = {"type": "sequence", "elements": [thinking, {"type": "regex", "pattern": r"\s*"}, answer]}
    fmt_dict = thought_then_answer if start is Start.THINKING else {"type": "or", "elements": [thought_then_answer, answer]}
    return StructuredOutput(structural_tag={"type": "structural_tag", "format": fmt_dict})
