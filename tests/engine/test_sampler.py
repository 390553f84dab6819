"""Sampler: each knob changes the draw as specified; seeded rows ignore their batch company."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import cpu_kernels
from engine.layers import sampler as sampler_module
from engine.layers.sampler import Sampler, argmax_rows
from engine.request import Request
from engine.sampling_params import SamplingParams

V = 8
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0, 0.0, 0.0])
LOGITS = torch.log(PROBS.clamp_min(1e-30))


_ids = itertools.count()


def make_request(prompt=(7,), output=(), stop_ids=(), **params) -> Request:
    """A request with a fresh id (the sampler keeps its per-request state by id)."""
    r = Request(f"r{next(_ids)}", list(prompt), SamplingParams(**params), stop_token_ids=frozenset(stop_ids))
    for t in output:
        r.append_token(t)
    return r


def draw(params: dict, rows: int = 4000, logits: torch.Tensor = LOGITS, **kw) -> torch.Tensor:
    """Samples ``rows`` independent rows (one request each) from the same logits."""
    sampler = Sampler(V, seed=1)
    reqs = [make_request(**kw, **params) for _ in range(rows)]
    return torch.tensor(sampler(logits.expand(rows, V).clone(), reqs).token_ids)


def freqs(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / len(tokens)


def test_greedy_is_argmax_per_row() -> None:
    """temperature=0 takes each row's argmax."""
    logits = torch.randn(5, V)
    out = Sampler(V)(logits, [make_request(temperature=0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_random_sampling_follows_softmax() -> None:
    """At temperature 1 the empirical distribution matches softmax(logits)."""
    assert torch.allclose(freqs(draw({})), PROBS, atol=0.03)


def test_temperature_sharpens_and_flattens() -> None:
    """Low temperature concentrates on the argmax; high temperature spreads over the support."""
    assert freqs(draw(dict(temperature=0.05)))[0] > 0.99
    hot = freqs(draw(dict(temperature=5.0)))
    expected = torch.softmax(LOGITS / 5.0, -1)
    assert torch.allclose(hot, expected, atol=0.03)


def test_top_k() -> None:
    """top_k=2 never draws outside the two most likely tokens, and renormalises between them."""
    f = freqs(draw(dict(top_k=2)))
    assert f[2:].sum() == 0 and abs(f[0] - 0.5 / 0.8) < 0.03


def test_top_p() -> None:
    """top_p keeps the smallest prefix whose mass reaches p."""
    assert set(draw(dict(top_p=0.7)).tolist()) == {0, 1}
    assert set(draw(dict(top_p=0.45)).tolist()) == {0}
    assert set(draw(dict(top_p=0.81)).tolist()) == {0, 1, 2}


def test_min_p() -> None:
    """min_p drops tokens below min_p times the top probability."""
    assert set(draw(dict(min_p=0.5)).tolist()) == {0, 1}
    assert set(draw(dict(min_p=0.7)).tolist()) == {0}


def test_repetition_penalty_covers_prompt_and_output() -> None:
    """A repetition penalty pushes a token seen in the prompt or the output below an unseen one."""
    logits = torch.tensor([[2.0, 1.5, 0, 0, 0, 0, 0, 0]])
    sampler = Sampler(V)
    assert sampler(logits, [make_request(prompt=(0,), temperature=0)]).token_ids == [0]
    assert sampler(logits, [make_request(prompt=(0,), temperature=0, repetition_penalty=2.0)]).token_ids == [1]
    assert sampler(logits, [make_request(prompt=(5,), output=(0,), temperature=0, repetition_penalty=2.0)]).token_ids == [1]
    neg = torch.tensor([[-1.0, -1.5, -9, -9, -9, -9, -9, -9]])  # negative logits are multiplied
    assert sampler(neg, [make_request(prompt=(0,), temperature=0, repetition_penalty=2.0)]).token_ids == [1]


def test_presence_and_frequency_penalties_count_output_tokens() -> None:
    """Presence subtracts once per seen token, frequency once per occurrence; the prompt is not counted."""
    logits = torch.tensor([[2.0, 1.5, 0, 0, 0, 0, 0, 0]])
    sampler = Sampler(V)
    assert sampler(logits, [make_request(prompt=(0,), temperature=0, presence_penalty=1.0)]).token_ids == [0]
    assert sampler(logits, [make_request(output=(0,), temperature=0, presence_penalty=1.0)]).token_ids == [1]
    assert sampler(logits, [make_request(output=(0,), temperature=0, frequency_penalty=0.4)]).token_ids == [0]
    assert sampler(logits, [make_request(output=(0, 0), temperature=0, frequency_penalty=0.4)]).token_ids == [1]


def test_penalty_counts_are_incremental() -> None:
    """Tokens appended between steps are counted once each across repeated calls."""
    logits = torch.tensor([[2.0, 1.5, 0, 0, 0, 0, 0, 0]])
    sampler = Sampler(V)
    r = make_request(temperature=0, frequency_penalty=0.4)
    assert sampler(logits, [r]).token_ids == [0]
    r.append_token(0)
    assert sampler(logits, [r]).token_ids == [0]  # 2.0 - 0.4 > 1.5
    r.append_token(0)
    assert sampler(logits, [r]).token_ids == [1]  # 2.0 - 0.8 < 1.5


def test_min_tokens_suppresses_stop_ids() -> None:
    """Below min_tokens the stop ids (EOS included) cannot be drawn; after it they can."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0, 0, 0]])
    sampler = Sampler(V)
    early = make_request(stop_ids=(1,), output=(3,), temperature=0, min_tokens=2)
    assert sampler(logits, [early]).token_ids == [2]
    late = make_request(stop_ids=(1,), output=(3, 3), temperature=0, min_tokens=2)
    assert sampler(logits, [late]).token_ids == [1]


def test_seed_is_reproducible_in_any_batch_company() -> None:
    """A seeded request draws the same tokens whatever else is in the batch and wherever its row is."""
    logits = torch.zeros(1, V)

    def run(company: int, position: int) -> list[int]:
        sampler = Sampler(V, seed=company)
        seeded = make_request(seed=1234)
        tokens = []
        for _ in range(6):
            rows = [make_request() for _ in range(company)]
            rows.insert(position, seeded)
            out = sampler(logits.expand(len(rows), V).clone(), rows)
            tokens.append(out.token_ids[position])
            seeded.append_token(tokens[-1])
        return tokens

    alone = run(0, 0)
    assert run(3, 1) == alone and run(7, 7) == alone
    assert len(set(alone)) > 1  # really random, not a constant
    other, unlike = Sampler(V), make_request(seed=99)
    drawn = []
    for _ in range(6):
        drawn.append(other(logits, [unlike]).token_ids[0])
        unlike.append_token(drawn[-1])
    assert drawn != alone


def test_a_seeded_draw_depends_on_the_tokens_alone() -> None:
    """A fresh sampler given a seeded request with its first k tokens draws token k as the first sampler did:
    what lets a request resume on a fresh engine."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    sampler, seeded = Sampler(V), make_request(temperature=1.0, top_p=0.9, seed=7)
    tokens = []
    for _ in range(8):
        tokens.append(sampler(logits.clone(), [seeded]).token_ids[0])
        seeded.append_token(tokens[-1])
    for k in (0, 3, 7):
        resumed = make_request(output=tokens[:k], temperature=1.0, top_p=0.9, seed=7)
        assert Sampler(V, seed=k)(logits.clone(), [resumed]).token_ids == [tokens[k]]


def test_seeded_top_p_ignores_a_wider_top_k_in_the_batch() -> None:
    """A seeded top-p row whose nucleus outgrows its candidates draws the same with a wide top-k row beside it."""
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 0.1
    logits[0, 450:] -= 5.0  # a nucleus of ~400 tokens: wider than TOP_P_CANDIDATES, narrower than top_k=600

    def run(company: list[dict]) -> list[int]:
        sampler = Sampler(vocab, seed=5)
        seeded = make_request(temperature=1.0, top_p=0.9, seed=42)
        tokens = []
        for _ in range(12):
            rows = [seeded, *(make_request(**params) for params in company)]
            tokens.append(sampler(logits.expand(len(rows), vocab).clone(), rows).token_ids[0])
            seeded.append_token(tokens[-1])
        return tokens

    alone = run([])
    assert run([dict(temperature=1.0, top_k=600)]) == alone
    assert run([dict(temperature=1.0, top_k=600, top_p=0.5), dict(temperature=1.0)]) == alone


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    """logprobs=k returns the sampled token first, then the top k with ranks, from the raw logits."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0, 0, 0, 0, 0]])
    out = Sampler(V)(logits, [make_request(temperature=0, logprobs=2), make_request(temperature=0)])
    ref = torch.log_softmax(logits[0], -1)
    row = out.logprobs[0]
    assert [t for t, _, _ in row] == [1, 1, 2] and [r for _, _, r in row] == [1, 1, 2]
    assert abs(row[2][1] - ref[2].item()) < 1e-6
    assert out.logprobs[1] is None


def _reference_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """True where a token survives top-k then top-p, by sorting the whole row (the textbook way)."""
    out = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits):
        values, idx = row.sort(descending=True)
        n = top_k or len(row)
        probs = torch.softmax(values[:n], -1)
        before = probs.cumsum(-1) - probs
        keep = n if top_p >= 1.0 else int((before < top_p).sum().clamp_min(1))
        out[i, idx[:keep]] = True
    return out


def test_top_k_top_p_match_a_full_sort_on_a_large_vocab() -> None:
    """Candidate-based top-k/top-p equals a full sort; rows with a wider nucleus are handed on, unmasked."""
    from engine.layers.sampler import TOP_P_CANDIDATES, _apply_top_k_top_p

    torch.manual_seed(0)
    vocab = 4 * TOP_P_CANDIDATES
    peaked = torch.randn(4, vocab) * 4
    flat = torch.randn(2, vocab) * 0.1  # the 0.9 nucleus holds most of the vocabulary
    logits = torch.cat([peaked, flat])
    cases = [(0, 0.9), (50, 0.8), (0, 1.0), (300, 1.0), (600, 0.95), (0, 0.9)]
    masked, wide = _apply_top_k_top_p(logits, [k for k, _ in cases], [p for _, p in cases])
    assert wide == [5]  # flat row 4 has top_k=600, which bounds its nucleus within the candidates
    for i, (k, p) in enumerate(cases[:5]):
        assert torch.equal(masked[i] > -float("inf"), _reference_mask(logits[i : i + 1], k, p)[0]), cases[i]
    assert torch.equal(masked[5], logits[5])


def test_wide_nucleus_is_sampled_exactly_by_rejection() -> None:
    """A nucleus wider than the candidates: draws stay inside it and follow the renormalised probabilities."""
    from engine.layers.sampler import TOP_P_CANDIDATES

    vocab = 4 * TOP_P_CANDIDATES
    torch.manual_seed(1)
    logits = torch.randn(1, vocab) * 0.5
    nucleus = _reference_mask(logits, 0, 0.6)[0]
    assert nucleus.sum() > TOP_P_CANDIDATES
    rows = 3000
    sampler = Sampler(vocab, seed=2)
    reqs = [make_request(top_p=0.6) for _ in range(rows)]
    tokens = torch.tensor(sampler(logits.expand(rows, vocab).clone(), reqs).token_ids)
    assert nucleus[tokens].all()
    probs = torch.softmax(logits[0], -1) * nucleus
    probs /= probs.sum()
    top_half = probs >= probs[nucleus].median()
    assert abs(top_half[tokens].float().mean() - probs[top_half].sum()) < 0.04
    seeded = [make_request(top_p=0.6, seed=5) for _ in range(2)]
    assert len(set(sampler(logits.expand(2, vocab).clone(), seeded).token_ids)) == 1


def test_sampling_never_picks_a_zero_probability_token() -> None:
    """Masked tokens are never drawn, even at the edges of the cumulative distribution."""
    logits = torch.full((1, V), -float("inf"))
    logits[0, 3] = 0.0
    logits[0, 5] = 0.0
    tokens = draw({}, rows=2000, logits=logits)
    assert set(tokens.tolist()) == {3, 5}


@pytest.mark.parametrize("kernels", [True, False], ids=["c", "torch"])
def test_argmax_rows_equals_argmax(kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C pass (where the kernels are built) and the blocked search agree with argmax, ties included;
    column-strided logits, and rows of a wider tensor, give argmax too."""
    if kernels and cpu_kernels.library() is None:
        pytest.skip("no C compiler for the CPU kernels")
    if not kernels:
        monkeypatch.setattr(sampler_module.cpu_kernels, "library", lambda: None)
    gen = torch.Generator().manual_seed(0)
    for vocab in (49152, 1000, 997, 7):  # many blocks, an uneven divisor, a prime (blocks of 1), tiny
        logits = torch.randint(0, 5, (6, vocab), generator=gen).float()  # few values: ties within and across blocks
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
        strided = logits.t().contiguous().t()
        assert torch.equal(argmax_rows(strided), logits.argmax(dim=-1))
        wider = torch.zeros(6, vocab + 40)
        wider[:, 3 : 3 + vocab] = logits - 10  # the rows' other entries, zeros, are larger: they must stay unread
        assert torch.equal(argmax_rows(wider[:, 3 : 3 + vocab]), logits.argmax(dim=-1))


def test_argmax_rows_in_c_takes_nan_and_infinities_as_argmax_does() -> None:
    """A row's first NaN is its argmax, as in torch.argmax; +inf beats finite values, an all -inf row gives 0."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler for the CPU kernels")
    logits = torch.randn(5, 100)
    logits[0, [17, 60]] = float("nan")
    logits[1, [5, 90]] = float("inf")
    logits[2] = -float("inf")
    logits[3, 99] = float("nan")  # in the scalar tail of a 16-lane pass
    logits[4, 40] = float("inf")
    logits[4, 70] = float("nan")
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == [17, 5, 0, 99, 70]
