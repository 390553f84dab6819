"""Image intake: an ``image_url`` part (a data URL, or an allow-listed remote URL) or raw bytes -> a checked image.

Every check runs before the pixels are decoded, cheapest first: the number of images, the
encoded size (a data URL's is known from its length, before base64 is decoded), the real
format read from the bytes' header (PNG, JPEG, WebP or GIF, and equal to the declared MIME
type), and the pixel count from the header, so a decompression bomb (a small file that
declares a huge canvas) is refused without decoding it. Only then are the pixels decoded
(a corrupt or truncated image is refused) and converted to RGB.

Remote URLs are fetched only from the hosts of ``ImageLimits.allowed_media_domains`` (vLLM's
``--allowed-media-domains``), never by default, with the same size limit and a timeout, and
without following redirects. Failures are ``InvalidRequestError``s naming the field (e.g.
``messages.2.content.1.image_url``) and the limit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import urllib.parse
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from engine.multimodal import image_hash
from sdk.data_url import FORMATS
from sdk.errors import InvalidRequestError
from sdk.prompt_worker import PROMPT_WORKER

if TYPE_CHECKING:
    from sdk.types import ChatMessage

_MIME_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-png": "image/png"}
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[^,;]*)*),", re.ASCII)

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_BYTES = 10 << 20
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_FETCH_TIMEOUT = 5.0  # seconds, vLLM's VLLM_IMAGE_FETCH_TIMEOUT


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request's images may be; ``paged serve``'s image flags set them.

    Raises:
        ValueError: a limit below 1 (0 images is allowed: it refuses every image), naming it.
    """

    max_images: int = DEFAULT_MAX_IMAGES
    """Images per request (vLLM's ``--limit-mm-per-prompt '{"image": N}'``)."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Bytes of one encoded image (after base64 decoding)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Width times height of one image, read from its header before decoding."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts remote ``http(s)`` image URLs may name; empty = remote URLs are refused."""
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    """Seconds to fetch one remote image."""

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"max_images must be >= 0, got {self.max_images}")
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.fetch_timeout > 0:
            raise ValueError(f"fetch_timeout must be > 0, got {self.fetch_timeout}")
        object.__setattr__(self, "allowed_media_domains", tuple(d.lower().rstrip(".") for d in self.allowed_media_domains))


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What an audit record says of an image: never its bytes."""

    hash: str
    """``engine.multimodal.image_hash`` of its pixels: the key the prefix cache and the encoder cache know it by
    (equal for equal pixels, whatever file they came in)."""
    num_bytes: int
    width: int
    height: int
    mime_type: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LoadedImage:
    """A checked image: its decoded pixels (a ``PIL.Image.Image`` in RGB) and its ``ImageInfo``."""

    image: Any
    info: ImageInfo


async def load_message_images(messages: Sequence[ChatMessage], limits: ImageLimits, tenant: str | None) -> list[LoadedImage]:
    """The images of ``messages``' image parts, in order, each checked and decoded (on the prompt worker's threads).

    Raises:
        InvalidRequestError: more than ``max_images`` (naming the first part past it), or an
            image refused by ``decode_data_url`` / ``fetch_url`` / ``load_image`` (naming its part's
            ``image_url``).
    """
    parts = [(f"messages.{i}.content.{j}", part) for i, m in enumerate(messages) for j, part in m.image_parts]
    if len(parts) > limits.max_images:
        raise InvalidRequestError.about(
            parts[limits.max_images][0], f"the request has {len(parts)} images; the limit is {limits.max_images} (max_images)"
        )
    loaded = []
    for where, part in parts:
        field = f"{where}.image_url"
        url = part.image_url.url
        if url.startswith("data:"):
            data, mime = await PROMPT_WORKER.run(tenant, decode_data_url, url, limits, field)
        else:
            data, mime = await fetch_url(url, limits, field)
        loaded.append(await PROMPT_WORKER.run(tenant, load_image, data, limits, field, mime))
    return loaded


def decode_data_url(url: str, limits: ImageLimits, field: str) -> tuple[bytes, str]:
    """The bytes and declared MIME type of a base64 ``data:`` URL, its size checked before it is decoded.

    Raises:
        InvalidRequestError: not a base64 image data URL, past ``max_image_bytes``, or not valid base64.
    """
    match = _DATA_URL.match(url)
    if match is None or "base64" not in match["params"].lower().split(";"):
        raise InvalidRequestError.about(field, "must be a base64 data URL (data:image/png;base64,...)")
    mime = (match["mime"] or "").lower()
    if not mime.startswith("image/"):
        raise InvalidRequestError.about(field, f"declares {mime or 'no'} MIME type; images are image/*")
    payload = url[match.end() :]
    approx = len(payload) * 3 // 4 - payload[-2:].count("=")
    if approx > limits.max_image_bytes:
        raise _too_big(field, approx, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError.about(field, "is not valid base64") from None
    return data, _MIME_ALIASES.get(mime, mime)


async def fetch_url(url: str, limits: ImageLimits, field: str) -> tuple[bytes, str | None]:
    """The bytes and served MIME type of a remote image on an allowed host, within the size and time limits.

    Raises:
        InvalidRequestError: not http(s), a host not in ``allowed_media_domains`` (every host
            when it is empty), a redirect, an error status, past ``max_image_bytes`` or ``fetch_timeout``.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InvalidRequestError.about(field, "must be a data URL or an http(s) URL")
    if not limits.allowed_media_domains:
        raise InvalidRequestError.about(
            field, "remote image URLs are off on this server (--allowed-media-domains); send a base64 data URL"
        )
    if parsed.hostname.lower().rstrip(".") not in limits.allowed_media_domains:
        raise InvalidRequestError.about(field, f"the host {parsed.hostname} is not in --allowed-media-domains")
    import aiohttp  # NOTE: only servers that fetch load it here

    try:
        async with asyncio.timeout(limits.fetch_timeout):
            async with aiohttp.ClientSession() as session, session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise InvalidRequestError.about(field, f"fetching it answered HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > limits.max_image_bytes:
                    raise _too_big(field, resp.content_length, limits)
                chunks, size = [], 0
                async for chunk in resp.content.iter_chunked(64 << 10):
                    size += len(chunk)
                    if size > limits.max_image_bytes:
                        raise _too_big(field, size, limits)
                    chunks.append(chunk)
                data = b"".join(chunks)
                mime = resp.content_type.lower() if resp.content_type else None
    except TimeoutError:
        raise InvalidRequestError.about(field, f"fetching it took longer than {limits.fetch_timeout}s (fetch_timeout)") from None
    except aiohttp.ClientError as exc:
        raise InvalidRequestError.about(field, f"could not be fetched: {type(exc).__name__}") from None
    return data, None if mime in (None, "application/octet-stream") else _MIME_ALIASES.get(mime, mime)


def load_image(data: bytes, limits: ImageLimits, field: str, declared_mime: str | None = None) -> LoadedImage:
    """Check ``data`` against ``limits`` and decode it (call off the event loop: decoding takes milliseconds).

    Args:
        data: the encoded image.
        limits: the size and pixel limits.
        field: the request field it came from, for errors.
        declared_mime: the MIME type the sender declared; it must be the bytes' real format.

    Raises:
        InvalidRequestError: past ``max_image_bytes`` or ``max_image_pixels``, not a PNG/JPEG/WebP/GIF image,
            a declared MIME type that is not its format, or corrupt (truncated) data.
    """
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise _too_big(field, len(data), limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # NOTE: max_image_pixels is checked below
            image = Image.open(io.BytesIO(data), formats=list(FORMATS))  # reads the header only
    except Image.DecompressionBombError:
        raise InvalidRequestError.about(field, f"declares more pixels than the limit of {limits.max_image_pixels} (max_image_pixels)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise InvalidRequestError.about(field, "is not a PNG, JPEG, WebP or GIF image, or is corrupt") from None
    mime = FORMATS[image.format]
    if declared_mime is not None and declared_mime != mime:
        raise InvalidRequestError.about(field, f"declares {declared_mime} but its bytes are {mime}")
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise InvalidRequestError.about(
            field, f"is {width}x{height} = {width * height} pixels; the limit is {limits.max_image_pixels} (max_image_pixels)"
        )
    try:
        image.load()
        rgb = image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError):
        raise InvalidRequestError.about(field, f"is a corrupt or truncated {mime.removeprefix('image/').upper()} image") from None
    return LoadedImage(rgb, ImageInfo(image_hash(rgb), len(data), width, height, mime))


async def data_url_infos(messages: Sequence[ChatMessage]) -> list[ImageInfo]:
    """The ``ImageInfo`` of each data-URL image of ``messages`` that passes the default ``ImageLimits``.

    What a remote client's audit record says of the images a server checks (with its own limits)
    and serves; an image past the defaults, or a remote URL, has none here.
    """
    infos = []
    for i, message in enumerate(messages):
        for j, part in message.image_parts:
            if not part.image_url.url.startswith("data:"):
                continue
            try:
                field = f"messages.{i}.content.{j}.image_url"
                data, mime = decode_data_url(part.image_url.url, ImageLimits(), field)
                infos.append((await PROMPT_WORKER.run(None, load_image, data, ImageLimits(), field, mime)).info)
            except InvalidRequestError:
                continue
    return infos


def _too_big(field: str, num_bytes: int, limits: ImageLimits) -> InvalidRequestError:
    return InvalidRequestError.about(field, f"is {num_bytes} bytes; the limit is {limits.max_image_bytes} (max_image_bytes)")
