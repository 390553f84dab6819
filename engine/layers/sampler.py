"""Sampler: logits of a whole batch -> next tokens (+ logprobs), vectorised over rows.

Per step: penalties -> min_tokens suppression -> temperature -> top-k / top-p / min-p ->
an inverse-CDF draw: one uniform number per row, located in the row's cumulative
probabilities. A seeded request draws its number from its own ``torch.Generator``, so its
tokens do not depend on what else is in the batch; greedy rows take the argmax. That
generator is seeded afresh for each output token from (seed, the token's position): its
state is the request's tokens alone, so a request resumed on a fresh engine with the tokens
it had draws what it would have drawn.

NOTE: one random number per row, not one per vocabulary entry (as an exponential race or
Gumbel noise needs): on CPU, drawing ``rows x vocab`` random numbers costs an order of
magnitude more than the softmax itself. Likewise top-p looks for its nucleus among the
top ``TOP_P_CANDIDATES`` tokens and sorts the whole vocabulary only for rows whose
nucleus is wider.

Python loops here touch rows (drawing seeded numbers, gathering penalty state), never the
vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.request import Request
from engine.structured_output.matchers import TokenMask, apply_token_mask

TOP_P_CANDIDATES = 256


@dataclass(slots=True)
class _PenaltyState:
    prompt_mask: torch.Tensor  # [vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [vocab] float32: occurrences in the output
    num_counted: int  # output tokens already added to output_counts


@dataclass(slots=True)
class _SamplingState:
    generator: torch.Generator | None
    penalty: _PenaltyState | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[list[tuple[int, float, int]] | None]  # per row: (token, logprob, rank), sampled first


def token_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draws for its output token ``position`` (a 64-bit mix of the two)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 64)
    mixed ^= mixed >> 31
    return mixed % (1 << 63)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[N, V]`` logits. Ties resolve to the lowest index, as in ``argmax``.

    torch's argmax along rows is slow on CPU (3.5 ms at 64 x 49,152, where a max over the same
    storage takes 0.13 ms). float32 CPU rows take one C pass where the kernels are built
    (``cpu_kernels.argmax_rows``); other contiguous rows two vectorized steps: the first block of
    ``_argmax_block(V)`` vocabulary entries holding each row's maximum, then the first maximum inside it.
    """
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_cpu and logits.shape[1] > 0 \
            and cpu_kernels.library() is not None:
        return cpu_kernels.argmax_rows(logits)
    if logits.dim() != 2 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    rows, vocab = logits.shape
    block = _argmax_block(vocab)
    best_block = logits.view(rows, vocab // block, block).amax(dim=2).argmax(dim=1)  # [N]
    offsets = best_block.unsqueeze(1) * block + torch.arange(block, device=logits.device)  # [N, block]
    return best_block * block + logits.gather(1, offsets).argmax(dim=1)


@functools.cache
def _argmax_block(vocab: int) -> int:
    """The largest divisor of ``vocab`` up to 1024: the block size of ``argmax_rows``' first step."""
    return max(d for d in range(1, min(vocab, 1024) + 1) if vocab % d == 0)


class Sampler:
    """Samples one token per row for the requests whose logits a step produced.

    Args:
        vocab_size: Columns of the logits.
        device: Where the logits live.
        seed: Seeds the generator of unseeded requests (reproducible runs of one engine).
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(self.device)
        self._generator.manual_seed(seed)
        self._states: dict[str, _SamplingState] = {}  # req_id -> its generator and penalty counts

    def free(self, req_ids: Iterable[str]) -> None:
        """Drops the state of finished requests (unknown ids are skipped)."""
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[Request], token_mask: TokenMask | None = None
    ) -> SamplerOutput:
        """Samples the next token of each request.

        Args:
            logits: ``[len(requests), vocab]`` float32, rows in ``requests`` order.
            requests: The requests, each with its ``sampling_params`` and tokens so far.
            token_mask: The tokens structured-output constraints allow in some rows; the
                others get ``-inf`` before sampling (logprobs stay the model's own).

        Returns:
            Token ids, and per row the logprobs asked for (None where not asked).
        """
        num_rows, vocab = logits.shape
        params = [r.sampling_params for r in requests]
        logits = logits.to(torch.float32)
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if token_mask is not None:
            apply_token_mask(logits, token_mask)

        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            logits = self._apply_penalties(logits, requests, penalized)
        suppress = [
            (i, t)
            for i, r in enumerate(requests)
            if r.num_output_tokens < r.sampling_params.min_tokens
            for t in r.stop_token_ids
            if t < vocab
        ]
        if suppress:
            rows, cols = zip(*suppress)
            logits = logits.index_put((self._tensor(rows), self._tensor(cols)), self._scalar(-float("inf")))

        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled_rows:
            sampled = argmax_rows(logits)
        elif len(sampled_rows) == num_rows:
            sampled = self._sample(logits, requests)
        else:
            index = self._tensor(sampled_rows)
            drawn = self._sample(logits[index], [requests[i] for i in sampled_rows])
            sampled = argmax_rows(logits).index_copy(0, index, drawn)
        token_ids = sampled.tolist()
        logprobs: list[list[tuple[int, float, int]] | None] = [None] * num_rows
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, params)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        for r in requests:
            generator = self._state(r).generator
            if generator is not None:
                generator.manual_seed(token_seed(r.sampling_params.seed, r.num_output_tokens))
        temperature = self._tensor([p.temperature for p in params], torch.float32)
        logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        top_p = [p.top_p for p in params]
        wide: list[int] = []
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits, wide = _apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        allowed = probs
        min_p = [p.min_p for p in params]
        if any(min_p):
            threshold = probs.amax(dim=-1, keepdim=True) * self._tensor(min_p, torch.float32).unsqueeze(1)
            allowed = probs.masked_fill(probs < threshold, 0.0)
        token_ids = self._draw(allowed, requests)
        if wide:
            token_ids = self._redraw_into_nucleus(probs, allowed, token_ids, wide, requests)
        return token_ids

    def _draw(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One token per row from unnormalised ``probs``: a uniform number located in the row's cdf."""
        u = torch.rand(len(requests), 1, generator=self._generator, device=self.device)
        for i, r in enumerate(requests):
            generator = self._state(r).generator
            if generator is not None:
                u[i] = torch.rand(1, generator=generator, device=self.device)
        cdf = probs.cumsum(dim=-1)  # [B, V]
        # NOTE: right=True skips zero-probability tokens (flat stretches of the cdf), u = 0 included.
        token_ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_max_(cdf.shape[1] - 1)
        chosen = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if bool((chosen == 0).any()):  # u * total rounded up to the total: take the most likely token
            token_ids = torch.where(chosen > 0, token_ids, probs.argmax(dim=-1))
        return token_ids

    def _redraw_into_nucleus(
        self, probs: torch.Tensor, allowed: torch.Tensor, token_ids: torch.Tensor, rows: list[int],
        requests: Sequence[Request],
    ) -> torch.Tensor:
        """Top-p for rows whose nucleus is wider than the candidates, by rejection instead of a sort.

        A token is in the nucleus iff the tokens strictly more likely than it weigh less than
        top_p. A draw outside it is rejected and every token no more likely than it is
        removed (none of them is in the nucleus either), then the row draws again. An
        accepted draw is distributed as ``allowed`` restricted to the nucleus; a rejection
        removes about half of the remaining mass in expectation, so few rounds are needed.
        """
        index = self._tensor(rows)
        p, a, tok = probs[index], allowed[index], token_ids[index]  # [R, V], [R, V], [R]
        top_p = self._tensor([requests[i].sampling_params.top_p for i in rows], torch.float32)
        result = tok.clone()
        live = torch.arange(len(rows), device=self.device)  # positions in ``result`` still drawing
        while True:
            p_tok = p.gather(1, tok.unsqueeze(1))  # [L, 1]
            rejected = torch.where(p > p_tok, p, 0.0).sum(dim=-1) >= top_p
            if not bool(rejected.any()):
                break
            sel = rejected.nonzero().squeeze(1)
            p, a, p_tok, top_p, live = p[sel], a[sel], p_tok[sel], top_p[sel], live[sel]
            a = a.masked_fill(p <= p_tok, 0.0)
            tok = self._draw(a, [requests[rows[j]] for j in live.tolist()])
            result[live] = tok
        return token_ids.index_copy(0, index, result)

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> torch.Tensor:
        prompt_masks, counts = [], []
        for i in rows:
            state = self._penalty_state(requests[i])
            prompt_masks.append(state.prompt_mask)
            counts.append(state.output_counts)
        prompt_mask = torch.stack(prompt_masks)  # [R, vocab]
        output_counts = torch.stack(counts)  # [R, vocab]
        params = [requests[i].sampling_params for i in rows]
        rep = self._tensor([p.repetition_penalty for p in params], torch.float32).unsqueeze(1)
        freq = self._tensor([p.frequency_penalty for p in params], torch.float32).unsqueeze(1)
        pres = self._tensor([p.presence_penalty for p in params], torch.float32).unsqueeze(1)
        index = self._tensor(rows)
        sub = logits[index]
        seen = prompt_mask | (output_counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * output_counts - pres * (output_counts > 0).float()
        logits = logits.clone()
        logits[index] = sub
        return logits

    def _penalty_state(self, request: Request) -> _PenaltyState:
        state = self._state(request)
        if state.penalty is None:
            prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            prompt = [t for t in request.prompt_token_ids if t < self.vocab_size]
            prompt_mask[self._tensor(prompt)] = True
            zeros = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            state.penalty = _PenaltyState(prompt_mask, zeros, 0)
        penalty = state.penalty
        # NOTE: incremental, O(new tokens): usually the one token sampled last step.
        new = request.all_token_ids[request.num_prompt_tokens + penalty.num_counted :]
        if new:
            penalty.output_counts.index_add_(
                0, self._tensor(new), torch.ones(len(new), dtype=torch.float32, device=self.device)
            )
            penalty.num_counted += len(new)
        return penalty

    def _state(self, request: Request) -> _SamplingState:
        state = self._states.get(request.req_id)
        if state is None:
            seed = request.sampling_params.seed
            generator = None
            if seed is not None:  # NOTE: seeded per token in _sample
                generator = torch.Generator(self.device)
            state = self._states[request.req_id] = _SamplingState(generator)
        return state

    def _tensor(self, values: Sequence, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _scalar(self, value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32, device=self.device)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, list[int]]:
    """Masks to -inf what top-k (0 = off) and top-p (1 = off) exclude, per row.

    Returns:
        The masked logits, and the rows whose top-p nucleus is wider than the candidates:
        their top-p is left to ``Sampler._redraw_into_nucleus``.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    need_p = any(p < 1.0 for p in top_p)
    # NOTE: each row keeps to its own candidates (its top-k, else TOP_P_CANDIDATES for top-p),
    # never the batch's widest: whether a row's nucleus is "wide" (and so how many numbers its
    # draw takes) must not depend on the other rows, or a seeded request would not reproduce.
    limits = [min(vocab, k or (TOP_P_CANDIDATES if p < 1.0 else vocab)) for k, p in zip(top_k, top_p)]
    num_candidates = min(vocab, max(max(top_k), TOP_P_CANDIDATES if need_p else 1))
    values, _ = logits.topk(num_candidates, dim=-1)  # [B, K] sorted descending
    limit = torch.tensor(limits, device=device).unsqueeze(1)  # [B, 1]
    keep = torch.arange(num_candidates, device=device).unsqueeze(0) < limit  # [B, K]
    filtered = torch.tensor([bool(k) or p < 1.0 for k, p in zip(top_k, top_p)], device=device)
    wide: list[int] = []
    if need_p:
        top_p_t = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(1)
        has_k = torch.tensor([k > 0 for k in top_k], device=device)
        # normaliser: the top-k set when top-k is on (it lies among the candidates), else the whole vocab
        lse = torch.where(has_k, values.masked_fill(~keep, -float("inf")).logsumexp(-1), logits.logsumexp(-1))
        probs = torch.exp(values - lse.unsqueeze(1)).masked_fill(~keep, 0.0)  # [B, K]
        mass = probs.cumsum(dim=-1)
        keep &= (mass - probs) < top_p_t  # the smallest prefix whose mass reaches top_p
        # nucleus beyond the candidates (only without top-k: a top-k set lies among them)
        row_mass = mass.gather(1, limit.clamp_max(num_candidates) - 1)  # [B, 1]: of the row's own candidates
        is_wide = ((row_mass < top_p_t) & (top_p_t < 1.0)).squeeze(1) & ~has_k
        if bool(is_wide.any()):
            wide = is_wide.nonzero().squeeze(1).tolist()
            filtered &= ~is_wide
    keep[:, 0] = True
    threshold = values.masked_fill(~keep, float("inf")).amin(dim=-1)  # smallest kept logit
    threshold = torch.where(filtered, threshold, -float("inf")).unsqueeze(1)
    return logits.masked_fill(logits < threshold, -float("inf")), wide


def _gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, params: list
) -> list[list[tuple[int, float, int]] | None]:
    """Per row asking for k logprobs: the sampled token, then the top k (token, logprob, rank)."""
    max_k = max(p.logprobs or 0 for p in params)
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [B]
    sampled_rank = (raw_logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1  # [B]
    top_lp, top_ids = raw_logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    sampled_l, lp_l, rank_l = sampled.tolist(), sampled_lp.tolist(), sampled_rank.tolist()
    top_lp_l = top_lp.tolist() if top_lp is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    out: list[list[tuple[int, float, int]] | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        row = [(sampled_l[i], lp_l[i], rank_l[i])]
        for j in range(p.logprobs):
            row.append((top_ids_l[i][j], top_lp_l[i][j], j + 1))
        out.append(row)
    return out
