"""Per-request timing (RequestOutput.metrics), request counters, tenant figures and the step log."""

from __future__ import annotations

import logging
import re

import pytest

from engine import Engine, SamplingParams, debug_log
from engine.errors import RequestRejected

LENGTH = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> Engine:
    """A tiny llama with 20 blocks of 4 tokens: six 20-token requests cannot all stay resident."""
    return Engine(str(tiny_model_factory("llama")), num_blocks=20, block_size=4, max_num_seqs=6)


def _run(engine: Engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_phases_counters_and_tenants_add_up(engine: Engine) -> None:
    """Under preemption: phases sum to e2e, cached + computed = prompt, received = success + aborted, tenants charged."""
    before = engine.stats()
    shared = list(range(300, 316))
    for i in range(6):
        prompt = shared + [400 + i] * 4 if i < 3 else list(range(500 + 30 * i, 520 + 30 * i))
        engine.add_request(f"m{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           tenant="a" if i % 2 else "b")  # fmt: skip
    engine.add_request("gone", list(range(700, 720)), LENGTH, tenant="a")
    with pytest.raises(RequestRejected):
        engine.add_request("empty", [], LENGTH)
    engine.step()
    assert engine.stats()["tenant_requests"]["a"]["running"] + engine.stats()["tenant_requests"]["a"]["waiting"] == 4
    [aborted] = engine.abort_request("gone")
    finals = _run(engine)
    after = engine.stats()
    assert after["num_preemptions"] > before["num_preemptions"]
    preempted = [o.metrics for o in finals.values() if o.metrics.preempted_seconds > 0]
    assert preempted, "the small cache preempted someone, and its time preempted is counted"
    for output in finals.values():
        m = output.metrics
        assert m.time_in_queue >= 0 and m.prefill_time >= 0 and m.decode_time >= 0
        assert m.time_in_queue + m.prefill_time + m.decode_time == pytest.approx(m.e2e_latency)
        assert m.preempted_seconds <= m.prefill_time + m.decode_time
        assert m.num_cached_prompt_tokens + m.num_computed_prompt_tokens == 20
        assert m.num_cached_prompt_tokens == output.num_cached_tokens
    assert any(o.metrics.num_cached_prompt_tokens == 16 for o in finals.values())  # the shared prefix
    assert aborted.metrics.e2e_latency > 0 and aborted.metrics.decode_time is None

    def delta(key: str) -> int:
        return after[key] - before[key]

    success = {r: n - before["request_success"].get(r, 0) for r, n in after["request_success"].items()}
    assert delta("requests_received") == 7 and delta("requests_aborted") == 1 and delta("requests_rejected") == 1
    assert success == {"length": 6}
    assert after["requests_received"] == sum(after["request_success"].values()) + after["requests_aborted"]
    assert after["e2e_request_latency_seconds"]["count"] - before["e2e_request_latency_seconds"]["count"] == 7
    assert after["request_decode_time_seconds"]["count"] - before["request_decode_time_seconds"]["count"] == 6
    assert after["tenant_requests"] == {}
    computed = {t: n - before["tenant_computed_tokens"].get(t, 0) for t, n in after["tenant_computed_tokens"].items()}
    # each request computes its 20 + 11 tokens at least once, less the shared 16-token prefix two of them
    # find cached; preemption recomputes some
    assert computed["a"] + computed["b"] >= 6 * 31 - 2 * 16 and min(computed["a"], computed["b"]) >= 2 * 31
    assert 0.0 <= after["kv_token_usage"] <= 1.0 and after["kv_evictions"] >= before["kv_evictions"]


def test_step_log_lines(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """With engine.debug at DEBUG: one line per step, and added / scheduled / finished lines per request."""
    with caplog.at_level(logging.DEBUG, logger="engine.debug"):
        engine.add_request("d0", list(range(900, 910)), LENGTH)
        engine.add_request("d1", list(range(1000, 1010)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        finals = _run(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.debug"]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 6  # one prefill step gives both first tokens; d0 decodes 5 more
    first = re.match(r"step \d+: prefill=(\d+) decode=(\d+) tokens=(\d+) \| blocks \+(\d+) -(\d+) evicted=(\d+)", steps[0])
    assert first is not None and first.groups()[:4] == ("2", "0", "20", "6")
    assert re.search(r"decode=2 tokens=2 .*schedule [\d.]+ ms, forward\+sample [\d.]+ ms, output [\d.]+ ms", steps[1])
    assert re.search(r"prefill=0 decode=2 tokens=2 \| blocks \+\d+ -3 ", steps[2])  # d1 finished: its 3 blocks back
    assert re.search(r"prefill=0 decode=1 tokens=1 \| blocks \+\d+ -0 ", steps[3])
    for rid in ("d0", "d1"):
        assert sum(line.startswith(f"request {rid} added: prompt=10") for line in lines) == 1
        assert sum(line.startswith(f"request {rid} scheduled") for line in lines) == 1
        assert sum(line.startswith(f"request {rid} finished: reason=length") for line in lines) == 1
    assert finals["d1"].outputs[0].finish_reason == "length"
    engine.add_request("quiet", list(range(1100, 1110)), LENGTH)
    caplog.clear()
    _run(engine)
    assert not [r for r in caplog.records if r.name == "engine.debug"]


def test_paged_debug_env_turns_the_step_log_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGED_DEBUG=1 enables engine.debug at DEBUG; unset or 0 leaves it off."""
    logger = debug_log.logger
    level, handlers = logger.level, list(logger.handlers)
    try:
        for value in ("", "0"):
            monkeypatch.setenv(debug_log.DEBUG_ENV, value)
            debug_log.configure_from_env()
            assert not debug_log.is_enabled()
        monkeypatch.setenv(debug_log.DEBUG_ENV, "1")
        debug_log.configure_from_env()
        assert debug_log.is_enabled()
    finally:
        logger.handlers = handlers
        logger.setLevel(level)  # NOTE: setLevel, not assignment: it also clears the loggers' cached checks
