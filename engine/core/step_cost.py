"""StepCost: a step's time predicted from what it computes, to size prompt chunks for an ITL target.

A step's seconds are modelled as ``base + per_decode * decode_tokens + per_prompt * prompt_tokens``
(decode tokens: the rows that take logits, each decode's token and drafts; prompt tokens: prefill
chunks), fitted by least squares with no negative term over the latest ``WINDOW`` measured steps
(a kind of token no step measured costs 0).

``prompt_tokens_within(seconds, decode_tokens)`` is what the scheduler asks: how many prompt tokens a
step that already holds ``decode_tokens`` may add and still take ``seconds`` at most.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # measured steps the fit uses
_SUBSETS = [[0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]]  # the terms a fit may keep


class StepCost:
    """Measured step times and the fit that predicts them."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (decode tokens, prompt tokens, s)
        self._coef: tuple[float, float, float] | None = None  # (base, per decode token, per prompt token)

    @property
    def num_steps(self) -> int:
        """Measured steps in the window."""
        return len(self._steps)

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """Records one step: its decode tokens, its prompt tokens and the seconds it took."""
        if decode_tokens + prompt_tokens <= 0 or seconds <= 0:
            return
        self._steps.append((decode_tokens, prompt_tokens, seconds))
        self._coef = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(base, per decode token, per prompt token)`` seconds; None before any step was measured."""
        if self._coef is None and self._steps:
            self._coef = self._fit()
        return self._coef

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
        y = data[:, 2]
        # NOTE: non-negative least squares by trying every subset of the terms (three: seven fits); steps all
        # of one decode count do not tell base from per decode token apart, and the least-norm fit splits
        # them while still predicting steps of that count exactly.
        best, best_residual = np.zeros(3), np.inf
        tie = 1e-9 * float(y @ y)
        for terms in _SUBSETS:
            coef = np.zeros(3)
            coef[terms] = np.linalg.lstsq(x[:, terms], y, rcond=None)[0]
            residual = float(np.sum((x @ coef - y) ** 2))
            # NOTE: fewer terms win only a clearly better fit: of equal ones, the fullest
            if coef.min() >= 0 and residual < best_residual - tie:
                best, best_residual = coef, residual
        return float(best[0]), float(best[1]), float(best[2])
