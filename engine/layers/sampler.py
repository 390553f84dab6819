"""Sampler: logits of a whole batch -> next tokens (+ logprobs), vectorised over rows.

Per step: penalties -> min_tokens suppression -> temperature -> top-k / top-p / min-p ->
an exponential race (``argmax(probs / q)``, ``q ~ Exp(1)``), which samples exactly from
``probs``. The noise of a seeded request is drawn from its own ``torch.Generator``, so its
tokens do not depend on what else is in the batch; greedy rows take the argmax.
Python loops here touch rows (drawing seeded noise, gathering penalty state), never the
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.request import Request


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

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Samples the next token of each request.

        Args:
            logits: ``[len(requests), vocab]`` float32, rows in ``requests`` order.
            requests: The requests, each with its ``sampling_params`` and tokens so far.

        Returns:
            Token ids, and per row the logprobs asked for (None where not asked).
        """
        num_rows, vocab = logits.shape
        params = [r.sampling_params for r in requests]
        logits = logits.to(torch.float32)
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

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

        greedy = [p.is_greedy for p in params]
        greedy_ids = logits.argmax(dim=-1)
        if all(greedy):
            sampled = greedy_ids
        else:
            sampled = torch.where(
                torch.tensor(greedy, device=self.device), greedy_ids, self._sample(logits, requests, params)
            )
        token_ids = sampled.tolist()
        logprobs: list[list[tuple[int, float, int]] | None] = [None] * num_rows
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, params)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request], params: list) -> torch.Tensor:
        temperature = self._tensor([p.temperature if not p.is_greedy else 1.0 for p in params], torch.float32)
        logits = logits / temperature.unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, self._tensor(top_k), self._tensor(top_p, torch.float32))
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            threshold = probs.amax(dim=-1, keepdim=True) * self._tensor(min_p, torch.float32).unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        # NOTE: argmax(probs / q) with q ~ Exp(1) i.i.d. is a draw from probs (normalisation not needed).
        q = torch.empty_like(probs).exponential_(generator=self._generator)
        for i, r in enumerate(requests):
            generator = self._state(r).generator
            if generator is not None:
                q[i].exponential_(generator=generator)
        # NOTE: q can be exactly 0; 0 / 0 would be NaN, which argmax prefers over every number.
        return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)

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
        state = request.sampling_state
        if state is None:
            seed = request.sampling_params.seed
            generator = None
            if seed is not None:
                generator = torch.Generator(self.device)
                generator.manual_seed(seed)
            state = request.sampling_state = _SamplingState(generator)
        return state

    def _tensor(self, values: Sequence, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _scalar(self, value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32, device=self.device)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf what top-k (0 = off) and top-p (1 = off) exclude, per row."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(mask, -float("inf"))


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
