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


def make_decode_fn(tokenizer: Any) -> Callable[[list[int]], str]:
    """The fastest ``ids -> text`` the tokenizer offers, skipping special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns one request's growing token list into text, cut at the first stop string.

    Args:
        decode: ``ids -> text`` (see ``make_decode_fn``).
        prompt_token_ids: the prompt; its last few tokens give the first output tokens context.
        stop: stop strings; the text ends right before the first one found.
    """

    __slots__ = ("_decode", "_window", "_num_read", "_stop", "_max_stop_len", "text")

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
        self.text = ""

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> bool:
        """Decode the tokens generated since the last call.

        Returns:
            True when a stop string was found; ``text`` then ends right before it.
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
        old_len = len(self.text)
        self.text += delta
        if not (check_stop and self._stop):
            return False
        return self._find_stop(max(0, old_len - self._max_stop_len + 1))

    def _find_stop(self, start: int) -> bool:
        first = -1
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first == -1:
            return False
        self.text = self.text[:first]
        return True

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: while running, withhold a tail that may begin a stop string."""
        if finished or not self._stop:
            return self.text
        return self.text[: len(self.text) - self._held_back()]

    def _held_back(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        text = self.text
        if not text:
            return 0
        last = text[-1]
        best = 0
        for s in self._stop:
            # candidate prefix lengths k end with the text's last character: s[k - 1] == last
            j = s.rfind(last, 0, min(len(s) - 1, len(text)))
            while j >= 0 and j + 1 > best:
                if text.endswith(s[: j + 1]):
                    best = j + 1
                    break
                j = s.rfind(last, 0, j)
        return best
