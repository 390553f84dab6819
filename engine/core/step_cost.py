"""StepCost: a step's time predicted from what it computes, to size prompt chunks for an ITL target.

A step's seconds are modelled as ``base + per_decode * decode_tokens + per_prompt * prompt_tokens``
(decode tokens: the rows that take logits, each decode's token and drafts; prompt tokens: prefill
chunks), fitted by least squares over the latest ``WINDOW`` measured steps (the least-norm fit where
they do not tell the terms apart). Where the fit has a negative term, or no cost for a kind of token
(none of that kind measured), every token costs the window's mean seconds per token and ``base`` is 0.

``prompt_tokens_within(seconds, decode_tokens)`` is what the scheduler asks: how many prompt tokens a
step that already holds ``decode_tokens`` may add and still take ``seconds`` at most.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64  # measured steps the fit uses


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
        alone take that long); None before any step was measured (no bound known)."""
        coef = self.coefficients()
        if coef is None:
            return None
        base, per_decode, per_prompt = coef
        left = seconds - base - per_decode * decode_tokens
        return max(0, int(left / per_prompt)) if left > 0 else 0

    def _fit(self) -> tuple[float, float, float]:
        data = np.asarray(self._steps, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        # NOTE: steps all of one decode count do not tell base from per decode token apart: the least-norm
        # fit splits them, and still predicts steps of that count exactly.
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if coef[0] >= 0 and coef[1] > 0 and coef[2] > 0:
            return float(coef[0]), float(coef[1]), float(coef[2])
        per_token = float(y.sum() / (data[:, 0].sum() + data[:, 1].sum()))
        return 0.0, per_token, per_token
