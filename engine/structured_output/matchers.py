"""StructuredOutputManager: one grammar matcher per constrained sequence; a step's token masks.

Driver thread only, as the rest of the engine. A sequence's matcher is advanced by every
token the scheduler appends to it; a preempted sequence keeps its generated tokens (only its
KV is recomputed), so its matcher stays valid and is never rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from engine import cpu_kernels
from engine.errors import EngineError


class Row(Protocol):
    """A step's row as the matchers read it (a ``Request``): the id its matcher is kept under."""

    req_id: str


class TokenMask(NamedTuple):
    """The allowed tokens of a step's constrained rows."""

    bitmask: torch.Tensor  # [num_rows, ceil(vocab / 32)] int32; bit t of row r set = token t allowed
    rows: list[int]  # the constrained rows; the others' bitmask rows are stale and must not be read


class StructuredOutputManager:
    """The matchers of the constrained sequences, keyed by ``req_id``.

    Args:
        vocab_size: Columns of the logits.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None  # reused across steps, grown when needed

    def add_request(self, req_id: str, grammar: Any, token_ids: Sequence[int] = ()) -> None:
        """Starts constraining ``req_id`` with a compiled grammar (from ``GrammarCompiler``).

        Args:
            token_ids: output it already has (a resumed run): the matcher is advanced past them.

        Raises:
            EngineError: the grammar refuses one of ``token_ids``.
        """
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(grammar, max_rollback_tokens=0)
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                raise EngineError(f"the grammar refused token {token_id} of the output so far")
        self._matchers[req_id] = matcher

    def free(self, req_ids: Iterable[str]) -> None:
        """Forgets finished requests (unknown ids are skipped)."""
        for req_id in req_ids:
            self._matchers.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers

    def token_mask(self, rows: Sequence[Row]) -> TokenMask | None:
        """The allowed next tokens of the constrained ``rows``; None when no row is constrained."""
        constrained = [(i, self._matchers[r.req_id]) for i, r in enumerate(rows) if r.req_id in self._matchers]
        if not constrained:
            return None
        bitmask = self._scratch(len(rows))
        for i, matcher in constrained:
            matcher.fill_next_token_bitmask(bitmask, i)
        return TokenMask(bitmask, [i for i, _ in constrained])

    def accept(self, rows: Sequence[Row], token_ids: Sequence[int]) -> tuple[set[str], dict[str, str]]:
        """Advances each constrained row's matcher by its sampled token.

        Returns:
            The ids of the rows whose structure is complete (their matcher took a stop token,
            so nothing more may follow), and ``{req_id: reason}`` of rows whose token the
            matcher refused (an engine bug: those requests must fail).
        """
        terminated, refused = set(), {}
        for request, token_id in zip(rows, token_ids):
            matcher = self._matchers.get(request.req_id)
            if matcher is None:
                continue
            if not matcher.accept_token(token_id):
                refused[request.req_id] = f"the grammar refused token {token_id}"
            elif matcher.is_terminated():
                terminated.add(request.req_id)
        return terminated, refused

    def _scratch(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Sets to ``-inf``, in place, the logits of the tokens ``mask`` does not allow in its rows.

    On CPU in float32 a C kernel does it (xgrammar's own CPU path takes 16 ms for 64 rows of a
    49k vocabulary, a twelfth of a decode step); elsewhere xgrammar's kernels.
    """
    if cpu_kernels.serves(logits) and logits.stride(1) == 1:
        cpu_kernels.apply_token_bitmask(logits, mask.bitmask, mask.rows)
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=logits.shape[1], indices=mask.rows)
