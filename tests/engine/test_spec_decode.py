"""Speculative decoding (n-gram drafts): outputs as without it, the KV cache whole, the counts consistent.

The tiny random-weight model over a 1,024-token vocabulary falls into loops under greedy decoding,
and the prompts below repeat passages, so drafts are proposed and many accepted: the tests check
some were.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.errors import ParameterError
from engine.layers.sampler import Sampler
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.drafter import MAX_SKIP, Drafter
from engine.spec_decode.ngram import propose
from engine.spec_decode.verify import verify_drafts
from engine.core.scheduler_output import ScheduledRequest
from engine.structured_output import StructuredOutput

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "mode": "always"}
GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def repeating_prompts(n: int = 6) -> list[list[int]]:
    """Prompts that state a passage and start repeating it; some share a prefix."""
    out = []
    for i in range(n):
        passage = list(range(500 + 40 * i, 500 + 40 * i + 12 + 3 * i))
        head = list(range(300, 320)) if i % 2 else []
        out.append(head + passage + [7, 8] + passage[: 4 + i])
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, small_tokenizer_dir):
    return tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir)


def make(model_dir, spec: dict | None = SPEC, **kw) -> Engine:
    settings = dict(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64) | kw
    return Engine(str(model_dir), speculative_config=spec, **settings)


@pytest.fixture(scope="module")
def plain(model_dir) -> Engine:
    return make(model_dir, None)


@pytest.fixture(scope="module")
def spec(model_dir) -> Engine:
    return make(model_dir)


def outputs(engine: Engine, prompts, params) -> list[tuple[list[int], str, str | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in engine.generate(prompts, params, use_tqdm=False)]


def assert_whole(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished_requests()


def accepted(engine: Engine) -> int:
    return engine.stats()["spec_decode_num_accepted_tokens"]


# ------------------------------------------------------------------------------------------ proposer


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], k=3, max_n=3, min_n=1) == [4, 5, 1]
    assert propose([1, 2, 9, 1, 2, 8, 1, 2], k=2, max_n=2, min_n=2) == [8, 1]  # the latest of two matches
    assert propose([4, 1, 2, 3, 9, 2, 3], k=5, max_n=3, min_n=2) == [9, 2, 3]  # 3-gram missing, the 2-gram found
    assert propose([4, 1, 2, 3, 9, 2, 3], k=5, max_n=3, min_n=3) == []  # below min_n: nothing
    assert propose([1, 1, 1, 1], k=3, max_n=3, min_n=1) == [1]  # the continuation stops at the end
    assert propose([5], k=3, max_n=3, min_n=1) == [] and propose([5, 6, 7], k=3, max_n=2, min_n=1) == []


def test_drafter_backs_off_after_rejections_and_resets_on_acceptance() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1))
    request = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams())
    assert drafter.propose(request, 5) == [3, 4, 1] and drafter.propose(request, 1) == [3]
    drafter.observe("r", 3, 1)  # one of three accepted: one draft next
    assert drafter.propose(request, 5) == [3]
    skips = []
    for _ in range(8):  # all rejected, again and again: 1, 2, 4, ... steps without drafts, then one draft
        drafter.observe("r", 1, 0)
        n = 0
        while not (drafts := drafter.propose(request, 5)):
            n += 1
        assert drafts == [3]
        skips.append(n)
    assert skips == [1, 2, 4, 8, 16, MAX_SKIP, MAX_SKIP, MAX_SKIP]
    drafter.observe("r", 1, 1)
    assert drafter.propose(request, 5) == [3, 4]  # all accepted: one more draft, and the skip back to 1
    drafter.observe("r", 2, 2)
    assert drafter.propose(request, 5) == [3, 4, 1]
    drafter.observe("r", 3, 0)
    assert drafter.propose(request, 5) == [] and drafter.propose(request, 5) == [3]
    drafter.free(["r", "unknown"])


def test_config_is_checked_naming_the_field_and_limit() -> None:
    assert make.__name__  # the engine takes the dict form (used throughout)
    assert SpeculativeConfig(**SPEC).num_speculative_tokens == 4
    cases = [
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "[1, 16]"),
        ({"prompt_lookup_max": 65}, "speculative_config.prompt_lookup_max", "[1, 64]"),
        ({"method": "eagle"}, "speculative_config.method", "one of ngram"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_min", "<= prompt_lookup_max"),
        ({"k": 3}, "speculative_config", "has no field 'k'"),
        ("ngram", "speculative_config", "got str"),
    ]
    from engine.config import EngineConfig

    for value, param, text in cases:
        with pytest.raises(ParameterError) as err:
            EngineConfig(speculative_config=value)
        assert err.value.param == param and text in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------ scheduler and KV


def test_scheduler_budgets_drafts_and_rollback_frees_their_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    drafts = {"a": [9, 9, 9, 9, 9], "b": [8, 8]}
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6, propose=lambda r, m, n, d: drafts[r.req_id][:m])
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    for i, req_id in enumerate("ab"):
        scheduler.add_request(Request(req_id, [1, 2, 3], params, arrival_seq=i))
    out = scheduler.schedule()  # the prompts
    scheduler.update_from_output([scheduler.requests[s.req_id] for s in out.scheduled], [5, 6])
    out = scheduler.schedule()
    shares = {s.req_id: s for s in out.scheduled}
    # a: budget 6, one token kept for b behind it -> 1 + 4 drafts; b: the one token left, no drafts
    assert shares["a"].num_draft_tokens == 4 and shares["a"].token_ids == [5, 9, 9, 9, 9]
    assert shares["b"].num_draft_tokens == 0 and out.num_logits == 6
    a = scheduler.requests["a"]
    assert a.num_computed_tokens == 8 and len(shares["a"].block_ids[0]) == 2
    a.append_token(9)  # one draft accepted, then the target's own token
    a.append_token(4)
    scheduler.update_from_output([scheduler.requests["b"]], [7])
    scheduler.rollback_drafts(out.scheduled)
    assert a.num_computed_tokens == 5 == a.num_tokens - 1
    assert len(kv.get_block_ids("a")[0]) == 2  # slots 0..4 span two blocks
    kv.check_integrity()
    scheduler.finish_requests(["a", "b"], a.status.FINISHED_ABORTED)
    assert kv.num_free_blocks == 16


def test_drafts_stop_at_max_tokens_and_the_length_cap() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, propose=lambda r, m, n, d: [9] * m)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    scheduler.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=50), arrival_seq=1, max_num_tokens=6))
    out = scheduler.schedule()
    scheduler.update_from_output([scheduler.requests[s.req_id] for s in out.scheduled], [5, 5])
    shares = {s.req_id: s for s in scheduler.schedule().scheduled}
    assert shares["a"].num_draft_tokens == 1  # 2 more tokens allowed: one draft, then the bonus token
    assert shares["b"].num_draft_tokens == 1  # 4 tokens held, 6 at most


def test_runner_inputs_ask_logits_at_every_draft_position() -> None:
    from engine.worker.input_batch import prepare_inputs

    scheduled = [
        ScheduledRequest("a", [5, 9, 9], 7, ([0, 1, 2],), True, 2),  # rows 0-2: a decode with two drafts
        ScheduledRequest("b", [1, 2, 3, 4], 0, ([3],), False),  # rows 3-6: a prefill chunk, no logits
        ScheduledRequest("c", [6], 3, ([4],), True),  # row 7: a plain decode
        ScheduledRequest("d", [6, 1], 3, ([5],), True, 1),  # rows 8-9
    ]
    inputs = prepare_inputs(scheduled, 4, torch.device("cpu"))
    assert inputs.logits_indices.tolist() == [0, 1, 2, 7, 8, 9]
    assert inputs.positions.tolist()[:3] == [7, 8, 9] and inputs.positions.tolist()[8:] == [3, 4]
    assert sum(s.num_logits for s in scheduled) == 6


def test_free_tail_refuses_to_drop_hashed_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    kv.allocate_slots("r", tokens, 0, 12)
    kv.free_tail("r", 9)
    assert len(kv.get_block_ids("r")[0]) == 3
    with pytest.raises(ValueError):
        kv.free_tail("r", 4)
    kv.free("r")
    kv.check_integrity()
    assert kv.num_free_blocks == 8


# ------------------------------------------------------------------------------------------ verification


def test_verification_is_distributed_as_the_target() -> None:
    """Sampled rows with a draft: the first token follows the processed distribution, the draft is accepted
    with its probability, and the token after an accepted draft follows the next position's distribution."""
    vocab, rows, draft = 6, 6000, 2
    first = torch.tensor([1.0, 0.2, 1.5, -0.5, 0.7, 0.0])
    second = torch.tensor([0.3, 1.1, -1.0, 0.9, 0.0, 2.0])
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=100)
    sampler = Sampler(vocab, seed=1)
    requests = {f"r{i}": Request(f"r{i}", [1, 2], params) for i in range(rows)}
    scheduled = [ScheduledRequest(f"r{i}", [2, draft], 1, ([0],), True, 1) for i in range(rows)]
    logits = torch.stack([first, second] * rows)

    def sample(row_logits, batch):
        token_ids = sampler(row_logits, batch).token_ids
        for request, token in zip(batch, token_ids):
            request.append_token(token)
        return {r.req_id: t for r, t in zip(batch, token_ids)}

    verified = verify_drafts(logits, scheduled, requests, sample)
    outs = [r.output_token_ids for r in requests.values()]

    def target(logit: torch.Tensor) -> torch.Tensor:
        kept = logit.masked_fill(logit < logit.topk(5).values[-1], -math.inf)
        return torch.softmax(kept / 0.8, dim=-1)

    def chi_square(samples: list[int], p: torch.Tensor) -> float:
        counts = torch.bincount(torch.tensor(samples), minlength=vocab).double()
        expected = p.double() * len(samples)
        support = expected > 0
        assert counts[~support].sum() == 0  # nothing outside the processed distribution's support
        return float(((counts - expected)[support] ** 2 / expected[support]).sum())

    p1, p2 = target(first), target(second)
    # 99.9% quantile of chi-square with 4 degrees of freedom (5 tokens in the top-k support): 18.47
    assert chi_square([o[0] for o in outs], p1) < 18.47
    after = [o[1] for o in outs if o[0] == draft]
    assert chi_square(after, p2) < 18.47
    num_accepted = sum(v.num_accepted for v in verified)
    assert num_accepted == len(after) and all(len(o) == (2 if o[0] == draft else 1) for o in outs)
    assert abs(num_accepted / rows - float(p1[draft])) < 4 * math.sqrt(float(p1[draft]) * (1 - float(p1[draft])) / rows)


# ------------------------------------------------------------------------------------------ engine


def test_greedy_outputs_identical_batched_with_prefix_caching(plain: Engine, spec: Engine) -> None:
    prompts = repeating_prompts()
    want = outputs(plain, prompts, GREEDY)
    before = accepted(spec)
    assert outputs(spec, prompts, GREEDY) == want
    assert outputs(spec, prompts[:3], GREEDY) == want[:3]  # again: prefix-cache hits, drafts over them
    assert accepted(spec) - before > 40
    assert spec.stats()["prefix_cache_hits"] > 0
    assert_whole(spec)


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=6),  # chunked prefill; drafts squeezed by the budget
        dict(num_blocks=30, max_num_seqs=6),  # preemption
        dict(enable_prefix_caching=False, block_size=16),
    ],
    ids=["chunked", "preempted", "no-prefix-cache"],
)
def test_greedy_outputs_identical_under_pressure(model_dir, plain: Engine, settings: dict) -> None:
    prompts = repeating_prompts()
    want = outputs(plain, prompts, GREEDY)
    engine = make(model_dir, **settings)
    assert outputs(engine, prompts, GREEDY) == want
    assert accepted(engine) > 20
    if "num_blocks" in settings:
        assert engine.stats()["num_preemptions"] > 0
    assert_whole(engine)


def test_stop_strings_stop_tokens_and_max_tokens_inside_drafts(plain: Engine, spec: Engine) -> None:
    prompt = repeating_prompts(1)[0]
    free = outputs(plain, [prompt], GREEDY)[0]
    token_ids, text = free[0], free[1]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 3, 7, 13)]
    params.append(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[text[len(text) // 2 :][:3]]))
    params.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[token_ids[9]]))
    params.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[token_ids[9]], min_tokens=12))
    params.append(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2))
    before = accepted(spec)
    for p in params:
        assert outputs(spec, [prompt], p) == outputs(plain, [prompt], p), p
    want, got = (e.generate([prompt], params[-1], use_tqdm=False)[0].outputs[0].logprobs for e in (plain, spec))
    assert [list(entry) for entry in got] == [list(entry) for entry in want]
    assert [lp.logprob for entry in got for lp in entry.values()] == pytest.approx(
        [lp.logprob for entry in want for lp in entry.values()], abs=1e-4
    )
    assert accepted(spec) > before
    assert_whole(spec)


def test_seeded_sampling_gives_the_same_tokens(plain: Engine, spec: Engine) -> None:
    """A seeded request draws the same numbers in the same order with drafts, so its tokens are the same."""
    prompts = repeating_prompts(4)
    params = [
        SamplingParams(max_tokens=30, temperature=0.05, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.1, top_p=0.9, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.08, top_k=3, repetition_penalty=1.1, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.05, frequency_penalty=0.1, min_p=0.05, seed=4, ignore_eos=True),
    ]
    before = spec.stats()["spec_decode_num_draft_tokens"]
    assert outputs(spec, prompts, params) == outputs(plain, prompts, params)
    assert spec.stats()["spec_decode_num_draft_tokens"] > before  # drafts were verified by seeded draws
    assert_whole(spec)


def test_structured_output_is_the_same(plain: Engine, spec: Engine) -> None:
    """Drafts the grammar does not allow are rejected; constrained outputs equal those made without drafts."""
    prompts = repeating_prompts(3)
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(regex=r"(ab|cd){2,12}x")),
        SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(choice=("red", "green"))),
        SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutput(json_object=True)),
    ]
    want = outputs(plain, prompts, params)
    assert outputs(spec, prompts, params) == want
    assert [finish for _, _, finish in want[:2]] == ["stop", "stop"]
    assert_whole(spec)


def test_counts_are_consistent(spec: Engine) -> None:
    from integrations.openai_server.metrics import EngineCollector

    spec.generate(repeating_prompts(), GREEDY, use_tqdm=False)
    s = spec.stats()
    per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
    assert 0 < s["spec_decode_num_accepted_tokens"] <= s["spec_decode_num_draft_tokens"]
    assert sum(per_pos) == s["spec_decode_num_accepted_tokens"] and len(per_pos) == 4
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    collector = EngineCollector()
    collector.bind(spec.stats)
    names = {m.name for m in collector.collect()}
    assert {"paged_spec_decode_num_draft_tokens", "paged_spec_decode_num_accepted_tokens",
            "paged_spec_decode_num_accepted_tokens_per_pos"} <= names


def test_bundled_model_copies_a_passage_the_same(bundled_gguf_dir) -> None:
    passage = ("The committee met on Tuesday to review the budget. It approved funds for the new library, "
               "the park renovation and the repair of the bridge on Mill Street.")
    messages = [{"role": "user", "content": f"Repeat this text word for word: {passage}"}]
    plain = Engine(num_blocks=64, max_num_seqs=2)
    prompt = plain.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt[0], int) else prompt["input_ids"]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    want = outputs(plain, [prompt], params)
    del plain
    spec = Engine(num_blocks=64, max_num_seqs=2, speculative_config={"num_speculative_tokens": 4, "mode": "always"})
    assert outputs(spec, [prompt], params) == want
    assert accepted(spec) > 10
    assert_whole(spec)
