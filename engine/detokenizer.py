"""Incremental detokenization with stop strings.

Each step decodes a short sliding window of token ids, never the whole output, and emits
only text that is complete: a window whose decoding ends in U+FFFD (a UTF-8 character
split across tokens) is held back until the next token completes it. Stop strings are
searched only in the newly added text (plus the overlap a split match needs), and the
tail of the text that could still become a stop string is withheld from streamed output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right
_SETTLE_CHARS = 64  # the tail grows this far past what a stop string needs before it is settled


def make_decode_fn(tokenizer: Any) -> Callable[[list[int]], str]:
    """The fastest ``ids -> text`` the tokenizer offers, skipping special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns one request's growing token list into text, cut at the first stop string.

    The text is kept as the pieces already taken (``take``) and a tail not yet taken, so no
    step copies the text so far.

    Args:
        decode: ``ids -> text`` (see ``make_decode_fn``).
        prompt_token_ids: the prompt; its last few tokens give the first output tokens context.
        stop: stop strings; the text ends right before the first one found.
    """

    __slots__ = ("_decode", "_window", "_num_read", "_stop", "_max_stop_len", "_pieces", "_num_taken", "_tail")

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
    ) -> None:
        self._decode = decode
        # NOTE: _window[:_num_read] decodes to text already emitted (or to the prompt's last
        # tokens); it gives the next tokens context (a leading space, the rest of a character).
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_read = len(self._window)
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        # NOTE: text = "".join(_pieces) + _tail, and _pieces[:_num_taken] is what take() returned.
        # Text moves into _pieces once no stop string can begin in it: _tail keeps the last
        # max_stop_len - 1 characters, where a match (and a withheld stop prefix) can begin.
        self._pieces: list[str] = []
        self._num_taken = 0
        self._tail = ""

    @property
    def text(self) -> str:
        """All the text so far (cut before a stop string found), the withheld tail included."""
        return "".join(self._pieces) + self._tail

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> bool:
        """Decode the tokens generated since the last call.

        Returns:
            True when a stop string was found; the text then ends right before it.
        """
        window = self._window
        window.extend(new_token_ids)
        prefix_text = self._decode(window[: self._num_read]) if self._num_read else ""
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return False  # an incomplete character: wait for the token that completes it
        delta = new_text[len(prefix_text) :]
        self._window = window[self._num_read :]
        self._num_read = len(self._window)
        old_len = len(self._tail)
        self._tail += delta
        if check_stop and self._stop and self._find_stop(max(0, old_len - self._max_stop_len + 1)):
            return True
        keep = max(self._max_stop_len - 1, 0)
        if len(self._tail) > keep + _SETTLE_CHARS:
            cut = len(self._tail) - keep
            self._pieces.append(self._tail[:cut])
            self._tail = self._tail[cut:]
        return False

    def _find_stop(self, start: int) -> bool:
        first = -1
        for s in self._stop:
            i = self._tail.find(s, start)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first == -1:
            return False
        self._tail = self._tail[:first]
        return True

    def take(self, finished: bool) -> str:
        """The text safe to show that no earlier ``take`` returned.

        While running, a tail that may begin a stop string is withheld; once finished, nothing is.
        """
        visible = len(self._tail) - self._num_held_back(finished)
        if visible:
            self._pieces.append(self._tail[:visible])
            self._tail = self._tail[visible:]
        new = self._pieces[self._num_taken :]
        self._num_taken = len(self._pieces)
        return new[0] if len(new) == 1 else "".join(new)

    def visible_text(self, finished: bool) -> str:
        """All the text safe to show so far (what every ``take`` would have returned), without taking it."""
        return "".join(self._pieces) + self._tail[: len(self._tail) - self._num_held_back(finished)]

    def _num_held_back(self, finished: bool) -> int:
        return 0 if finished or not self._stop else held_back(self._tail, self._stop)


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    if not text:
        return 0
    last = text[-1]
    best = 0
    for s in stop:
        # candidate prefix lengths k end with the text's last character: s[k - 1] == last
        j = s.rfind(last, 0, min(len(s) - 1, len(text)))
        while j >= 0 and j + 1 > best:
            if text.endswith(s[: j + 1]):
                best = j + 1
                break
            j = s.rfind(last, 0, j)
    return best
