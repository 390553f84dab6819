"""One Runtime holding two chat models: a client picks one by name, each answers with its tokens alone, the engines
step one at a time, an unknown name is a typed error, and close() stops both."""

from __future__ import annotations

import threading

import pytest

from engine import Engine, SamplingParams
from engine.llm_engine import Engine as LLMEngine
from sdk import Client, NotFoundError, Runtime

CONFIG = dict(dtype="float32", num_blocks=64, max_num_seqs=4)
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    """Two tiny random-weight chat models of different families (Llama, Qwen2), on the bundled tokenizer."""
    return [tiny_model_factory("llama"), tiny_model_factory("qwen2")]


def _alone(path) -> list[int]:
    (out,) = Engine(model=str(path), **CONFIG).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return list(out.outputs[0].token_ids)


def test_clients_pick_their_chat_model(models, monkeypatch) -> None:
    """Client(runtime=, model=name) runs on that model (None: the first) with its tokens alone; the two engines
    never step at once; an unknown name is NotFoundError naming the field and the models; blocks all return."""
    most, now, lock = [0], [0], threading.Lock()
    step = LLMEngine.step_deltas

    def watched(engine):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return step(engine)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(LLMEngine, "step_deltas", watched)
    with Runtime([str(m) for m in models], **CONFIG) as runtime:
        first = Client(runtime=runtime)
        names = [first.model_name, models[1].name]
        second = Client(runtime=runtime, model=names[1])
        futures = [runtime.submit(c.aclient.complete(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)) for c in (first, second)]
        results = [f.result(60) for f in futures]
        assert [r.model for r in results] == names
        assert [r.token_ids for r in results] == [_alone(m) for m in models]
        assert results[0].token_ids != results[1].token_ids and most[0] == 1
        assert runtime.chat_engine(names[1]) is not runtime.engine is runtime.chat_engine()
        with pytest.raises(NotFoundError) as error:
            Client(runtime=runtime, model="gpt-4o").complete(PROMPT, max_tokens=2)
        assert error.value.param == "model" and all(repr(name) in str(error.value) for name in names)
        engines = [runtime.chat_engine(name) for name in names]
        assert all(e.stats()["kv_blocks_used"] == 0 for e in engines)
    assert runtime.closed and all(e.health().status != "running" for e in engines)
