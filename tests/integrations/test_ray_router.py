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


def _picture_url(seed: int) -> str:
    import io

    import numpy as np
    from PIL import Image

    from sdk.data_url import to_data_url

    png = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 256, (20, 30, 3), dtype=np.uint8)).save(png, format="PNG")
    return to_data_url(png.getvalue())


def _image_chat(url: str, question: str) -> bytes:
    image = {"type": "image_url", "image_url": {"url": url}}
    content = [{"type": "text", "text": SYSTEM}, image, {"type": "text", "text": question}]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


async def test_image_chats_route_by_the_text_before_the_image_and_then_the_image(tiny_model_factory):
    """The ingress lays an image chat out as the engine does (same tokens, same image offsets); the text before the
    image keys the engine's own cached blocks, the image joins the key from its first block, so the same image with
    another question follows the replica that has it and another image shares only the text."""
    from transformers import AutoConfig

    from engine import Engine, SamplingParams
    from engine.core.block_hash import extend_block_hashes
    from engine.multimodal.layout import image_layout
    from integrations.ray.prefix import PrefixHasher, image_key
    from sdk.chat_template import render_chat
    from sdk.images import ImageLimits, decode_data_url, load_image
    from sdk.wire import message_from_wire

    model_dir = tiny_model_factory("llava")
    engine = Engine(str(model_dir), num_blocks=256, block_size=4, dtype="float32")
    layout = image_layout(AutoConfig.from_pretrained(model_dir), engine.tokenizer)
    prompts = engine.image_prompts
    assert layout == (prompts.image_token_id, engine.image_placeholder, prompts.tokens_per_image)
    hasher = PrefixHasher(engine.tokenizer, block_size=4, max_blocks=64, images=layout)
    url, other_url = _picture_url(1), _picture_url(2)
    body = _image_chat(url, "What is it?")

    messages = [message_from_wire(m) for m in json.loads(body)["messages"]]
    ids = render_chat(engine.tokenizer, messages, image_placeholder=engine.image_placeholder)
    image = load_image(*decode_data_url(url, ImageLimits(), "f")[:1], ImageLimits(), "f").image
    processed = engine.processor.process_prompt({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}})
    token_ids, spans = hasher._chat_ids(json.loads(body))
    assert token_ids == processed.prompt_token_ids
    [(offset, length, key)] = spans
    first = processed.images[0]
    assert (offset, length, key) == (first.offset, first.length, image_key(messages[0].image_parts[0][1]))

    hashes = hasher.hashes("/v1/chat/completions", body)
    text_blocks = offset // 4
    assert len(hashes) == len(token_ids) // 4 and text_blocks >= 4 and len(hashes) > (offset + length) // 4
    engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}], SamplingParams(max_tokens=1))
    pool = engine.kv.block_pool
    assert all(pool.get_cached_block(h) is not None for h in hashes[:text_blocks])
    # with the engine's image hash in its place the same layout gives exactly the engine's cached blocks
    engine_hashes: list[bytes] = []
    extend_block_hashes(engine_hashes, token_ids, len(token_ids) - 1, 4, None, [(offset, length, first.hash)])
    assert all(pool.get_cached_block(h) is not None for h in engine_hashes)
    assert hashes[:text_blocks] == engine_hashes[:text_blocks] and hashes[text_blocks] != engine_hashes[text_blocks]

    same = hasher.hashes("/v1/chat/completions", _image_chat(url, "And its colour?"))
    other = hasher.hashes("/v1/chat/completions", _image_chat(other_url, "What is it?"))
    assert same[: (offset + length) // 4] == hashes[: (offset + length) // 4]
    assert other[:text_blocks] == hashes[:text_blocks] and other[text_blocks] != hashes[text_blocks]

    router = _router()
    a, b = StandIn("a"), StandIn("b")
    chosen = _ids(await router.choose_replicas([a, b], _request(prefix=hashes)))[0][0]
    holder = a if chosen == "a" else b
    assert router.match_length(holder, same) == (offset + length) // 4 and router.match_length(holder, other) == text_blocks
    router.replica_queue_len_cache.update(a.replica_id, 0)
    router.replica_queue_len_cache.update(b.replica_id, 0)
    assert _ids(await router.choose_replicas([a, b], _request(prefix=same)))[0] == [chosen]
    assert PrefixHasher(engine.tokenizer, 4).hashes("/v1/chat/completions", body) == []  # text-only layout: no key


def test_the_ingress_reads_the_image_layout_of_the_served_model(tiny_model_factory):
    """The fleet's ingress hashes image chats of a LLaVA model with its layout, and text models' with none."""
    import argparse

    from integrations.openai_server import command
    from integrations.ray.ingress import Ingress

    class Handle:  # what the ingress reads of the engine deployment's handle
        app_name, deployment_name = "test", "engine"

        def options(self, **_):
            return self

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    for arch, accepts_images in (("llava", True), ("llama", False)):
        args = parser.parse_args(["--model", str(tiny_model_factory(arch)), "--block-size", "4"])
        hasher = Ingress(Handle(), args)._hasher
        assert (hasher.images is not None, hasher.block_size) == (accepts_images, 4)
        assert bool(hasher.hashes("/v1/chat/completions", _image_chat(_picture_url(1), "What is it?"))) == accepts_images
