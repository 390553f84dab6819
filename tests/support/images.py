"""Test images: small real ones in each format, and the bad inputs the intake must refuse."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

from PIL import Image


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (24, 16), color: tuple[int, int, int] = (200, 30, 90), mode: str = "RGB") -> bytes:
    """An image of one colour with a diagonal line, encoded as ``fmt``."""
    image = Image.new(mode, size, color if mode == "RGB" else (*color, 128))
    for i in range(min(size)):
        image.putpixel((i, i), (0, 0, 0) if mode == "RGB" else (0, 0, 0, 255))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def noise_png(size: tuple[int, int], seed: int = 0) -> bytes:
    """A PNG of seeded random pixels: about 3 bytes a pixel, as incompressible as images get."""
    out = io.BytesIO()
    Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3)).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_declaring(width: int, height: int) -> bytes:
    """A small valid PNG whose header declares ``width`` x ``height`` (a decompression bomb's shape)."""
    data = bytearray(image_bytes("PNG", (8, 8)))
    ihdr = 8  # after the signature: length (4), b"IHDR" (4), then width and height
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4 : ihdr + 8 + 13])) & 0xFFFFFFFF
    data[ihdr + 8 + 13 : ihdr + 8 + 17] = struct.pack(">I", crc)
    return bytes(data)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}
