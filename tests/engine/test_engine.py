"""Engine end to end on tiny models: batching, caching and preemption change no output; aborts free blocks."""

from __future__ import annotations

import pytest

from engine import Engine, EngineError, RequestRejected, SamplingParams, cpu_kernels
from engine.request import RequestStatus

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
STATS_KEYS = {
    "num_requests_running", "num_requests_waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached",
    "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "generation_tokens", "num_preemptions",
    "ttft_seconds", "itl_seconds", "generation_tokens_per_second", "weights", "attention", "layers",
    "requests_received", "requests_rejected", "requests_aborted", "request_success", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds", "kv_token_usage",
    "kv_evictions", "tenant_requests", "tenant_computed_tokens", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "mm_encoder_runs",
    "mm_encoder_cache_hits", "pooling_requests", "pooling_tokens", "pooling_batches", "pooling",
}


def prompts(n: int = 5, base: int = 300) -> list[list[int]]:
    """Token-id prompts of different lengths (3 .. 40 tokens), some sharing a 20-token prefix."""
    shared = list(range(base, base + 20))
    return [
        list(range(base + 100 * i, base + 100 * i + 3 + 9 * i)) if i % 2 else shared + [base + 50 + i] * (i + 1)
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(str(model_dir), num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_whole(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished_requests()


def test_batching_changes_no_output(engine: Engine) -> None:
    """Greedy tokens of each request in a mixed batch equal those of the request run alone."""
    ps = prompts()
    alone = [tokens(engine.generate([p], GREEDY, use_tqdm=False))[0] for p in ps]
    together = tokens(engine.generate(ps, GREEDY, use_tqdm=False))
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert_pool_whole(engine)


def test_prefix_caching_on_off_equal(model_dir, engine: Engine) -> None:
    """The same prompts give the same tokens with prefix caching off, and caching really hit."""
    ps = prompts()
    before = engine.stats()["prefix_cache_hits"]
    cached = tokens(engine.generate(ps, GREEDY, use_tqdm=False))
    assert engine.stats()["prefix_cache_hits"] > before
    off = Engine(str(model_dir), num_blocks=128, block_size=4, enable_prefix_caching=False)
    assert tokens(off.generate(ps, GREEDY, use_tqdm=False)) == cached
    assert off.stats()["prefix_cache_hits"] == 0


def test_request_arriving_mid_run_joins_at_once(engine: Engine) -> None:
    """A request added while another decodes gets its first token before the first one finishes."""
    long_id = engine.add_request("long", prompts()[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("late", prompts()[1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    seen_late = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "late":
                seen_late = True
            if out.request_id == long_id and out.finished:
                assert seen_late
    assert seen_late
    assert_pool_whole(engine)


def test_preemption_under_tiny_kv_budget_keeps_greedy_tokens(model_dir, engine: Engine) -> None:
    """With a cache too small for the batch, requests are preempted and still finish with the same tokens."""
    ps = prompts(6)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = tokens(engine.generate(ps, params, use_tqdm=False))
    tiny = Engine(str(model_dir), num_blocks=20, block_size=4, max_num_seqs=6)
    assert tokens(tiny.generate(ps, params, use_tqdm=False)) == reference
    assert tiny.stats()["num_preemptions"] > 0
    assert_pool_whole(tiny)


def test_abort_returns_every_block(engine: Engine) -> None:
    """Aborting running and waiting requests mid-run frees every block at once."""
    for i, p in enumerate(prompts(6)):
        engine.add_request(f"ab{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    outs = engine.abort_request([f"ab{i}" for i in range(6)] + ["nope"])
    assert len(outs) == 6 and all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert_pool_whole(engine)
    assert engine.step() == []


def test_seeded_sampling_reproducible_in_any_company(engine: Engine) -> None:
    """Same seed, same tokens, alone or batched with other (unseeded) requests; another seed differs."""
    p = prompts()[2]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone = tokens(engine.generate([p], seeded, use_tqdm=False))[0]
    others = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 3
    mixed = engine.generate(prompts(4, base=900)[:3] + [p], others + [seeded], use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True)
    assert tokens(engine.generate([p], other_seed, use_tqdm=False))[0] != alone


def test_stop_string_across_tokens_and_stop_token_ids(engine: Engine) -> None:
    """A stop string spanning tokens cuts the text before it; a stop token id ends the output on it."""
    p = "The quick brown fox"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = engine.generate(p, params, use_tqdm=False)[0].outputs[0]
    ids = full.token_ids
    # a stop string made of the tail of token 3 and the head of token 4
    t3, t4 = engine.tokenizer.decode(ids[3:4]), engine.tokenizer.decode(ids[4:5])
    assert t3 and t4
    stop = t3[-1:] + t4[:1]
    cut = full.text.index(stop)
    out = engine.generate(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut] and stop not in out.text
    by_id = engine.generate(p, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[ids[5]]),
                            use_tqdm=False)[0].outputs[0]
    first = ids.index(ids[5])
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: first + 1]


def test_eos_and_ignore_eos(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """EOS ends a request with "stop" unless ignore_eos; min_tokens holds EOS back."""
    p = prompts()[1]
    ids = tokens(engine.generate([p], GREEDY, use_tqdm=False))[0]
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({ids[2]}))
    first = ids.index(ids[2])
    stopped = engine.generate([p], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == ids[: first + 1]
    ignored = engine.generate([p], GREEDY, use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == ids
    held = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, min_tokens=first + 2),
                           use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= first + 2 and ids[2] not in held.token_ids[: first + 1]


def test_n_completions_share_prompt_blocks(engine: Engine) -> None:
    """n=3 gives 3 indexed completions, siblings hit the prompt's cached full blocks."""
    p = list(range(2000, 2018))  # 4 full blocks of 4 + a partial one
    before = engine.stats()["prefix_cache_hits"]
    out = engine.generate([p], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.stats()["prefix_cache_hits"] - before >= 2 * 16
    assert_pool_whole(engine)


def test_logprobs(engine: Engine) -> None:
    """logprobs=2 gives one entry per token: the sampled token (rank 1 when greedy) and the top 2."""
    out = engine.generate([prompts()[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1 and entry[tok].logprob <= 0
        assert len(entry) == 2 and sorted(lp.rank for lp in entry.values()) == [1, 2]


def test_max_model_len_caps_output(model_dir) -> None:
    """A sequence stops with "length" when prompt + output reach max_model_len; longer prompts are rejected."""
    e = Engine(str(model_dir), num_blocks=64, block_size=4, max_model_len=16)
    out = e.generate([list(range(10))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(RequestRejected, match="max_model_len"):
        e.add_request(None, list(range(16)))


def test_invalid_requests_are_rejected(engine: Engine) -> None:
    """Empty prompts, ids outside the vocabulary, prompts the KV cache can never hold are rejected before queueing."""
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request(None, [])
    with pytest.raises(RequestRejected, match="vocab"):
        engine.add_request(None, [engine.vocab_size])
    with pytest.raises(RequestRejected, match="KV cache"):
        engine.add_request(None, [1] * (128 * 4))
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request(None, [1], params={"temperature": 0})
    assert not engine.has_unfinished_requests()


def test_failed_step_fails_its_requests_and_engine_goes_on(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in execute_model fails that step's requests (blocks freed); the next requests are served."""
    real = engine.runner.execute_model
    calls = {"n": 0}

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault")
        return real(scheduler_output)

    monkeypatch.setattr(engine.runner, "execute_model", flaky)
    engine.add_request("f1", prompts()[0], GREEDY)
    engine.add_request("f2", prompts()[1], GREEDY)
    engine.step()
    outs = engine.step()
    assert {o.request_id for o in outs} == {"f1", "f2"} and all(o.finished for o in outs)
    failures = engine.pop_failures()
    assert set(failures) == {"f1", "f2"} and all(isinstance(e, EngineError) for e in failures.values())
    assert_pool_whole(engine)
    with pytest.raises(EngineError):
        engine.add_request("f3", prompts()[0], GREEDY)
        engine.add_request("f4", prompts()[1], GREEDY)
        calls["n"] = 1  # the next call fails again
        engine.generate([prompts()[2]], GREEDY, use_tqdm=False)
    assert_pool_whole(engine)
    assert len(engine.generate([prompts()[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


class _StandInSampler:
    """Samples with ``sample(logits, requests)``; the real sampler still drops finished requests' state."""

    def __init__(self, real, sample) -> None:
        self.real, self.sample = real, sample

    def __call__(self, logits, requests, token_mask=None):
        return self.sample(logits, requests)

    def free(self, req_ids) -> None:
        self.real.free(req_ids)


def test_sampling_fault_fails_one_request(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while sampling one request fails that request alone; the others finish normally."""
    real = engine.sampler

    def picky(logits, requests):
        if any(r.req_id == "bad" for r in requests):
            raise RuntimeError("bad row")
        return real(logits, requests)

    monkeypatch.setattr(engine, "sampler", _StandInSampler(real, picky))
    engine.add_request("bad", prompts()[0], GREEDY)
    engine.add_request("good", prompts()[1], GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert set(engine.pop_failures()) == {"bad"}
    assert finals["bad"].outputs[0].finish_reason == "abort"
    assert finals["good"].outputs[0].finish_reason == "length" and len(finals["good"].outputs[0].token_ids) == 12
    assert_pool_whole(engine)


def test_stats_keys(engine: Engine) -> None:
    """stats() has exactly the documented keys, and the histograms counted every first and later token."""
    before = engine.stats()
    engine.generate([prompts()[0]], GREEDY, use_tqdm=False)
    s = engine.stats()
    assert set(s) == STATS_KEYS
    assert s["generation_tokens"] - before["generation_tokens"] == 12
    assert s["ttft_seconds"]["count"] - before["ttft_seconds"]["count"] == 1
    assert s["itl_seconds"]["count"] - before["itl_seconds"]["count"] == 11
    assert s["kv_blocks_total"] == 128 and s["num_requests_running"] == 0
    assert s["weights"]["quantization"] is None and s["weights"]["bytes"] > 0
    assert s["attention"].startswith(engine.runner.attn_backend.name)
    assert s["layers"] == ("one C call a step" if cpu_kernels.library() is not None else "modules")


def test_request_status_is_ordered() -> None:
    """Statuses order WAITING < RUNNING < PREEMPTED < every FINISHED_*."""
    assert RequestStatus.WAITING < RequestStatus.RUNNING < RequestStatus.PREEMPTED
    assert all(s.is_finished for s in RequestStatus if s > RequestStatus.PREEMPTED)
    assert not any(s.is_finished for s in RequestStatus if s <= RequestStatus.PREEMPTED)


def test_streamed_text_keeps_chinese_and_emoji_whole(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced byte-level tokens of Chinese and emoji stream out as whole characters, never U+FFFD."""
    from engine.layers.sampler import SamplerOutput

    text = "你好，世界🎉🚀"
    script = engine.tokenizer.encode(text)
    scripted = _StandInSampler(
        engine.sampler, lambda logits, reqs: SamplerOutput([script[r.num_output_tokens] for r in reqs], [None] * len(reqs))
    )
    monkeypatch.setattr(engine, "sampler", scripted)
    engine.add_request("utf8", [5, 6, 7], SamplingParams(max_tokens=len(script), ignore_eos=True))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts[-1] == text
    assert all("\ufffd" not in t for t in texts) and len(set(texts)) < len(texts)  # some steps held bytes back


def test_bundled_model_answers(bundled_model_dir) -> None:
    """The bundled SmolLM2 completes a factual prompt greedily, batched with a chat-templated one."""
    e = Engine(num_blocks=64, max_num_seqs=4)
    chat = e.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False
    )
    outs = e.generate(["The capital of France is", chat], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[1].outputs[0].token_ids and "\ufffd" not in outs[1].outputs[0].text
    assert_pool_whole(e)


def test_pins_hold_blocks_until_unpinned_or_aborted(engine: Engine) -> None:
    """A pin keeps its blocks after its request finishes; unpin or abort (even mid-compute) releases them."""
    held = engine.pin_prefix(list(range(3000, 3010)))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 3
    computing = engine.pin_prefix(list(range(3100, 3110)))
    engine.abort_request(computing)  # never stepped: still waiting
    engine.abort_request(held)
    engine.unpin_prefix(held)  # a second release is a no-op
    assert_pool_whole(engine)


def test_step_budget_defaults_to_512_tokens_on_cpu(model_dir) -> None:
    """Without max_num_batched_tokens a CPU engine's steps compute at most 512 tokens: a 1,200-token prompt is
    prefilled in chunks of 512, 512 and 176. A given budget is kept, and a GPU's default is 2,048."""
    from engine.config import step_token_budget

    engine = Engine(str(model_dir), num_blocks=400, block_size=4, max_model_len=1300)
    engine.add_request("long", [3 + i % 200 for i in range(1200)], SamplingParams(max_tokens=1, ignore_eos=True))
    computed = []
    while engine.has_unfinished_requests():
        engine.step()
        computed.append(engine.stats()["prompt_tokens_computed"])
    assert computed == [512, 1024, 1200]
    assert step_token_budget(None, "cpu") == 512 and step_token_budget(None, "cuda") == 2048
    assert step_token_budget(64, "cpu") == 64
