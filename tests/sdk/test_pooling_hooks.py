"""Hooks on embed, rerank and score requests (shipped MiniLM): audit records that name the kind, model, inputs,
tokens and tenant; input filters that block naming the input or redact it; the chat path's failure semantics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest

from sdk import AsyncClient, ContentBlocked, HookFailed, Runtime
from sdk.hooks import AuditLog, Hook, RegexFilter, RequestContext, RequestOrigin
from tests.support.minilm import shipped_minilm_dir

RUNTIME = Runtime(str(shipped_minilm_dir()), dtype="float32", device="cpu")
"""The MiniLM engine every client here shares (loaded once, on first use)."""
DOCS = ["Berlin is in Germany.", "Paris is the capital of France.", "Cats chase mice."]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module", autouse=True)
def _close_runtime() -> Iterator[None]:
    yield
    RUNTIME.close()


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Exploding(Hook):
    async def on_request(self, ctx: RequestContext) -> None:
        raise RuntimeError("boom")


class ExplodingAudit(Hook):
    fail_closed = False

    async def on_request(self, ctx: RequestContext) -> None:
        raise OSError("audit index down")


class Gate(Hook):
    """Holds each request in ``on_request`` until released; says when one arrived."""

    def __init__(self) -> None:
        self.arrived, self.release = asyncio.Event(), asyncio.Event()

    async def on_request(self, ctx: RequestContext) -> None:
        self.arrived.set()
        await self.release.wait()


async def test_audit_records_name_kind_model_inputs_tokens_and_tenant(tmp_path) -> None:
    """One chained record per embed / rerank / score request: its kind, the model, how many inputs, the tokens
    the model read (the usage the caller got), the tenant and who sent it."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    client = AsyncClient(runtime=RUNTIME, hooks=[audit], tenant="acme")
    origin = RequestOrigin("10.0.0.7", {"user-agent": "rag-app"})
    embedded = await client.embed(DOCS, origin=origin)
    ranked = await client.rerank(QUERY, DOCS, top_n=1)
    scored = await client.score(QUERY, DOCS[:2])
    records = _records(tmp_path / "audit.jsonl")
    assert [r["kind"] for r in records] == ["embed", "rerank", "score"]
    assert [r["num_inputs"] for r in records] == [3, 3, 2]
    assert [r["prompt_tokens"] for r in records] == [
        embedded.usage.prompt_tokens, ranked.usage.prompt_tokens, scored.usage.prompt_tokens
    ]
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] == 0 for r in records)
    assert {r["model"] for r in records} == {client.model_name} and {r["tenant"] for r in records} == {"acme"}
    assert {r["finish_reason"] for r in records} == {"stop"} and {r["error"] for r in records} == {None}
    assert records[0]["request_id"].startswith("embd-") and records[1]["request_id"].startswith("rerank-")
    assert all(r["latency_s"] > 0 and "inputs" not in r for r in records)  # no text without include_text
    pairs = await client.score([QUERY, "cats"], [DOCS[1], DOCS[2]])  # one request, one record
    assert pairs.scores == pytest.approx([scored.scores[1], (await client.score("cats", DOCS[2])).scores[0]], abs=1e-6)
    assert [r["kind"] for r in _records(tmp_path / "audit.jsonl")[3:]] == ["score", "score"]
    assert AuditLog.verify(tmp_path / "audit.jsonl") == 5


async def test_input_filter_blocks_naming_the_input(tmp_path) -> None:
    """A blocked input is the chat path's ContentBlocked, its param naming the input (or the query); the engine
    reads nothing of the request, and the audit record says who blocked it."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    client = AsyncClient(runtime=RUNTIME, hooks=[RegexFilter(r"(?i)secret", name="no-secrets"), audit])
    await client.start()
    before = client.stats()["pooling_requests"]
    with pytest.raises(ContentBlocked) as blocked:
        await client.embed(["harmless", "a SECRET plan", "secret too"])
    assert blocked.value.param == "input.1" and blocked.value.hook == "no-secrets"
    assert str(blocked.value) == "input.1 matched the no-secrets filter"
    with pytest.raises(ContentBlocked) as blocked:
        await client.rerank(QUERY, [DOCS[0], "secret"])
    assert blocked.value.param == "documents.1"
    with pytest.raises(ContentBlocked) as blocked:
        await client.score("the secret capital", DOCS)
    assert blocked.value.param == "query"
    with pytest.raises(ContentBlocked) as blocked:  # pairs: a query per document
        await client.score(["capital", "a secret"], DOCS[:2])
    assert blocked.value.param == "query.1"
    with pytest.raises(ContentBlocked) as blocked:  # token ids cannot be read: fail closed
        await client.embed([[101, 2023, 102]])
    assert blocked.value.param == "input.0"
    assert client.stats()["pooling_requests"] == before
    records = _records(tmp_path / "audit.jsonl")
    assert [r["kind"] for r in records] == ["embed", "rerank", "score", "score", "embed"]
    assert {r["error"] for r in records} == {"ContentBlocked"} and {r["finish_reason"] for r in records} == {None}
    assert records[0]["decisions"] == [
        {"hook": "no-secrets", "stage": "input", "action": "block", "detail": "input.1 matched the no-secrets filter"}
    ]
    assert records[0]["prompt_tokens"] == 0 and records[0]["num_inputs"] == 3
    assert (await client.embed("harmless")).usage.prompt_tokens > 0  # the client goes on serving


async def test_redaction_rewrites_what_the_engine_embeds(tmp_path) -> None:
    """A redacting filter's rewrite is what the model reads: the vectors are those of the redacted texts."""
    audit = AuditLog(tmp_path / "audit.jsonl", include_text=True)
    client = AsyncClient(runtime=RUNTIME, hooks=[RegexFilter(r"\d{3}-\d{2}-\d{4}", action="redact"), audit])
    plain = AsyncClient(runtime=RUNTIME)
    redacted = await client.embed(["my number is 123-45-6789", "no number here"])
    expected = await plain.embed(["my number is [REDACTED]", "no number here"])
    np.testing.assert_allclose(redacted.embeddings, expected.embeddings, atol=1e-6)
    scored = await client.score("who has 123-45-6789?", ["Ann has 123-45-6789."])
    reference = await plain.score("who has [REDACTED]?", ["Ann has [REDACTED]."])
    assert scored.scores == pytest.approx(reference.scores, abs=1e-6)
    first, second = _records(tmp_path / "audit.jsonl")
    assert first["inputs"] == ["my number is [REDACTED]", "no number here"] and first["query"] is None
    assert second["query"] == "who has [REDACTED]?"
    assert first["decisions"][0]["action"] == "redact" and "6789" not in json.dumps(first)


async def test_hook_failures_as_on_chat(tmp_path) -> None:
    """A raising filter fails the request closed (HookFailed, nothing embedded); a raising fail-open hook is
    counted and the request is served; both leave one audit record."""
    audit = AuditLog(tmp_path / "audit.jsonl")
    closed = AsyncClient(runtime=RUNTIME, hooks=[Exploding(), audit])
    with pytest.raises(HookFailed) as failed:
        await closed.embed(DOCS)
    assert isinstance(failed.value.__cause__, RuntimeError)
    opened = AsyncClient(runtime=RUNTIME, hooks=[ExplodingAudit(), audit])
    assert len((await opened.rerank(QUERY, DOCS)).results) == 3
    assert opened.stats()["hook_failures"] == 1
    records = _records(tmp_path / "audit.jsonl")
    assert [(r["kind"], r["error"], r["finish_reason"]) for r in records] == [
        ("embed", "HookFailed", None), ("rerank", None, "stop")
    ]


async def test_a_cancelled_request_is_audited_as_abort(tmp_path) -> None:
    """A caller that goes away while its request waits in the hooks still gets one record: abort, cancelled."""
    gate, audit = Gate(), AuditLog(tmp_path / "audit.jsonl")
    client = AsyncClient(runtime=RUNTIME, hooks=[gate, audit])
    task = asyncio.ensure_future(client.embed(DOCS))
    await gate.arrived.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [record] = _records(tmp_path / "audit.jsonl")
    assert (record["kind"], record["finish_reason"], record["error"]) == ("embed", "abort", "CancelledError")


async def test_adapters_run_the_hooks_under_their_route(tmp_path) -> None:
    """The LangChain and LlamaIndex embedders and rerankers take hooks: a blocked document is ContentBlocked,
    and each call leaves a record under the adapter's route."""
    from langchain_core.documents import Document
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    from sdk.integrations import langchain as lc
    from sdk.integrations import llamaindex as li

    audit = AuditLog(tmp_path / "audit.jsonl")
    hooks = [RegexFilter(r"(?i)secret"), audit]
    embeddings = lc.PagedEmbeddings(runtime=RUNTIME, hooks=hooks)
    with pytest.raises(ContentBlocked) as blocked:
        await embeddings.aembed_documents(["fine", "a secret"])
    assert blocked.value.param == "input.1"
    assert len(embeddings.embed_query("fine")) == 384
    kept = lc.PagedRerank(runtime=RUNTIME, hooks=hooks, top_n=1).compress_documents(
        [Document(page_content=d) for d in DOCS], QUERY
    )
    assert kept[0].page_content == DOCS[1]
    nodes = [NodeWithScore(node=TextNode(text=d), score=0.0) for d in DOCS]
    li.PagedRerank(runtime=RUNTIME, hooks=hooks, top_n=1).postprocess_nodes(nodes, QueryBundle(QUERY))
    li.PagedEmbedding(runtime=RUNTIME, hooks=hooks).get_text_embedding_batch(DOCS)
    records = _records(tmp_path / "audit.jsonl")
    assert [(r["route"], r["kind"], r["error"]) for r in records] == [
        ("langchain-embeddings", "embed", "ContentBlocked"), ("langchain-embeddings", "embed", None),
        ("langchain-rerank", "rerank", None), ("llamaindex-rerank", "rerank", None),
        ("llamaindex-embedding", "embed", None),
    ]
