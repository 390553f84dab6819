"""`paged serve` with several chat models (`--model` repeated): all listed, each request answered by the model its
`model` names with the tokens that model gives served alone, an unknown model a typed 404, one step at a time."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from engine import Engine, SamplingParams
from engine.llm_engine import Engine as LLMEngine
from integrations.openai_server.app import create_app
from integrations.openai_server.command import add_arguments, make_app
from integrations.openai_server.policy import ServerPolicy, Tenant
from integrations.openai_server.state import STATE
from integrations.serve_command import run
from integrations.top import Figures
from integrations.top import scrape as top_scrape
from sdk import TenantPolicy
from sdk.hooks import AuditLog

CONFIG = dict(dtype="float32", num_blocks=64, max_num_seqs=4)
NAMES = ["tiny-llama-chat", "tiny-qwen-chat"]
HI = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
POLICY = ServerPolicy(tenants=(
    Tenant("root", keys=("sk-root",)),
    Tenant("ann", keys=("sk-ann",), policy=TenantPolicy(max_tokens=3, requests_per_minute=100), models=(NAMES[1],)),
))  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    """Two tiny random-weight chat models of different families (Llama, Qwen2), on the bundled tokenizer."""
    return [tiny_model_factory("llama"), tiny_model_factory("qwen2")]


class _StepWatch:
    """Wraps ``Engine.step_deltas``: how many engines step at once, at most, and how many steps ran."""

    def __init__(self, step):
        self.step, self.now, self.most, self.count = step, 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, engine):
        with self.lock:
            self.now += 1
            self.count += 1
            self.most = max(self.most, self.now)
        try:
            return self.step(engine)
        finally:
            with self.lock:
                self.now -= 1


def _post(server, path: str, body: dict, key: str = "sk-root", headers: dict | None = None) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
            async with session.post(server.root + path, json=body) as resp:
                if headers is not None:
                    headers.update(resp.headers)
                return resp.status, await resp.json()

    return server.call(go())


def _alone(path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The tokens the model gives served alone (its own engine, greedy) for ``prompt_ids``."""
    engine = Engine(model=str(path), **CONFIG)
    (out,) = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(out.outputs[0].token_ids)


def test_each_model_answers_its_requests(live_server, models, tmp_path, monkeypatch):
    """Chat, completions and responses go to the model they name (none: the first) with its tokens alone; an
    unknown model is a 404 naming the field and the models; a tenant's models and caps hold; every block returns."""
    watch = _StepWatch(LLMEngine.step_deltas)
    monkeypatch.setattr(LLMEngine, "step_deltas", lambda engine: watch(engine))  # a function: bound per engine
    audit = tmp_path / "audit.jsonl"
    app = create_app(
        [str(m) for m in models], served_model_name=NAMES, policy=POLICY, hooks=[AuditLog(audit)], **CONFIG,
    )  # fmt: skip
    server = live_server(app)
    client = server.openai("sk-root")
    assert [m.id for m in client.models.list().data] == NAMES

    async def both() -> list[tuple[int, dict]]:  # a chat on each model at once: two engines, one step at a time
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-root"}) as session:
            async def post(name: str) -> tuple[int, dict]:
                body = {"model": name, "messages": HI, **GREEDY}
                async with session.post(server.root + "/v1/chat/completions", json=body) as resp:
                    return resp.status, await resp.json()

            return await asyncio.gather(*(post(name) for name in NAMES))

    steps = watch.count
    replies = server.call(both())
    assert watch.count > steps and watch.most == 1
    outputs = []
    for (status, reply), name, path in zip(replies, NAMES, models):
        assert status == 200 and reply["model"] == name
        got = reply["choices"][0]["token_ids"]
        assert got == _alone(path, reply["prompt_token_ids"], GREEDY["max_tokens"])
        outputs.append(got)
    assert outputs[0] != outputs[1]  # two models, not one answering twice

    prompt = list(range(10, 30))
    for name, path in [(NAMES[1], models[1]), (None, models[0])]:  # no model: the first
        body = {"prompt": prompt, **GREEDY} | ({"model": name} if name else {})
        status, reply = _post(server, "/v1/completions", body)
        assert status == 200 and reply["model"] == (name or NAMES[0])
        assert reply["choices"][0]["token_ids"] == _alone(path, prompt, GREEDY["max_tokens"])
    status, reply = _post(server, "/v1/responses", {"model": NAMES[1], "input": "hi", "max_output_tokens": 4})
    assert status == 200 and reply["model"] == NAMES[1]

    for path, key, served in [("/v1/chat/completions", "sk-root", NAMES), ("/v1/responses", "sk-ann", NAMES[1:])]:
        body = {"model": "gpt-4o", "messages": HI, "input": "hi"}
        status, reply = _post(server, path, body, key)
        error = reply["error"]
        assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert "gpt-4o" in error["message"] and all(repr(name) in error["message"] for name in served)
    status, reply = _post(server, "/v1/chat/completions", {"model": NAMES[0], "messages": HI}, "sk-ann")
    assert status == 404 and reply["error"]["message"].endswith(f"served to this key: {NAMES[1]!r}")  # ann's one model
    status, reply = _post(server, "/v1/chat/completions", {"model": NAMES[1], "messages": HI, "max_tokens": 4}, "sk-ann")
    assert status == 400 and reply["error"]["param"] == "max_tokens"  # her cap holds on the model she uses
    headers: dict = {}
    status, _ = _post(server, "/v1/chat/completions", {"model": NAMES[1], "messages": HI}, "sk-ann", headers)
    assert status == 200 and headers["x-ratelimit-limit-requests"] == "100"  # the limits of the model she used
    status, reply = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert status == 200  # the server goes on

    state = server.app[STATE]
    for serving in state.servings():
        stats = serving.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    engine_names = {s.engine.model_name for s in state.servings()}
    assert {r["model"] for r in records} == engine_names  # the audit names the model each request ran on

    async def scrape() -> str:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-root"}) as session:
            async with session.get(server.root + "/metrics") as resp:
                return await resp.text()

    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in server.call(scrape()).splitlines()
               if line.startswith("paged_")}  # fmt: skip
    for name in NAMES:
        assert samples[f'paged_generation_tokens_total{{model="{name}"}}'] > 0
        assert samples[f'paged_kv_blocks_used{{model="{name}"}}'] == 0
    top = Figures(top_scrape(server.root, "sk-root"), None)  # paged top: a row per model, the figures summed
    assert top.models() == sorted(NAMES) and top.value("paged_kv_blocks_total") == 2 * CONFIG["num_blocks"]


def test_serve_flags_name_each_model(models):
    """`--model` repeated with one `--served-model-name` each; a count that differs, or one name twice, is refused."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [arg for m, name in zip(models, NAMES) for arg in ("--model", str(m), "--served-model-name", name)]
    args = parser.parse_args(argv)
    assert args.model == [str(m) for m in models] and args.served_model_name == NAMES
    make_app(args)  # loads nothing until it starts
    with pytest.raises(ValueError, match="--served-model-name given 1 times for 2 --model"):
        make_app(parser.parse_args(argv[:6]))
    with pytest.raises(ValueError, match="served as 'x'"):
        make_app(parser.parse_args(["--model", str(models[0]), "--model", str(models[1]), *["--served-model-name", "x"] * 2]))
    assert run(parser.parse_args([*argv, "--replicas", "2"])) == 2  # a fleet serves one model: refused before Ray starts
