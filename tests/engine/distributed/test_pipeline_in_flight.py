"""Steps in flight over gloo pipeline stages on CPU: eight requests run as two micro-batches that take turns in the
pipe (two steps in it at once, no request in both) with transformers' greedy tokens, three over three stages;
requests aborted or preempted while their step is in the pipe end as they should and every block comes back; a KV
save mid-pipe reads every stage's part; the AsyncEngine driver steps on while steps are in the pipe."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Engine, SamplingParams
from engine.request import Request, RequestStatus
from engine.step_pipeline import StepInFlight

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED = list(range(500, 512))  # a 3-block prefix every other prompt shares
PROMPTS = [SHARED + [600 + i] * (1 + i % 3) if i % 2 else list(range(700 + 11 * i, 703 + 13 * i)) for i in range(8)]
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=8)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS
        ]


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(str(model_dir), pipeline_parallel_size=2, num_blocks=128, **OPTIONS) as engine:
        yield engine


def _assert_pool_whole(engine: Engine) -> None:
    assert not engine.has_unfinished_requests() and len(engine.steps_in_flight) == 0
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_eight_requests_take_turns_in_the_pipe_as_two_micro_batches(engine, expected, monkeypatch) -> None:
    """Two steps in the pipe at once, four requests each, never one request in both; transformers' tokens."""
    runner = engine.runner
    steps: list[tuple[set[str], set[str]]] = []  # each step's requests, and those in the pipe as it went in
    submit = runner.submit

    def recording_submit(scheduler_output) -> None:
        steps.append(({s.req_id for s in scheduler_output.scheduled}, set(engine.steps_in_flight.req_ids)))
        submit(scheduler_output)

    monkeypatch.setattr(runner, "submit", recording_submit)
    hits = engine.stats()["prefix_cache_hits"]
    outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert runner.max_steps_in_flight == 2 and engine.steps_in_flight.depth == 2
    assert all(not (step & in_pipe) for step, in_pipe in steps)
    assert max(len(step) for step, _ in steps) == 4
    overlapped = [step for step, in_pipe in steps if in_pipe]  # went in while the other micro-batch was in the pipe
    assert len(overlapped) > len(steps) // 2
    assert engine.stats()["prefix_cache_hits"] > hits
    assert all(wait > 0 for wait in runner.stage_wait_seconds_per_stage())
    _assert_pool_whole(engine)


def test_requests_aborted_while_in_the_pipe_end_aborted_and_give_every_block_back(engine, expected) -> None:
    """Two requests of the step in the pipe and one waiting its turn are aborted between steps: each ends with
    "abort" and gets no token from the step that was in the pipe; the others give transformers' tokens."""
    ids = [engine.add_request(f"r{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)]
    received: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}

    def take(deltas) -> None:
        for delta in deltas:
            received[delta.request_id] += delta.token_ids
            if delta.finish_reason is not None:
                reasons[delta.request_id] = delta.finish_reason

    while not (engine.steps_in_flight and all(len(received[i]) >= 2 for i in ids)):
        take(engine.step_deltas())
    in_pipe = sorted(engine.steps_in_flight.req_ids)
    not_in_pipe = sorted(set(ids) - set(in_pipe))
    aborted = in_pipe[:2] + not_in_pipe[:1]
    assert len(in_pipe) >= 2 and all(engine.scheduler.requests[i].status == RequestStatus.RUNNING for i in aborted)
    outputs = engine.abort_request(aborted)
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"] * 3
    take(engine.pop_deltas())
    at_abort = {i: list(received[i]) for i in aborted}
    while engine.has_unfinished_requests():
        take(engine.step_deltas())
    for i, request_id in enumerate(ids):
        if request_id in aborted:
            assert reasons[request_id] == "abort" and received[request_id] == at_abort[request_id]
            assert received[request_id] == expected[i][: len(received[request_id])]
        else:
            assert reasons[request_id] == "length" and received[request_id] == expected[i]
    _assert_pool_whole(engine)


def test_preemption_with_steps_in_flight_keeps_the_greedy_tokens(model_dir, expected, monkeypatch) -> None:
    """A pool too small for the eight requests: some are preempted, one at least while its step is in the pipe
    (its logits dropped when they come back), recomputed, and every request still gives transformers' tokens;
    every block comes back."""
    dropped: list[RequestStatus] = []
    live_rows = StepInFlight.live_rows

    def recording_live_rows(step: StepInFlight) -> tuple[list[int], list[Request]]:
        keep, rows = live_rows(step)
        dropped.extend(request.status for request, _ in step.rows if request not in rows)
        return keep, rows

    monkeypatch.setattr(StepInFlight, "live_rows", recording_live_rows)
    with Engine(str(model_dir), pipeline_parallel_size=2, num_blocks=26, **OPTIONS) as engine:
        outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert engine.stats()["num_preemptions"] > 0 and engine.runner.max_steps_in_flight == 2
        assert RequestStatus.PREEMPTED in dropped
        _assert_pool_whole(engine)


def test_three_stages_keep_three_micro_batches_in_the_pipe(tiny_model_factory) -> None:
    """pp=3 on a 3-layer Llama (a middle stage takes hidden states and hands its own on): three steps in the pipe
    at once, the one-process engine's tokens, every block back."""
    model_dir = str(tiny_model_factory("llama", num_hidden_layers=3))
    with Engine(model_dir, num_blocks=128, **OPTIONS) as one:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with Engine(model_dir, pipeline_parallel_size=3, num_blocks=128, **OPTIONS) as engine:
        outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
        assert engine.runner.max_steps_in_flight == 3
        _assert_pool_whole(engine)


async def test_streams_aborted_while_in_the_pipe_end_and_the_engine_comes_to_rest(model_dir, expected) -> None:
    """AsyncEngine over pp=2 (its driver steps on while steps are in the pipe): eight streams, two aborted after
    their second token, end with "abort"; the others give transformers' tokens; the engine comes to rest."""
    from engine import AsyncEngine
    from tests.support.quiescence import assert_quiescent

    async with AsyncEngine(str(model_dir), pipeline_parallel_size=2, num_blocks=128, **OPTIONS) as engine:

        async def stream(i: int):
            last, aborting = None, i in (2, 5)
            async for out in engine.generate(PROMPTS[i], GREEDY, request_id=f"s{i}"):
                if aborting and len(out.outputs[0].token_ids) >= 2:
                    await engine.abort(f"s{i}")
                    aborting = False
                last = out
            return last.outputs[0]

        results = await asyncio.gather(*(stream(i) for i in range(len(PROMPTS))))
        for i, result in enumerate(results):
            if i in (2, 5):
                assert result.finish_reason == "abort" and result.token_ids == expected[i][: len(result.token_ids)]
            else:
                assert result.finish_reason == "length" and result.token_ids == expected[i]
        assert await engine.call(lambda e: e.runner.max_steps_in_flight) == 2
        await assert_quiescent(engine, timeout=60.0)


def test_a_save_while_a_step_is_in_the_pipe_holds_every_stage_s_part(model_dir, expected, tmp_path) -> None:
    """kv_cache_dir: a save while the first step is still in the pipe waits for it on every stage (the ranks' reads
    queue behind it) and does not hold up the pipe; generation goes on with transformers' tokens, and a second
    engine serves the saved prefix blocks with the same tokens."""
    options = dict(OPTIONS, num_blocks=128, kv_cache_dir=tmp_path, kv_cache_save_hot_blocks=64)
    with Engine(str(model_dir), pipeline_parallel_size=2, **options) as engine:
        ids = [engine.add_request(f"r{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)]
        engine.step_deltas()
        assert len(engine.steps_in_flight) == 1 and engine.runner.num_steps_in_flight == 1
        # NOTE: the first step's full prompt blocks, SHARED's 3 and PROMPTS[2]'s first; files once written are kept,
        # so the second engine loads SHARED's as this save wrote them
        assert engine.save_kv_cache() == 4 and len(list(tmp_path.rglob("*.kvb"))) == 4
        outputs = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id] = output
        assert [outputs[i].outputs[0].token_ids for i in ids] == expected
        _assert_pool_whole(engine)
    with Engine(str(model_dir), pipeline_parallel_size=2, **options) as second:  # PROMPTS[1] alone: SHARED loaded
        (output,) = second.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == expected[1] and output.num_cached_tokens == len(SHARED)


def test_speculative_decoding_keeps_one_step_in_the_pipe(model_dir, expected) -> None:
    """Drafts need each step's verdict before the next: pp=2 with speculative decoding runs a step at a time, with
    transformers' tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with Engine(str(model_dir), pipeline_parallel_size=2, num_blocks=128, speculative_config=spec, **OPTIONS) as engine:
        assert engine.steps_in_flight is None
        outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert engine.runner.max_steps_in_flight == 0
