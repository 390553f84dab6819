"""Image intake (sdk.images): every check names the field and the limit, and runs before the pixels are decoded."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from PIL import Image

from engine.multimodal import image_hash
from sdk.errors import InvalidRequestError
from sdk.data_url import to_data_url
from sdk.images import ImageLimits, decode_data_url, fetch_url, load_image, load_message_images
from sdk.types import ChatMessage, ImagePart
from tests.support.images import data_url, image_bytes, image_part, png_declaring

FIELD = "messages.2.content.1.image_url"
PNG_BYTES = image_bytes("PNG")


@pytest.mark.parametrize(("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_each_format_decodes_with_its_hash_and_size(fmt: str, mime: str) -> None:
    data = image_bytes(fmt, (24, 16))
    raw, declared = decode_data_url(data_url(data, mime), ImageLimits(), FIELD)
    loaded = load_image(raw, ImageLimits(), FIELD, declared)
    assert raw == data and declared == mime
    assert loaded.info.hash == image_hash(loaded.image)
    assert (loaded.info.num_bytes, loaded.info.width, loaded.info.height, loaded.info.mime_type) == (len(data), 24, 16, mime)
    assert loaded.image.mode == "RGB" and loaded.image.size == (24, 16)


def test_alpha_images_become_rgb_and_jpg_is_jpeg() -> None:
    loaded = load_image(image_bytes("PNG", mode="RGBA"), ImageLimits(), FIELD, "image/png")
    assert loaded.image.mode == "RGB"
    _, mime = decode_data_url(data_url(image_bytes("JPEG"), "image/jpg"), ImageLimits(), FIELD)
    assert mime == "image/jpeg"
    data, mime = decode_data_url(data_url(PNG_BYTES, "IMAGE/PNG").replace(";base64", ";charset=binary;BASE64"), ImageLimits(), FIELD)
    assert (data, mime) == (PNG_BYTES, "image/png")


def _refused(fn, *args, match: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        fn(*args)
    assert info.value.param == FIELD and str(info.value).startswith(FIELD)
    return info.value


def test_a_mime_type_that_is_not_the_bytes_format_is_refused() -> None:
    _refused(load_image, image_bytes("PNG"), ImageLimits(), FIELD, "image/jpeg", match="declares image/jpeg but its bytes are image/png")


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("data:image/png,rawbytes", "base64 data URL"),
        ("data:text/plain;base64,aGVsbG8=", "declares text/plain"),
        ("data:image/png;base64,***not base64***", "not valid base64"),
        ("image/png;base64,AAAA", "base64 data URL"),
    ],
)
def test_malformed_data_urls_are_refused(url: str, match: str) -> None:
    _refused(decode_data_url, url, ImageLimits(), FIELD, match=match)


def test_oversized_bytes_are_refused_before_base64_is_decoded() -> None:
    # NOTE: not valid base64 either: the size check must come first to answer "bytes"
    url = "data:image/png;base64," + "!" * 4000
    error = _refused(decode_data_url, url, ImageLimits(max_image_bytes=1000), FIELD, match="limit is 1000")
    assert "max_image_bytes" in str(error)
    _refused(load_image, image_bytes("PNG", (64, 64)), ImageLimits(max_image_bytes=50), FIELD, match="max_image_bytes")


def test_too_many_pixels_are_refused() -> None:
    _refused(load_image, image_bytes("PNG", (100, 100)), ImageLimits(max_image_pixels=5000), FIELD,
             match=r"100x100 = 10000 pixels; the limit is 5000 \(max_image_pixels\)")  # fmt: skip


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 400-byte PNG declaring 60000x60000 (3.6 GB of RGB) is refused without decoding a pixel, even past Pillow's own bomb bound."""
    bomb, big = png_declaring(60000, 60000), png_declaring(5000, 5000)
    assert len(bomb) < 1000

    def no_decoding(self):  # noqa: ANN001
        raise AssertionError("decoded a bomb")

    monkeypatch.setattr(Image.Image, "load", no_decoding)
    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", no_decoding)
    _refused(load_image, bomb, ImageLimits(), FIELD, match="max_image_pixels")
    _refused(load_image, big, ImageLimits(), FIELD, match=r"5000x5000 = 25000000 pixels")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"not an image at all", "not a PNG, JPEG, WebP or GIF"),
        (image_bytes("BMP"), "not a PNG, JPEG, WebP or GIF"),  # a format Pillow reads, but not one we take
        (image_bytes("PNG", (64, 64))[:-40], "corrupt or truncated PNG"),
        (image_bytes("JPEG", (64, 64))[:-200], "corrupt or truncated JPEG"),
        (image_bytes("JPEG", (64, 64))[:200], "or is corrupt"),  # cut inside its header
    ],
    ids=["garbage", "bmp", "truncated-png", "truncated-jpeg", "jpeg-header"],
)
def test_corrupt_or_unsupported_bytes_are_refused(data: bytes, match: str) -> None:
    _refused(load_image, data, ImageLimits(), FIELD, match=match)


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_image_pixels must be >= 1"):
        ImageLimits(max_image_pixels=0)
    with pytest.raises(ValueError, match="fetch_timeout"):
        ImageLimits(fetch_timeout=0)


def test_raw_bytes_become_a_data_url_of_their_format() -> None:
    data = image_bytes("WEBP")
    part = ImagePart.of(data)
    assert part.image_url.url == to_data_url(data) == data_url(data, "image/webp")
    with pytest.raises(InvalidRequestError, match="not a PNG"):
        ImagePart.of(b"nope")


async def test_too_many_images_name_the_first_past_the_limit() -> None:
    url = data_url(image_bytes())
    messages = [
        ChatMessage(role="user", content=[image_part(url), {"type": "text", "text": "a"}, image_part(url)]),
        ChatMessage(role="user", content=[image_part(url)]),
    ]
    assert len(await load_message_images(messages, ImageLimits(max_images=3), None)) == 3
    with pytest.raises(InvalidRequestError, match="has 3 images; the limit is 2 \\(max_images\\)") as info:
        await load_message_images(messages, ImageLimits(max_images=2), None)
    assert info.value.param == "messages.1.content.0"


async def test_remote_urls_are_refused_without_an_allow_list() -> None:
    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, image_part("http://127.0.0.1:1/cat.png")])]
    with pytest.raises(InvalidRequestError, match="remote image URLs are off") as info:
        await load_message_images(messages, ImageLimits(), None)
    assert info.value.param == "messages.0.content.1.image_url"
    with pytest.raises(InvalidRequestError, match="not in --allowed-media-domains"):
        await fetch_url("http://example.com/cat.png", ImageLimits(allowed_media_domains=("images.example.org",)), FIELD)
    with pytest.raises(InvalidRequestError, match="data URL or an http"):
        await fetch_url("file:///etc/passwd", ImageLimits(allowed_media_domains=("localhost",)), FIELD)


async def test_allowed_hosts_are_fetched_within_the_limits() -> None:
    png = image_bytes("PNG", (32, 32))

    async def cat(request: web.Request) -> web.Response:
        return web.Response(body=png, content_type="image/png")

    async def away(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://example.com/cat.png")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.Response(body=png, content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", cat)
    app.router.add_get("/away.png", away)
    app.router.add_get("/slow.png", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        await _fetches(base)
    finally:
        await runner.cleanup()


async def _fetches(base: str) -> None:
    png = image_bytes("PNG", (32, 32))
    limits = ImageLimits(allowed_media_domains=("127.0.0.1",))
    data, mime = await fetch_url(f"{base}/cat.png", limits, FIELD)
    assert data == png and mime == "image/png"
    with pytest.raises(InvalidRequestError, match="max_image_bytes") as info:
        await fetch_url(f"{base}/cat.png", ImageLimits(allowed_media_domains=("127.0.0.1",), max_image_bytes=40), FIELD)
    assert info.value.param == FIELD
    with pytest.raises(InvalidRequestError, match="HTTP 302"):  # redirects are not followed
        await fetch_url(f"{base}/away.png", limits, FIELD)
    with pytest.raises(InvalidRequestError, match=r"longer than 0.2s \(fetch_timeout\)"):
        await fetch_url(f"{base}/slow.png", ImageLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout=0.2), FIELD)
