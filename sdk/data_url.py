"""Raw image bytes as a base64 ``data:`` URL, their format read from the header: how an ``ImagePart`` is made of bytes.

The image formats the SDK takes live here too (``sdk.images`` checks images against them), so
building a request part needs neither the intake's limits nor Pillow until bytes come without a
MIME type.
"""

from __future__ import annotations

import base64
import io
import warnings

from sdk.errors import InvalidRequestError

# Pillow's format name -> the MIME type a data URL declares for it
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


def to_data_url(data: bytes, mime_type: str | None = None) -> str:
    """Raw image bytes as a base64 data URL; ``mime_type`` None = read from the bytes' header.

    Raises:
        InvalidRequestError: ``mime_type`` None and the bytes are not a PNG, JPEG, WebP or GIF image.
    """
    if mime_type is None:
        from PIL import Image, UnidentifiedImageError  # NOTE: Pillow loads only for callers with images

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                fmt = Image.open(io.BytesIO(data), formats=list(FORMATS)).format
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            raise InvalidRequestError("image bytes are not a PNG, JPEG, WebP or GIF image", param="image") from None
        mime_type = FORMATS[fmt]
    return f"data:{mime_type};base64,{base64.b64encode(data).decode('ascii')}"
