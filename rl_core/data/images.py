"""Images in the data: one reference in any accepted form -> checked, encoded bytes.

A row's images come from its ``data.image_field`` column (one image or a list) and from the
image parts of its chat messages (``{"type": "image", "image": ...}`` or OpenAI's
``{"type": "image_url", "image_url": {"url": ...}}``). Each may be a local path, an ``s3://``
URI, raw bytes, a ``datasets`` Image cell (``{"bytes", "path"}``), a base64 ``data:image/...``
URL or a PIL image. :func:`load_image` turns it into the image file's bytes, decoded once to
check it (a truncated file, a zero or huge size, an aspect ratio past 200:1 are refused, the
row named by the caller); the processor resizes it later by its own rule (:func:`smart_resize`,
Qwen2-VL's). Records keep the bytes, so the snapshots and their digests cover the pixels.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ImageError", "ImageSpec", "image_digest", "image_spec", "load_image", "smart_resize"]

MAX_ASPECT_RATIO = 200  # Qwen2-VL's processor refuses a longer side over 200x the shorter


class ImageError(ValueError):
    """An image reference that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ImageSpec:
    """How a row's images are read and checked (``data.image_*``). ``min_pixels`` and
    ``max_pixels`` bound the size the processor resizes to; ``max_input_pixels`` refuses a
    bigger input outright (a decompression bomb or a mistake); ``base_dir`` resolves a relative
    path (the data file's folder); ``read_uri`` reads an ``s3://`` object's bytes."""

    field: str | None = None
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_input_pixels: int = 50_000_000
    base_dir: Path | None = None
    read_uri: Callable[[str], bytes] | None = None


def image_spec(data: Any) -> ImageSpec:  # noqa: ANN401 - a SourceConfig (data or SFT's data)
    """The :class:`ImageSpec` of a config's ``data`` section (``data.image_*``)."""
    return ImageSpec(data.image_field, data.image_min_pixels, data.image_max_pixels,
                     data.image_max_input_pixels)


def image_digest(data: bytes) -> str:
    """sha256 hex of an image's bytes (what the record digests cover)."""
    return hashlib.sha256(data).hexdigest()


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The (height, width) Qwen2-VL's processor resizes an image to: sides multiples of
    ``factor``, the area within [min_pixels, max_pixels], the aspect ratio kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 is over "
                         f"{MAX_ASPECT_RATIO}:1 (the processor refuses it); crop or pad it")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _bytes_of(value: Any, spec: ImageSpec) -> bytes:  # noqa: ANN401 - any accepted form
    """The encoded image a reference stands for (no decoding yet)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, dict):  # a `datasets` Image cell, or an OpenAI image_url part's value
        if value.get("bytes") is not None:
            return _bytes_of(value["bytes"], spec)
        if value.get("url") or value.get("path"):
            return _bytes_of(value.get("url") or value.get("path"), spec)
        raise ImageError(f"an image object needs 'bytes', 'path' or 'url', got keys {sorted(value)}")
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image
        out = io.BytesIO()
        value.save(out, format="PNG")
        return out.getvalue()
    if not isinstance(value, str) or not value.strip():
        raise ImageError(f"an image must be a path, s3:// URI, data URL, bytes or "
                         f"{{'bytes'|'path': ...}}, got {type(value).__name__}")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.startswith("data:image/") or ";base64" not in head:
            raise ImageError(f"a data URL must be 'data:image/<type>;base64,<data>', got {head[:40]!r}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"the data URL's base64 does not decode ({exc})") from exc
    if value.startswith("s3://"):
        if spec.read_uri is None:
            raise ImageError(f"{value}: S3 images need a storage reader here")
        try:
            return spec.read_uri(value)
        except Exception as exc:  # noqa: BLE001 - StorageError, OSError: the row says which
            raise ImageError(str(exc)) from exc
    if "://" in value:
        raise ImageError(f"{value[:80]}: images are read from files, s3:// or data URLs, not "
                         "over the web; download them first")
    path = Path(value).expanduser()
    if not path.is_absolute() and spec.base_dir is not None:
        path = spec.base_dir / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"{path}: {exc.strerror or exc} (a relative path is read from the "
                         "data file's folder)") from exc


def load_image(value: Any, spec: ImageSpec) -> bytes:  # noqa: ANN401 - any accepted form
    """One image reference as its encoded bytes, decoded once to check it; raises
    :class:`ImageError` naming what is wrong."""
    from PIL import Image

    data = _bytes_of(value, spec)
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            if width < 1 or height < 1:
                raise ImageError(f"the image is {width}x{height} pixels")
            if width * height > spec.max_input_pixels:
                raise ImageError(f"the image is {width}x{height} = {width * height:,} pixels, "
                                 f"over data.image_max_input_pixels={spec.max_input_pixels:,}; "
                                 "downscale it or raise the bound")
            im.load()  # decodes every pixel: a truncated file fails here
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for a bad file
        raise ImageError(f"the image does not decode ({type(exc).__name__}: {exc})") from exc
    smart_resize(height, width, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    return data
