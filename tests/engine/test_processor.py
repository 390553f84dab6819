"""The intake (``engine.processor``): each request is checked and prepared once, and a bad one never reaches the driver."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

import engine.processor
from engine import AsyncEngine, Engine, RequestRejected, SamplingParams
from engine.errors import ParameterError
from engine.processor import ProcessedRequest, Processor
from engine.structured_output import StructuredOutput

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(400 + 37 * i, 400 + 37 * i + 5 + i)) for i in range(3)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture
def intake_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Every tokenization and prompt check of any processor, counted by the thread that made it."""
    calls: Counter = Counter()
    tokenize, validate = engine.processor.tokenize, Processor.validate_prompt

    def counted_tokenize(tokenizer, prompt):
        calls["tokenize", threading.current_thread().name] += 1
        return tokenize(tokenizer, prompt)

    def counted_validate(self, prompt_token_ids):
        calls["validate", threading.current_thread().name] += 1
        return validate(self, prompt_token_ids)

    monkeypatch.setattr(engine.processor, "tokenize", counted_tokenize)
    monkeypatch.setattr(Processor, "validate_prompt", counted_validate)
    return calls


def test_engine_processes_each_request_once(model_dir, intake_calls: Counter) -> None:
    """add_request, generate and pin_prefix tokenize and check each prompt once."""
    sync = Engine(str(model_dir), num_blocks=64, block_size=4)
    me = threading.current_thread().name
    sync.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert intake_calls == {("tokenize", me): 3, ("validate", me): 3}
    sync.add_request("one", "hello there", GREEDY)
    sync.pin_prefix(PROMPTS[0])
    assert intake_calls == {("tokenize", me): 5, ("validate", me): 5}


async def test_async_engine_processes_on_the_caller_side_only(model_dir, intake_calls: Counter) -> None:
    """A streamed request and a pin are tokenized and checked once, on the caller's thread; the driver queues them as
    they are."""
    me = threading.current_thread().name
    async with AsyncEngine(str(model_dir), num_blocks=64, block_size=4) as async_engine:
        queued: list[ProcessedRequest] = []

        def spy(running: Engine) -> None:
            enqueue = running.enqueue

            def recording(request: ProcessedRequest, received=None) -> str:
                queued.append(request)
                return enqueue(request, received)

            running.enqueue = recording

        await async_engine.call(spy)
        outs = [out async for out in async_engine.generate("hello there", GREEDY, request_id="r")]
        pinned = await async_engine.pin_prefix(PROMPTS[1])
    assert outs[-1].finished and pinned.num_tokens == len(PROMPTS[1])
    assert intake_calls == {("tokenize", me): 2, ("validate", me): 2}
    assert [(r.request_id, r.pin) for r in queued] == [("r", False), (None, True)]
    assert queued[0].prompt_token_ids == async_engine.tokenizer.encode("hello there")


async def test_a_bad_request_fails_typed_before_reaching_the_driver(model_dir) -> None:
    """Each bad input raises its typed error naming the field; the driver never sees it, and it is counted."""
    bad = [
        ((PROMPTS[0], GREEDY), {"priority": "high"}, ParameterError, "priority"),
        ((PROMPTS[0], GREEDY), {"weight": 0.0}, ParameterError, "weight"),
        ((PROMPTS[0], {"max_tokens": 3}), {}, ParameterError, "params"),
        (([], GREEDY), {}, RequestRejected, "prompt"),
        (([10**8], GREEDY), {}, RequestRejected, "prompt"),
        (({"prompt": "x", "multi_modal_data": {"image": "pixels"}}, GREEDY), {}, RequestRejected, "multi_modal_data.image"),
        ((PROMPTS[0], SamplingParams(structured_output=StructuredOutput(regex="("))), {}, ParameterError, "structured_output.regex"),
    ]  # fmt: skip
    async with AsyncEngine(str(model_dir), num_blocks=64, block_size=4) as async_engine:
        queued: list[ProcessedRequest] = []

        def refuse(request: ProcessedRequest) -> str:
            queued.append(request)
            raise AssertionError("a bad request reached the driver")

        await async_engine.call(lambda running: setattr(running, "enqueue", refuse))
        before = async_engine.stats()["requests_rejected"]
        for args, options, error, field in bad:
            with pytest.raises(error) as info:
                async for _ in async_engine.stream(*args, **options):
                    pass
            assert info.value.param == field
        with pytest.raises(ParameterError) as info:
            await async_engine.pin_prefix(PROMPTS[0], cache_salt=7)
        assert info.value.param == "cache_salt"
        await async_engine.call(lambda running: None)  # NOTE: the driver has run every command posted before this one
        assert queued == []
        assert async_engine.stats()["requests_rejected"] - before == len(bad)

