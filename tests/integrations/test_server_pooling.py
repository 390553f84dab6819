"""`paged serve` on the shipped MiniLM: /v1/embeddings, /v1/rerank, /rerank and /v1/score against the in-process
engine's answers, the official openai client, the SDK's remote client, typed 400s, tenants' limits and /metrics."""

from __future__ import annotations

import base64
import struct

import aiohttp
import numpy as np
import pytest

from engine import Engine
from integrations.openai_server.app import create_app
from integrations.openai_server.policy import ServerPolicy, Tenant
from sdk import AsyncClient, InvalidRequestError, TenantPolicy
from sdk.retrieval import MAX_INPUTS

TEXTS = ["The cat sat on the mat.", "Paged attention keeps KV blocks in a pool.", "Paris is the capital of France."]
DOCS = ["Berlin is in Germany.", "Paris is the capital of France.", "Cats chase mice."]
KEY = "sk-pool"


@pytest.fixture(scope="module")
def engine(shipped_minilm_dir):
    return Engine(model=str(shipped_minilm_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def policy() -> ServerPolicy:
    limited = Tenant("limited", ("sk-limited",), TenantPolicy(requests_per_minute=1))
    chat_only = Tenant("chat-only", ("sk-chat",), routes=("/v1/chat/completions",))
    return ServerPolicy(tenants=(limited, chat_only)).with_keys({"main": KEY})


@pytest.fixture
def server(live_server, shipped_minilm_dir, policy):
    app = create_app(str(shipped_minilm_dir), policy=policy, served_model_name="minilm", dtype="float32", device="cpu")
    return live_server(app)


def _post(server, path: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.root + path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                return resp.status, await resp.json()

    return server.call(go())


def test_openai_client_embeddings_are_the_engines(server, engine):
    client = server.openai(KEY)
    expected = [o.outputs.embedding for o in engine.embed(TEXTS)]
    got = client.embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in got.data], expected, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(o.prompt_token_ids) for o in engine.embed(TEXTS))
    # the client asks for base64 by default when numpy is present; explicit float is the list itself
    raw = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(raw.data[0].embedding, expected[0], atol=1e-6)
    # token ids are read as they are
    ids = engine.embed(TEXTS[1])[0].prompt_token_ids
    by_ids = client.embeddings.create(model="minilm", input=ids)
    np.testing.assert_allclose(by_ids.data[0].embedding, expected[1], atol=1e-6)


def test_base64_is_the_float32_bytes(server):
    status, floats = _post(server, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "float"})
    assert status == 200
    status, packed = _post(server, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200 and packed["object"] == "list" and packed["model"] == "minilm"
    for f, b in zip(floats["data"], packed["data"]):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 4 * 384
        np.testing.assert_allclose(struct.unpack("<384f", raw), f["embedding"], atol=1e-6)  # two runs: same to float32


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_sorts_by_the_engines_scores(server, engine, path):
    expected = [o.outputs.score for o in engine.score("What is the capital of France?", DOCS)]
    status, body = _post(server, path, {"query": "What is the capital of France?", "documents": DOCS})
    assert status == 200
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [expected[i] for i in order], atol=1e-6)
    status, top = _post(server, path, {"query": "capital of France", "documents": DOCS, "top_n": 1, "return_documents": False})
    assert status == 200 and len(top["results"]) == 1 and "document" not in top["results"][0]
    assert top["results"][0]["index"] == 1


def test_score_one_query_and_pairs(server, engine):
    expected = [o.outputs.score for o in engine.score("cats", DOCS)]
    status, body = _post(server, "/v1/score", {"text_1": "cats", "text_2": DOCS})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-6)
    status, pairs = _post(server, "/score", {"text_1": ["cats", "France"], "text_2": [DOCS[2], DOCS[1]]})
    assert status == 200
    np.testing.assert_allclose(
        [d["score"] for d in pairs["data"]],
        [engine.score("cats", DOCS[2])[0].outputs.score, engine.score("France", DOCS[1])[0].outputs.score], atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/embeddings", {"input": []}, "input", "must not be empty"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input.1", "must not be empty"),
        ("/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"limit of {MAX_INPUTS}"),
        ("/v1/embeddings", {"input": ["ok", "word " * 600], "truncate_prompt_tokens": None}, "input.1", "over the model's 256"),
        ("/v1/embeddings", {"input": "x", "dimensions": 64}, "dimensions", "Matryoshka"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ("/v1/rerank", {"query": "", "documents": DOCS}, "query", "non-empty"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": DOCS, "top_n": -1}, "top_n", ">= 1"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": DOCS}, "text_1", "one per text_2"),
        ("/v1/score", {"text_1": "a", "text_2": ["ok", ""]}, "text_2.1", "non-empty"),
        ("/v1/score", {"text_1": ["a", ""], "text_2": ["b", "c"]}, "text_1.1", "non-empty"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "word " * 600], "truncate_prompt_tokens": None}, "text_2.1", "over"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "cannot generate"),
        ("/v1/completions", {"prompt": "hi"}, "model", "cannot generate"),
    ],
)
def test_bad_input_is_a_typed_400_and_the_server_goes_on(server, path, body, param, words):
    status, answer = _post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    status, ok = _post(server, "/v1/embeddings", {"input": "still serving"})
    assert status == 200 and len(ok["data"][0]["embedding"]) == 384


def test_tenants_limits_routes_and_metrics(server):
    assert _post(server, "/v1/embeddings", {"input": "one"}, key="sk-limited")[0] == 200
    status, answer = _post(server, "/v1/embeddings", {"input": "two"}, key="sk-limited")
    assert status == 429 and "requests_per_minute" in answer["error"]["message"]
    status, answer = _post(server, "/v1/rerank", {"query": "q", "documents": DOCS}, key="sk-chat")
    assert status == 403 and answer["error"]["code"] == "route_not_allowed"
    assert _post(server, "/v1/embeddings", {"input": "x"}, key="sk-nobody")[0] == 401
    status, answer = _post(server, "/v1/embeddings", {"input": "x", "model": "other"})
    assert status == 404 and answer["error"]["param"] == "model"
    _, embedded = _post(server, "/v1/embeddings", {"input": TEXTS})
    _, ranked = _post(server, "/rerank", {"query": "q", "documents": DOCS})

    async def scrape() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.root + "/metrics", headers={"Authorization": f"Bearer {KEY}"}) as resp:
                return await resp.text()

    text = server.call(scrape())
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("paged_pooling")}
    assert samples['paged_pooling_requests_total{route="/v1/embeddings"}'] == 2  # "one" and TEXTS
    assert samples['paged_pooling_prompt_tokens_total{route="/v1/embeddings"}'] == 3 + embedded["usage"]["prompt_tokens"]
    assert samples['paged_pooling_requests_total{route="/v1/rerank"}'] == 1
    assert samples['paged_pooling_prompt_tokens_total{route="/v1/rerank"}'] == ranked["usage"]["prompt_tokens"]
    assert samples['paged_pooling_requests_total{route="/v1/score"}'] == 0
    # the engine's batches: "one", TEXTS, and the rerank's query and documents (embedded: MiniLM scores by cosine)
    num_inputs = 1 + len(TEXTS) + 1 + len(DOCS)
    assert samples['paged_pooling_inputs_total{kind="embed"}'] == num_inputs
    assert samples['paged_pooling_inputs_total{kind="score"}'] == 0
    read = sum(v for k, v in samples.items() if k.startswith("paged_pooling_prompt_tokens_total"))
    assert samples['paged_pooling_tokens_total{kind="embed"}'] == read
    assert samples['paged_pooling_queue_time_seconds_count{kind="embed"}'] == num_inputs
    assert samples['paged_pooling_compute_time_seconds_count{kind="embed"}'] == num_inputs
    assert samples['paged_pooling_compute_time_seconds_sum{kind="embed"}'] > 0
    assert samples['paged_pooling_batch_size_sum{kind="embed"}'] == num_inputs
    assert samples['paged_pooling_batch_size_count{kind="embed"}'] == samples['paged_pooling_batches_total{kind="embed"}'] >= 3


async def test_sdk_remote_client_gives_the_in_process_results(server, engine):
    remote = AsyncClient(base_url=server.base_url, api_key=KEY)
    try:
        embedded = await remote.embed(TEXTS)
        np.testing.assert_allclose(embedded.embeddings, [o.outputs.embedding for o in engine.embed(TEXTS)], atol=1e-6)
        assert embedded.model == "minilm"
        ranked = await remote.rerank("capital of France", DOCS, top_n=2)
        local = [o.outputs.score for o in engine.score("capital of France", DOCS)]
        assert [r.index for r in ranked.results] == sorted(range(3), key=lambda i: -local[i])[:2]
        scored = await remote.score("cats", DOCS)
        np.testing.assert_allclose(scored.scores, [o.outputs.score for o in engine.score("cats", DOCS)], atol=1e-6)
        with pytest.raises(InvalidRequestError) as error:
            await remote.score("cats", ["ok", "word " * 600], truncate_prompt_tokens=None)
        assert error.value.param == "documents.1"
    finally:
        await remote.aclose()
