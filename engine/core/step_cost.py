"""StepCost: a step's time predicted from what it computes, to size prompt chunks for an ITL target.

A step's seconds are modelled as ``base + per_decode * decode_tokens + per_prompt * prompt_tokens``
(decode tokens: the rows that take logits, each decode's token and drafts; prompt tokens: prefill
chunks), fitted by least squares with no negative term over the latest ``WINDOW`` measured steps
(a kind of token no step measured costs 0).

``prompt_tokens_within(seconds, decode_tokens)`` is what the scheduler asks: how many prompt tokens a
step that already holds ``decode_tokens`` may add and still take ``seconds`` at most.

``decode_coefficients()`` is what speculative decoding weighs drafts with: ``base + per_decode *
decode_tokens`` fitted on the window's steps of decodes alone. Steps with prompt tokens cannot tell a
decode token's cost from a prompt token's where every step fills the same token budget (decode
tokens + prompt tokens constant), so their noise would decide how much of a step is its base.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # measured steps the fit uses
_SUBSETS = [[0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]]  # the terms a fit may keep
_DECODE_SUBSETS = [[0, 1], [0], [1]]


class StepCost:
    """Measured step times and the fit that predicts them."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (decode tokens, prompt tokens, s)
        self._coef: tuple[float, float, float] | None = None  # (base, per decode token, per prompt token)
        self._decode_coef: tuple[float, float] | None = None  # (base, per decode token), steps of decodes alone
        self._decode_fitted = False  # whether _decode_coef is the window's (None: no step of decodes alone)

    @property
    def num_steps(self) -> int:
        """Measured steps in the window."""
        return len(self._steps)

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """Records one step: its decode tokens, its prompt tokens and the seconds it took."""
        if decode_tokens + prompt_tokens <= 0 or seconds <= 0:
            return
        self._steps.append((decode_tokens, prompt_tokens, seconds))
        self._coef = self._decode_coef = None
        self._decode_fitted = False

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(base, per decode token, per prompt token)`` seconds; None before any step was measured."""
        if self._coef is None and self._steps:
            self._coef = self._fit()
        return self._coef

    def decode_coefficients(self) -> tuple[float, float] | None:
        """``(base, per decode token)`` seconds fitted on the window's steps without prompt tokens; None while it
        holds none. Steps all of one decode count fit the least-norm split of their time (a share ``1 / (1 + n^2)``
        of it as base at ``n`` decodes): half at one decode, nearly none at many."""
        if not self._decode_fitted:  # NOTE: once a step, however many requests ask
            self._decode_fitted = True
            steps = [(decode, seconds) for decode, prompt, seconds in self._steps if prompt == 0]
            if steps:
                data = np.asarray(steps, dtype=np.float64)
                x = np.column_stack([np.ones(len(data)), data[:, 0]])
                base, per_decode = _nonnegative_fit(x, data[:, 1], _DECODE_SUBSETS)
                self._decode_coef = (float(base), float(per_decode))
        return self._decode_coef

    def predict(self, decode_tokens: int, prompt_tokens: int) -> float | None:
        """Predicted seconds of a step; None before any step was measured."""
        coef = self.coefficients()
        if coef is None:
            return None
        base, per_decode, per_prompt = coef
        return base + per_decode * decode_tokens + per_prompt * prompt_tokens

    def prompt_tokens_within(self, seconds: float, decode_tokens: int) -> int | None:
        """Most prompt tokens a step with ``decode_tokens`` may add within ``seconds`` (0 when the decodes
        alone take that long); None before any step was measured or while prompt tokens cost nothing measured
        (no bound known)."""
        coef = self.coefficients()
        if coef is None or coef[2] <= 0:
            return None
        base, per_decode, per_prompt = coef
        left = seconds - base - per_decode * decode_tokens
        return max(0, int(left / per_prompt)) if left > 0 else 0

    def _fit(self) -> tuple[float, float, float]:
        data = np.asarray(self._steps, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        base, per_decode, per_prompt = _nonnegative_fit(x, data[:, 2], _SUBSETS)
        return float(base), float(per_decode), float(per_prompt)


def _nonnegative_fit(x: np.ndarray, y: np.ndarray, subsets: list[list[int]]) -> np.ndarray:
    """Least squares ``x @ coef ~ y`` with no negative coefficient, by trying each subset of the columns (fullest
    first)."""
    # NOTE: steps all of one decode count do not tell base from per decode token apart, and the least-norm fit
    # splits them while still predicting steps of that count exactly.
    best, best_residual = np.zeros(x.shape[1]), np.inf
    tie = 1e-9 * float(y @ y)
    for terms in subsets:
        coef = np.zeros(x.shape[1])
        coef[terms] = np.linalg.lstsq(x[:, terms], y, rcond=None)[0]
        residual = float(np.sum((x @ coef - y) ** 2))
        # NOTE: fewer terms win only a clearly better fit: of equal ones, the fullest
        if coef.min() >= 0 and residual < best_residual - tie:
            best, best_residual = coef, residual
    return best
