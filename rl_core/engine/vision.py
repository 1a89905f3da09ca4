"""Images on the embedded engine's requests: SGLang's ``image_data`` forms to checked bytes, and
a request's pixel inputs and expanded image pads (docs/vlm.md, "The engine").

SGLang's ``image_data`` is one image or a list (a list per prompt in a batch); each image may
be a base64 string, a ``data:image/...;base64,`` URL, a local path or ``file://`` URL, an
``http(s)://`` URL (fetched, within :data:`FETCH_TIMEOUT_S`), raw bytes, or ``{"url": ...}``.
SGLang's precomputed forms (``{"format": "processor_output" | "precomputed_embedding"}``) are
refused by name. Each image is decoded and checked (:func:`rl_core.data.images.load_image`);
a bad one fails its request with a 400 that says which image and why, never dropped.
"""

from __future__ import annotations

import base64
import binascii
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_core.data.images import ImageError, ImageSpec, load_image
from rl_core.engine.control import EngineRequestError
from rl_core.models.vlm import ImageInputs, VisionProcessor

__all__ = ["FETCH_TIMEOUT_S", "RequestImages", "image_bytes", "image_list"]

FETCH_TIMEOUT_S = 30.0
# The engine checks decodability and a size bound; the processor resizes by its own rules.
_SPEC = ImageSpec(min_pixels=1, max_pixels=1 << 62)


def image_list(value: Any) -> list[Any]:  # noqa: ANN401 - SGLang's image_data for one prompt
    """One prompt's ``image_data`` as a list (None: no images)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def image_bytes(item: Any) -> bytes:  # noqa: ANN401 - any of SGLang's forms
    """One ``image_data`` entry as encoded image bytes, decoded once to check it."""
    return load_image(_source(item), _SPEC)


def _source(item: Any) -> Any:  # noqa: ANN401 - any of SGLang's forms
    """What :func:`~rl_core.data.images.load_image` reads for an entry: its bytes (fetched,
    read or base64-decoded here), or a data URL or PIL image as given."""
    if isinstance(item, dict):
        if item.get("format") in ("processor_output", "precomputed_embedding"):
            raise ImageError(f"image_data format {item['format']!r} is not supported by the "
                             "embedded engine: send the image itself (base64, data URL, path)")
        url = item.get("url") or (item.get("image_url") or {}).get("url") or item.get("image")
        if url is None:
            raise ImageError(f"an image object needs 'url', got keys {sorted(item)}")
        return _source(url)
    if isinstance(item, bytes | bytearray) or hasattr(item, "save"):
        return item  # bytes, or a PIL image (engine in-process)
    if not isinstance(item, str) or not item:
        raise ImageError(f"an image must be a base64 string, data URL, path or URL, got "
                         f"{type(item).__name__}")
    if item.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(item, timeout=FETCH_TIMEOUT_S) as resp:  # noqa: S310
                return resp.read()
        except (OSError, ValueError) as exc:
            raise ImageError(f"{item[:120]}: could not fetch the image within "
                             f"{FETCH_TIMEOUT_S:.0f} s ({exc})") from exc
    if item.startswith("data:"):
        return item
    path = item.removeprefix("file://")
    if item.startswith("file://") or _is_file(path):
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ImageError(f"{path}: {exc.strerror or exc}") from exc
    try:  # SGLang's last resort: the string is the image's base64
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{item[:60]!r} is not a data URL, an existing file, a URL or base64 "
                         "image data") from exc


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a base64 string too long or odd for a file name
        return False


class RequestImages:
    """The engine's side of a request's images: decode, check, process, expand the pads."""

    def __init__(self, processor: VisionProcessor | None, model_path: str) -> None:
        self.processor, self.model_path = processor, model_path

    def prepare(self, input_ids: list[int], image_data: Sequence[Any]
                ) -> tuple[list[int], ImageInputs | None]:
        """(input_ids with expanded pads, pixel inputs) of one prompt; EngineRequestError (a
        400) naming the image when one is bad or the placeholders do not match."""
        if self.processor is None:
            if image_data:
                raise EngineRequestError(f"image_data was given but {self.model_path} is a "
                                         "text model (no vision tower)")
            return input_ids, None
        encoded = []
        for k, item in enumerate(image_data):
            try:
                encoded.append(image_bytes(item))
            except ImageError as exc:
                raise EngineRequestError(f"image_data[{k}]: {exc}") from exc
        images = self.processor.process(encoded) if encoded else None
        try:
            return self.processor.expand(input_ids, images), images
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from exc
