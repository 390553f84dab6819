"""PrefixAffinityRouter's decisions and the ingress's routing key, without a cluster.

The router is Ray Serve's own ``RequestRouter`` machinery with stand-in replicas (an id and the
routing stats a replica reports); the routing key is checked against a real engine's cache.
Skipped without the ``ray`` extra.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from integrations.ray.router import STATS_PREFIXES, PrefixAffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine", app_name="test")
SYSTEM = "You are a careful assistant. " * 12


class StandIn:
    """What the router reads of a running replica: its id and its last routing stats."""

    def __init__(self, name: str, held: frozenset[bytes] = frozenset()) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats = {STATS_PREFIXES: held}


def _router(max_imbalance: int = 2) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    router.initialize_state(max_imbalance=max_imbalance)
    return router


def _request(**kwargs) -> PendingRequest:
    return PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def _ids(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def test_longest_reported_match_ranks_first_and_no_match_goes_by_load():
    router = _router()
    a, b = StandIn("a", frozenset({b"h1"})), StandIn("b", frozenset({b"h1", b"h2"}))
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"h1", b"h2", b"h3"]))) == [["b"], ["a"]]
    router.replica_queue_len_cache.update(a.replica_id, 1)
    router.replica_queue_len_cache.update(b.replica_id, 0)
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"other"]))) == [["b"], ["a"]]
    assert _ids(await router.choose_replicas([a, b], _request())) == [["a", "b"]]  # no key: Serve's own choice


async def test_routed_prefixes_are_remembered_until_the_replica_dies():
    """Before any report, a prefix follows the replica it was routed to (from the choice on); a dead replica's memory goes."""
    router = _router()
    a, b = StandIn("a"), StandIn("b")
    router.on_request_routed(_request(prefix=[b"s1", b"s2"]), b.replica_id, None)
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"s1", b"q"]))) == [["b"], ["a"]]
    first = _ids(await router.choose_replicas([a, b], _request(prefix=[b"new"])))[0][0]
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"new", b"new-q"])))[0] == [first]
    router.on_replica_actor_died(b.replica_id)
    assert router.match_length(b, [b"s1"]) == 0


async def test_hot_prefix_spills_to_the_least_loaded_replica():
    """Affinity yields once its replica runs more than max_imbalance requests beyond the least loaded."""
    router = _router(max_imbalance=2)
    a, b = StandIn("a", frozenset({b"hot"})), StandIn("b")
    router.replica_queue_len_cache.update(a.replica_id, 2)
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"hot"]))) == [["a"], ["b"]]
    router.replica_queue_len_cache.update(a.replica_id, 3)
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"hot"]))) == [["b"], ["a"]]
    assert router.match_length(b, [b"hot"]) == 1  # b holds the hot prefix from now on


async def test_a_named_replica_gets_the_request_alone():
    router = _router()
    a, b = StandIn("a", frozenset({b"h"})), StandIn("b")
    assert _ids(await router.choose_replicas([a, b], _request(prefix=[b"h"], replica="b"))) == [["b"]]


def test_routing_key_is_the_engines_block_hashes(tiny_model_factory):
    """The ingress's hashes of a chat body are the hashes the engine caches that prompt's blocks under."""
    from engine import Engine, SamplingParams
    from integrations.ray.prefix import PrefixHasher
    from sdk.chat_template import render_chat
    from sdk.types import ChatMessage

    engine = Engine(str(tiny_model_factory("llama")), num_blocks=64, block_size=16)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    body = json.dumps({"model": "m", "messages": messages}).encode()
    hasher = PrefixHasher(engine.tokenizer, block_size=16, max_blocks=4)
    hashes = hasher.hashes("/v1/chat/completions", body)
    assert len(hashes) == 4
    assert not any(engine.kv.block_pool.get_cached_block(h) for h in hashes)
    prompt = render_chat(engine.tokenizer, [ChatMessage(**m) for m in messages])
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert all(engine.kv.block_pool.get_cached_block(h) is not None for h in hashes)
    completion = json.dumps({"model": "m", "prompt": SYSTEM}).encode()
    assert hasher.hashes("/v1/completions", completion) == hasher.block_hashes(engine.tokenize(SYSTEM))
    assert hasher.hashes("/v1/chat/completions", b"{not json") == []
    assert hasher.hashes("/v1/models", b"") == []
