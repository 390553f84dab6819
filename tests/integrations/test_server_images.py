"""Images over HTTP on a scripted engine: image_url parts reach the engine, bad images are 400s naming the field, flags set the limits."""

from __future__ import annotations

import argparse
import json

import openai
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.command import add_arguments, image_limits
from integrations.openai_server.serving import Serving
from sdk import AsyncClient
from sdk.images import ImageLimits
from tests.integrations.fake_engine import FakeEngine
from tests.support.images import data_url, image_bytes, image_part, noise_png, png_declaring

PNG = image_bytes("PNG", (24, 16))
LIMITS = ImageLimits(max_images=2, max_image_bytes=4096, max_image_pixels=64 * 64)


@pytest.fixture
def server(live_server, tokenizer):
    """A server over a fake engine that takes images, with small limits; yields (server, engine)."""
    engine = FakeEngine(tokenizer)
    engine.accepts_images = True
    app = create_app(serving_factory=lambda: Serving(engine, image_limits=LIMITS))
    return live_server(app), engine


def _ask(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def test_openai_client_sends_a_data_url_and_the_engine_gets_the_image(server) -> None:
    live, engine = server
    client = live.openai("none")
    out = client.chat.completions.create(model="fake-model", messages=_ask(image_part(data_url(PNG))), max_tokens=2)
    assert out.choices[0].message.content == " ok ok"
    stream = client.chat.completions.create(
        model="fake-model", messages=_ask(image_part(data_url(image_bytes("GIF", (8, 8)), "image/gif"))), max_tokens=2, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " ok ok"
    assert [[i.size for i in images] for images in engine.images_seen] == [[(24, 16)], [(8, 8)]]


BAD = [
    (_ask(image_part("https://example.com/cat.png")), "messages.0.content.1.image_url", "remote image URLs are off"),
    (_ask(image_part(data_url(noise_png((60, 60))))), "messages.0.content.1.image_url", "max_image_bytes"),
    (_ask(image_part(data_url(image_bytes("PNG", (65, 65))))), "messages.0.content.1.image_url", "max_image_pixels"),
    (_ask(*[image_part(data_url(PNG))] * 3), "messages.0.content.3", "max_images"),
    (_ask(image_part(data_url(PNG, "image/jpeg"))), "messages.0.content.1.image_url", "declares image/jpeg"),
    (_ask(image_part(data_url(PNG[:-30]))), "messages.0.content.1.image_url", "corrupt"),
    (_ask(image_part(data_url(png_declaring(60000, 60000)))), "messages.0.content.1.image_url", "max_image_pixels"),
    (_ask(image_part("data:image/png;base64,%%%")), "messages.0.content.1.image_url", "not valid base64"),
    (_ask({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "huge"}}), "messages.0.content.1.image_url.detail", "auto, low, high"),
]


@pytest.mark.parametrize(("messages", "param", "match"), BAD, ids=[
    "remote-url", "bytes", "pixels", "count", "mime", "corrupt", "bomb", "base64", "detail",
])  # fmt: skip
def test_bad_images_are_400s_naming_the_field_and_the_server_serves_on(server, messages, param, match) -> None:
    live, engine = server
    client = live.openai("none")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=messages, max_tokens=2)
    assert info.value.body["param"] == param and match in info.value.body["message"]
    out = client.chat.completions.create(model="fake-model", messages=_ask(image_part(data_url(PNG))), max_tokens=1)
    assert out.choices[0].message.content == " ok"  # the next request is served
    chunks = client.chat.completions.create(model="fake-model", messages=_ask(image_part(data_url(PNG))), max_tokens=1, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " ok"
    assert len(engine.images_seen) == 2


def test_allowed_hosts_are_fetched_by_the_server(live_server, tokenizer) -> None:
    """With --allowed-media-domains, a remote URL on an allowed host is fetched; another host is still a 400."""
    from aiohttp import web

    async def cat(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    images = web.Application()
    images.router.add_get("/cat.png", cat)
    host = live_server(images, wait_healthy=False)
    engine = FakeEngine(tokenizer)
    engine.accepts_images = True
    limits = ImageLimits(allowed_media_domains=("127.0.0.1",))
    live = live_server(create_app(serving_factory=lambda: Serving(engine, image_limits=limits)))
    client = live.openai("none")
    out = client.chat.completions.create(model="fake-model", messages=_ask(image_part(f"{host.root}/cat.png")), max_tokens=1)
    assert out.choices[0].message.content == " ok" and [i.size for i in engine.images_seen[0]] == [(24, 16)]
    with pytest.raises(openai.BadRequestError, match="not in --allowed-media-domains"):
        client.chat.completions.create(model="fake-model", messages=_ask(image_part("http://localhost:1/cat.png")), max_tokens=1)


def test_a_text_model_refuses_images_with_a_400(live_server, tokenizer) -> None:
    live = live_server(create_app(serving_factory=lambda: Serving(FakeEngine(tokenizer))))
    with pytest.raises(openai.BadRequestError, match="takes no images") as info:
        live.openai("none").chat.completions.create(model="fake-model", messages=_ask(image_part(data_url(PNG))), max_tokens=2)
    assert info.value.body["param"] == "messages.0.content.1"


async def test_the_remote_sdk_client_sends_image_parts(server) -> None:
    live, engine = server
    async with AsyncClient(base_url=live.base_url) as client:
        result = await client.chat(_ask(image_part(data_url(PNG))), max_tokens=2)
        assert result.text == " ok ok"
        from sdk.errors import InvalidRequestError

        with pytest.raises(InvalidRequestError) as info:
            await client.chat(_ask(image_part(data_url(PNG, "image/webp"))), max_tokens=2)
        assert info.value.param == "messages.0.content.1.image_url"
    assert [[i.size for i in images] for images in engine.images_seen] == [[(24, 16)]]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_image_flags_set_the_limits(capsys) -> None:
    assert image_limits(_parse()) == ImageLimits()
    args = _parse(
        "--limit-mm-per-prompt", json.dumps({"image": 2}), "--max-image-bytes", "1MiB", "--max-image-pixels", "1000000",
        "--allowed-media-domains", "images.example.com", "cdn.example.com", "--image-fetch-timeout", "2.5",
    )  # fmt: skip
    assert image_limits(args) == ImageLimits(2, 1 << 20, 1_000_000, ("images.example.com", "cdn.example.com"), 2.5)
    for bad in ('{"video": 1}', "4", '{"image": -1}'):
        with pytest.raises(SystemExit):
            _parse("--limit-mm-per-prompt", bad)
    assert "limit-mm-per-prompt" in capsys.readouterr().err
