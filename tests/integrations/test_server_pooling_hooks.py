"""The server's hooks on /v1/embeddings, /v1/rerank and /v1/score (shipped MiniLM): a filter's block is a
400 ``content_filter`` naming the input under the route's field, the server goes on serving, and every request
leaves an audit record with its kind, tenant and peer."""

from __future__ import annotations

import json

import aiohttp
import pytest

from integrations.openai_server.app import create_app
from sdk import AsyncClient, ContentBlocked
from sdk.hooks import AuditLog, RegexFilter

KEY = "sk-acme"
DOCS = ["Berlin is in Germany.", "Paris is the capital of France."]


@pytest.fixture
def served(live_server, shipped_minilm_dir, tmp_path):
    audit = tmp_path / "audit.jsonl"
    hooks = [RegexFilter(r"(?i)secret", name="no-secrets"), AuditLog(audit)]
    app = create_app(str(shipped_minilm_dir), api_key={"acme": KEY}, served_model_name="minilm", hooks=hooks,
                     dtype="float32", device="cpu")  # fmt: skip
    return live_server(app), audit


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.root + path, json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
                return resp.status, await resp.json()

    return server.call(go())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ["fine", "a secret"]}, "input.1"),
        ("/v1/rerank", {"query": "capital", "documents": [DOCS[0], "secret doc"]}, "documents.1"),
        ("/v1/score", {"text_1": "the secret", "text_2": DOCS}, "text_1"),
        ("/v1/score", {"text_1": "capital", "text_2": [DOCS[0], "secret"]}, "text_2.1"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "secret"]}, "text_2.1"),
    ],
)
def test_blocked_input_is_a_typed_400_and_the_server_goes_on(served, shipped_minilm_dir, path, body, param):
    """A filter's block answers 400 content_filter naming the route's field; the server then serves the next."""
    server, audit = served
    status, answer = _post(server, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert (error["code"], error["param"], error["type"]) == ("content_filter", param, "invalid_request_error")
    assert error["message"] == f"blocked by a content filter: {param} matched the no-secrets filter"
    status, ok = _post(server, "/v1/embeddings", {"input": "still serving"})
    assert status == 200 and len(ok["data"][0]["embedding"]) == 384
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    blocked = [r for r in records if r["error"] == "ContentBlocked"]
    assert len(blocked) == 1 and blocked[0]["kind"] == ("embed" if "embeddings" in path else path.rsplit("/", 1)[1])
    assert records[-1]["kind"] == "embed" and records[-1]["error"] is None and records[-1]["num_inputs"] == 1
    assert all(r["route"] == "http" and r["tenant"] == "acme" and r["model"] == shipped_minilm_dir.name for r in records)


def test_audit_records_of_served_requests(served):
    """Each pooling route leaves one record per request: kind, inputs, the tokens it answered as usage."""
    server, audit = served
    _, embedded = _post(server, "/v1/embeddings", {"input": ["one", "two", "three"]})
    _, ranked = _post(server, "/rerank", {"query": "capital of France", "documents": DOCS, "top_n": 1})
    _, scored = _post(server, "/v1/score", {"text_1": "capital", "text_2": DOCS})
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["kind"], r["num_inputs"]) for r in records] == [("embed", 3), ("rerank", 2), ("score", 2)]
    assert [r["prompt_tokens"] for r in records] == [a["usage"]["prompt_tokens"] for a in (embedded, ranked, scored)]
    assert AuditLog.verify(audit) == 3


async def test_remote_client_gets_the_typed_error(served):
    """The SDK's remote client raises the server's block as ContentBlocked, its param the input's."""
    server, _ = served
    remote = AsyncClient(base_url=server.base_url, api_key=KEY)
    try:
        with pytest.raises(ContentBlocked) as blocked:
            await remote.embed(["fine", "fine", "secret"])
        assert blocked.value.param == "input.2"
        assert len((await remote.embed("fine")).embeddings[0]) == 384
        with pytest.raises(ContentBlocked) as blocked:  # the route's text_2.1, under the SDK's name
            await remote.score(["fine", "fine"], ["fine", "secret"])
        assert blocked.value.param == "documents.1"
    finally:
        await remote.aclose()
