"""Speculation ``mode="auto"``: drafts only where they pay for their share of the measured step cost."""

from __future__ import annotations

from engine import Engine, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.step_cost import StepCost
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.drafter import PRIOR, Drafter

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PASSAGE = list(range(500, 530))
COPY = PASSAGE + [7, 8] + PASSAGE[:6]  # a prompt that starts repeating its passage


def fitted(base: float, per_row: float) -> StepCost:
    """A StepCost measured on steps of ``base + per_row * rows + per_row * prompt tokens`` seconds."""
    cost = StepCost()
    for rows, prompt in [(1, 0), (4, 0), (16, 30), (64, 0), (2, 100)]:
        cost.observe(rows, prompt, base + per_row * (rows + prompt))
    return cost


def test_break_even_rises_with_the_batch() -> None:
    """Drafts pay when the accepted tokens per draft beat ``a N / (base + a N)``."""
    drafter = Drafter(SpeculativeConfig(), fitted(base=0.02, per_row=0.001))
    assert abs(drafter.break_even(1) - 0.001 / 0.021) < 1e-6
    assert abs(drafter.break_even(64) - 0.064 / 0.084) < 1e-6
    assert Drafter(SpeculativeConfig(mode="always"), fitted(0.02, 0.001)).break_even(64) == 0.0
    assert Drafter(SpeculativeConfig(), StepCost()).break_even(1) == 1.0  # nothing measured yet: none pays


def test_drafts_on_at_one_row_off_at_64() -> None:
    drafter = Drafter(SpeculativeConfig(**SPEC), fitted(base=0.02, per_row=0.001))
    request = Request("r", COPY, SamplingParams(max_tokens=50))
    assert drafter.propose(request, 8, num_rows=1) == PASSAGE[6:10]
    assert PRIOR <= drafter.break_even(64) and drafter.propose(request, 8, num_rows=64) == []
    always = Drafter(SpeculativeConfig(**SPEC, mode="always"), fitted(base=0.02, per_row=0.001))
    assert always.propose(request, 8, num_rows=64) == PASSAGE[6:10]


def test_acceptance_below_break_even_stops_a_requests_drafts() -> None:
    drafter = Drafter(SpeculativeConfig(**SPEC), fitted(base=0.02, per_row=0.001))
    request = Request("r", COPY, SamplingParams(max_tokens=50))
    threshold = drafter.break_even(8)  # 0.29
    assert drafter.propose(request, 8, num_rows=8)
    for _ in range(10):
        drafter.observe("r", 4, 1)  # a quarter accepted: below the bound at 8 rows, above it at 1
    assert drafter.propose(request, 8, num_rows=8) == [] and threshold > 0.25
    assert drafter.propose(request, 8, num_rows=1)


def _decoding(num: int) -> tuple[StepCost, Drafter, Scheduler]:
    """``num`` requests whose text repeats, each past its first token, in a scheduler that drafts with ``auto``
    over fitted step costs (0.02 s a step, 1 ms a row)."""
    cost = fitted(base=0.02, per_row=0.001)
    drafter = Drafter(SpeculativeConfig(**SPEC), cost)
    s = Scheduler(KVCacheManager(1024, 4, True), num, 4096, propose=drafter.propose, step_cost=cost)
    for i in range(num):
        s.add_request(Request(f"r{i}", COPY, SamplingParams(max_tokens=50), arrival_seq=i))
    out = s.schedule()
    s.update_from_output([s.requests[x.req_id] for x in out.scheduled], [PASSAGE[6]] * num)
    return cost, drafter, s


def test_scheduler_proposes_no_drafts_at_64_rows() -> None:
    """64 decoding requests whose text repeats: with costs measured, auto proposes nothing; at 1 row it does."""
    cost, drafter, s = _decoding(64)
    out = s.schedule()
    assert len(out.scheduled) == 64 and not any(x.num_draft_tokens for x in out.scheduled)
    alone = Scheduler(KVCacheManager(64, 4, True), 1, 64, propose=drafter.propose, step_cost=cost)
    alone.add_request(Request("one", COPY, SamplingParams(max_tokens=50), arrival_seq=0))
    out = alone.schedule()
    alone.update_from_output([alone.requests["one"]], [PASSAGE[6]])
    assert alone.schedule().scheduled[0].draft_token_ids == PASSAGE[7:11]


def test_batch1_copy_drafts_with_auto_and_matches_greedy(tiny_model_factory, small_tokenizer_dir) -> None:
    """One copy-heavy request under the default auto mode: drafted and accepted where the engine's step costs say
    they pay, none where they do not, the tokens as without speculation either way."""
    model_dir = str(tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir))
    settings = dict(num_blocks=128, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = Engine(model_dir, **settings).generate([COPY], params, use_tqdm=False)[0].outputs[0].token_ids
    auto = Engine(model_dir, speculative_config=SPEC, **settings)
    assert auto.config.speculative_config.mode == "auto" and auto.drafter.step_cost is auto.scheduler.step_cost
    # NOTE: the engine's measured costs, pinned (timings on a shared machine vary): weight-bound steps, then
    # steps whose time is all per row (drafts never pay)
    for coefficients, drafted in [((0.02, 0.001), True), ((0.0, 0.001), False)]:
        auto.scheduler.step_cost.decode_coefficients = lambda c=coefficients: c  # type: ignore[method-assign]
        before = auto.stats()["spec_decode_num_draft_tokens"]
        got = auto.generate([COPY], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == plain
        assert (auto.stats()["spec_decode_num_draft_tokens"] > before) is drafted
    assert auto.stats()["spec_decode_num_accepted_tokens"] > 0
    auto.kv.check_integrity()
    assert auto.kv.num_free_blocks == auto.kv.num_blocks


def test_no_drafts_while_a_large_batch_is_being_admitted() -> None:
    """One decode with 63 requests waiting for prompt room: weighed at 64 rows, it proposes nothing."""
    cost = fitted(base=0.02, per_row=0.001)
    drafter = Drafter(SpeculativeConfig(**SPEC), cost)
    s = Scheduler(KVCacheManager(1024, 4, True), 64, 64, propose=drafter.propose, step_cost=cost)
    s.add_request(Request("first", COPY, SamplingParams(max_tokens=50), arrival_seq=0))
    out = s.schedule()
    s.update_from_output([s.requests["first"]], [PASSAGE[6]])
    for i in range(63):
        s.add_request(Request(f"r{i}", COPY, SamplingParams(max_tokens=50), arrival_seq=1 + i))
    out = s.schedule()
    first = next(x for x in out.scheduled if x.req_id == "first")
    assert first.num_draft_tokens == 0 and s.num_waiting > 0


def test_decode_fit_ignores_steps_with_prompt_tokens() -> None:
    """Prompt steps that fill one budget (decode + prompt tokens constant) cannot split a decode's cost from a
    prompt token's: 10% fast, they would put the full fit's bound at 64 rows below PRIOR (every request drafts).
    The decode fit takes steps of decodes alone; with the decode counts varied, it finds base and per row."""
    cost = StepCost()
    for rows in (5, 18, 30, 41, 53):  # admission: decodes and prompt chunks, 512 tokens a step
        cost.observe(rows, 512 - rows, 0.9 * (0.011 + 0.00035 * rows + 0.00025 * (512 - rows)))
    for _ in range(20):
        cost.observe(64, 0, 0.011 + 0.00035 * 64)
    drafter = Drafter(SpeculativeConfig(**SPEC), cost)
    base, per_row, _ = cost.coefficients()
    assert per_row * 64 / (base + per_row * 64) < PRIOR < drafter.break_even(64)
    assert drafter.propose(Request("r", COPY, SamplingParams(max_tokens=50)), 8, num_rows=64) == []
    for rows in (59, 46, 34, 23, 11):  # the batch thins
        cost.observe(rows, 0, 0.011 + 0.00035 * rows)
    base, per_row = cost.decode_coefficients()
    assert abs(base - 0.011) < 1e-9 and abs(per_row - 0.00035) < 1e-9


def test_steps_of_one_decode_count_keep_large_batches_from_drafting() -> None:
    """Decode steps all of 64 rows do not tell base from per row: the least-norm split counts nearly all as rows,
    so no request drafts at 64; one row's steps split half and half, so a request drafts at one row (PRIOR)."""
    drafter = Drafter(SpeculativeConfig(**SPEC), StepCost())
    request = Request("r", COPY, SamplingParams(max_tokens=50))
    drafter.step_cost.observe(1, 40, 0.05)  # a prompt step: no decode fit yet, no drafts
    assert drafter.propose(request, 8, num_rows=1) == []
    for _ in range(5):
        drafter.step_cost.observe(64, 0, 0.03)
    assert drafter.break_even(64) > 0.99 and drafter.propose(request, 8, num_rows=64) == []
    alone = Drafter(SpeculativeConfig(**SPEC), StepCost())
    alone.step_cost.observe(1, 0, 0.01)
    assert abs(alone.break_even(1) - 0.5) < 1e-6 and alone.propose(request, 8, num_rows=1) == PASSAGE[6:10]


def test_a_draining_batch_drafts_only_while_its_lowest_acceptance_pays() -> None:
    """With none waiting, the batch lasts as long as its slowest request: one request that accepts little stops
    every request's drafts at a batch size where its own acceptance would not pay; with requests waiting, or once
    it has finished, the others draft again."""
    drafter = Drafter(SpeculativeConfig(**SPEC), fitted(base=0.02, per_row=0.001))
    good = Request("good", COPY, SamplingParams(max_tokens=50))
    for _ in range(10):
        drafter.observe("good", 4, 4)
        drafter.observe("poor", 4, 1)
    bound = drafter.break_even(8)  # 0.29: above poor's 0.25, below good's 1
    assert drafter.lowest_acceptance(2) < bound < drafter._back_off["good"].acceptance
    assert drafter.propose(good, 8, num_rows=8, draining=False) == PASSAGE[6:10]
    assert drafter.propose(good, 8, num_rows=8, draining=True) == []
    assert drafter.propose(good, 8, num_rows=2, draining=True) == PASSAGE[6:10]  # 0.09: poor's acceptance pays
    drafter.free(["poor"])
    assert drafter.propose(good, 8, num_rows=8, draining=True) == PASSAGE[6:10]  # 7 others never verified: PRIOR
    assert drafter.propose(good, 8, num_rows=64, draining=True) == []  # the bound (0.76) above PRIOR
    assert drafter.propose(good, 8, num_rows=64, draining=False) == PASSAGE[6:10]


def test_scheduler_passes_whether_the_batch_drains() -> None:
    """Eight decoding requests, one of them accepting little: no drafts while none waits, drafts for the others
    once a request waits (its admission keeps the batch full)."""
    _, drafter, s = _decoding(8)
    for _ in range(10):
        for i in range(8):
            drafter.observe(f"r{i}", 4, 1 if i == 7 else 4)
    out = s.schedule()
    assert len(out.scheduled) == 8 and not any(x.num_draft_tokens for x in out.scheduled)
    for x in out.scheduled:
        s.requests[x.req_id].num_computed_tokens -= 1  # the step never ran: schedule the same decodes again
    s.add_request(Request("late", COPY, SamplingParams(max_tokens=50), arrival_seq=8))
    out = s.schedule()
    drafted = {x.req_id for x in out.scheduled if x.num_draft_tokens}
    assert drafted == {f"r{i}" for i in range(7)}


def test_draining_batch_with_auto_matches_greedy(tiny_model_factory, small_tokenizer_dir) -> None:
    """Four copy-heavy requests, none waiting once admitted: auto drafts while the batch's lowest acceptance pays
    (weight-bound steps pinned), and every request's tokens are those without speculation."""
    model_dir = str(tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir))
    settings = dict(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    prompts = [COPY, [3, 4] + COPY, COPY[5:] + COPY, [9] + COPY]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in Engine(model_dir, **settings).generate(prompts, params, use_tqdm=False)]
    auto = Engine(model_dir, speculative_config=SPEC, **settings)
    auto.scheduler.step_cost.decode_coefficients = lambda: (0.02, 0.001)  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in auto.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert auto.stats()["spec_decode_num_draft_tokens"] > 0
    assert auto.kv.num_free_blocks == auto.kv.num_blocks
