"""Small copies of a prompt's images for the sample tables (MLflow, the evaluation's rows):
at most :data:`THUMBNAIL_SIDE` pixels on the long side, JPEG for a JPEG, PNG for anything
else, the EXIF rotation applied. Pillow only; a JPEG is decoded at a reduced scale, so a
thumbnail of a large photo costs a few milliseconds.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

__all__ = ["MAX_ROW_IMAGES", "THUMBNAIL_SIDE", "image_format", "thumbnail", "thumbnails_b64"]

THUMBNAIL_SIDE = 256  # pixels, the long side
MAX_ROW_IMAGES = 8  # thumbnails kept per table row (the row still counts them all)
_JPEG_MAGIC = b"\xff\xd8\xff"


def image_format(data: bytes) -> str:
    """``"jpeg"`` for JPEG bytes, else ``"png"``: the format a thumbnail of ``data`` has."""
    return "jpeg" if data[:3] == _JPEG_MAGIC else "png"


def thumbnail(data: bytes, side: int = THUMBNAIL_SIDE) -> bytes:
    """``data`` (an encoded image) scaled to fit ``side`` x ``side``, encoded as
    :func:`image_format` says; ``data`` itself when it already fits and needs no change.
    Raises what Pillow raises for bytes that are not an image (``OSError``, ...)."""
    from PIL import Image, ImageOps

    fmt = image_format(data)
    with Image.open(io.BytesIO(data)) as im:
        rotated = im.getexif().get(0x0112, 1) not in (1, None)  # EXIF orientation
        if max(im.size) <= side and im.format == fmt.upper() and not rotated:
            return data
        im.draft(None, (side, side))  # JPEG: decode at 1/2, 1/4 or 1/8 scale, still >= side
        small = ImageOps.exif_transpose(im)
        small.thumbnail((side, side))
    if small.mode not in (("L", "RGB") if fmt == "jpeg" else ("1", "L", "LA", "P", "RGB", "RGBA")):
        alpha = fmt == "png" and ("A" in small.mode or "transparency" in small.info)
        small = small.convert("RGBA" if alpha else "RGB")
    out = io.BytesIO()
    small.save(out, format=fmt, **({"quality": 85} if fmt == "jpeg" else {"optimize": True}))
    return out.getvalue()


def thumbnails_b64(images: Sequence[bytes], limit: int = MAX_ROW_IMAGES) -> list[str]:
    """The first ``limit`` images as base64 thumbnails (JSON-safe, for rows that are written
    as JSON); one that does not decode is left out."""
    out = []
    for data in list(images)[:limit]:
        try:
            out.append(base64.b64encode(thumbnail(bytes(data))).decode("ascii"))
        except Exception:  # noqa: BLE001, S112 - Pillow raises several kinds; a row needs none
            continue
    return out
