"""Drafter: proposes each decoding request's drafts, and backs off where they are not accepted.

Back-off, per request:

- a request proposes at most as many drafts as it had accepted at its previous verification, one
  more when those were all of them (``num_speculative_tokens`` at first), so drafts shrink to
  what the text repeats;
- a verification that rejected every draft makes the request propose nothing for the next
  ``skip`` steps, ``skip`` doubling with each such verification in a row (1, 2, 4, ... up to
  ``MAX_SKIP``); one that accepts any draft resets it.

A request whose text does not repeat itself thus costs one lookup a step and one draft every
``MAX_SKIP`` steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.request import Request
from engine.spec_decode import ngram
from engine.spec_decode.config import SpeculativeConfig

MAX_SKIP = 32  # steps without drafts after many all-rejected steps in a row


@dataclass(slots=True)
class _BackOff:
    max_drafts: int  # drafts the next proposal may have
    skip: int = 0  # steps left without drafts
    next_skip: int = 1  # the skip after the next all-rejected step


class Drafter:
    """Drafts of the decoding requests, for the scheduler; acceptance feedback from the engine.

    Args:
        config: The speculative settings.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._back_off: dict[str, _BackOff] = {}

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """At most ``max_drafts`` (and ``num_speculative_tokens``) drafts to follow ``request``'s tokens."""
        k = min(max_drafts, self.config.num_speculative_tokens)
        state = self._back_off.get(request.req_id)
        if state is not None:
            if state.skip > 0:
                state.skip -= 1
                return []
            k = min(k, state.max_drafts)
        if k <= 0:
            return []
        config = self.config
        return ngram.propose(request.all_token_ids, k, config.prompt_lookup_max, config.prompt_lookup_min)

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Records how many of a request's ``num_drafts`` drafts the step accepted."""
        if num_drafts == 0:
            return
        state = self._back_off.setdefault(req_id, _BackOff(self.config.num_speculative_tokens))
        # NOTE: one more only after all were accepted; a partial acceptance keeps what was accepted
        state.max_drafts = min(num_accepted + (num_accepted == num_drafts), self.config.num_speculative_tokens)
        if num_accepted:
            state.next_skip = 1
        else:
            state.max_drafts = 1
            state.skip = state.next_skip
            state.next_skip = min(2 * state.next_skip, MAX_SKIP)

    def free(self, req_ids: Iterable[str]) -> None:
        """Forgets finished requests (unknown ids are skipped)."""
        for req_id in req_ids:
            self._back_off.pop(req_id, None)
