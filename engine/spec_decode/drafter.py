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

Whether drafts pay (``mode="auto"``): a step of ``N`` decode rows takes ``base + a * N`` seconds
(``StepCost.decode_coefficients``, fitted on the measured steps without prompt tokens), so ``d`` drafts per
row add ``a * N * d`` seconds and ``e * N * d`` tokens, where ``e`` is the tokens accepted per draft. That beats
the step's own rate ``N / (base + a * N)`` when ``e > a * N / (base + a * N)``: near 0 at one row (the weights'
read dominates), near 1 at many. A request drafts only while its acceptance (a moving average over its
latest verifications, ``PRIOR`` before any) is above that bound; nothing drafts before a step of decodes
alone was measured.

That bound holds where every row drafts alike, or where a request that finishes sooner lets a waiting one
in. In a draining batch (nothing waits) the steps go on until its slowest request is done: one request's
accepted drafts save only its own later rows (``a`` each, what a draft costs, so a loss with any
rejection), and the batch ends sooner only when all of its requests accept. There a request drafts only
while the lowest acceptance in the batch (``PRIOR`` for a request never verified) is above the bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.step_cost import StepCost
from engine.request import Request
from engine.spec_decode import ngram
from engine.spec_decode.config import SpeculativeConfig

MAX_SKIP = 32  # steps without drafts after many all-rejected steps in a row
PRIOR = 0.6  # accepted tokens per draft assumed of a request before its first verification
RECENT = 0.3  # weight of the latest verification in a request's acceptance average


@dataclass(slots=True)
class _BackOff:
    max_drafts: int  # drafts the next proposal may have
    skip: int = 0  # steps left without drafts
    next_skip: int = 1  # the skip after the next all-rejected step
    acceptance: float = PRIOR  # accepted tokens per draft, moving average


class Drafter:
    """Drafts of the decoding requests, for the scheduler; acceptance feedback from the engine.

    Args:
        config: The speculative settings.
        step_cost: The measured step costs ``mode="auto"`` weighs drafts with; None = drafts always pay.
    """

    def __init__(self, config: SpeculativeConfig, step_cost: StepCost | None = None) -> None:
        self.config = config
        self.step_cost = step_cost if config.mode == "auto" else None
        self._back_off: dict[str, _BackOff] = {}
        self._lowest: float | None = None  # the lowest acceptance among ``_back_off``; None: not computed

    def propose(self, request: Request, max_drafts: int, num_rows: int = 1, draining: bool = False) -> list[int]:
        """At most ``max_drafts`` (and ``num_speculative_tokens``) drafts to follow ``request``'s tokens, in a
        step of ``num_rows`` decodes; ``draining``: no request waits, the ``num_rows`` are all running."""
        k = min(max_drafts, self.config.num_speculative_tokens)
        state = self._back_off.get(request.req_id)
        if state is not None:
            if state.skip > 0:
                state.skip -= 1
                return []
            k = min(k, state.max_drafts)
        if k <= 0:
            return []
        if self.step_cost is not None:
            acceptance = state.acceptance if state else PRIOR
            if draining:
                acceptance = min(acceptance, self.lowest_acceptance(num_rows))
            if acceptance <= self.break_even(num_rows):
                return []
        config = self.config
        return ngram.propose(request.all_token_ids, k, config.prompt_lookup_max, config.prompt_lookup_min)

    def break_even(self, num_rows: int) -> float:
        """Accepted tokens per draft above which drafts pay in a step of ``num_rows`` decodes (0: always; 1: never,
        before a step of decodes alone was measured)."""
        if self.step_cost is None:
            return 0.0
        coef = self.step_cost.decode_coefficients()
        if coef is None:
            return 1.0
        base, per_row = coef
        rows_cost = per_row * num_rows
        return rows_cost / (base + rows_cost) if rows_cost > 0 else 0.0

    def lowest_acceptance(self, num_running: int) -> float:
        """The lowest acceptance among ``num_running`` running requests: ``PRIOR`` counts for those never verified."""
        if self._lowest is None:
            self._lowest = min((s.acceptance for s in self._back_off.values()), default=PRIOR)
        # NOTE: a state is freed the step after its request finished (``free``), so fewer states than running
        # requests means one is running unverified (a step late at most: a stale state can hide one)
        return min(self._lowest, PRIOR) if len(self._back_off) < num_running else self._lowest

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """Records how many of a request's ``num_drafts`` drafts the step accepted."""
        if num_drafts == 0:
            return
        state = self._back_off.setdefault(req_id, _BackOff(self.config.num_speculative_tokens))
        self._lowest = None
        state.acceptance += RECENT * (num_accepted / num_drafts - state.acceptance)
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
            if self._back_off.pop(req_id, None) is not None:
                self._lowest = None
