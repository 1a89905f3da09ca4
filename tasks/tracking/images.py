"""The prompt's images in the samples tables (docs/tracking.md, 'Images in the samples tables').

A row carries its prompt's images under ``images``: encoded bytes (:func:`sample_rows`, the
``Sample``'s own) or base64 thumbnails (an evaluation's rows, :mod:`rl_core.evaluation`).
:func:`with_images` turns that into three columns, and only in a table where some row has
an image (a text-only table stays as it was):

- ``image``: the first image, as the cell MLflow's UI draws as a picture
  (``{"type": "image", "filepath", "compressed_filepath"}``, the form ``MlflowClient.log_table``
  writes for a PIL image); a row without images gets a grey placeholder (the UI takes a
  column as images by its first row and cannot draw an empty cell).
- ``images``: how many images the prompt has.
- ``image_files``: the run-relative paths of its first :data:`MAX_ROW_IMAGES` images.

Each image is a file beside the table: ``samples/step-000010.json`` has its images in
``samples/step-000010/<uid>-<i>.png`` (``.jpg`` for a JPEG), thumbnails of at most
:data:`THUMBNAIL_SIDE` pixels on the long side. Until the table is sent a cell holds a
:class:`TableImage` (the original bytes, then the thumbnail, made off the training loop's
thread); :func:`send_table` uploads the files, then logs the table.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_core.thumbnails import MAX_ROW_IMAGES, THUMBNAIL_SIDE, image_format, thumbnail
from tasks.tracking.handle import warn

__all__ = ["MAX_ROW_IMAGES", "THUMBNAIL_SIDE", "TableImage", "has_images", "image_cell",
           "portable", "prepare_in_background", "restore", "send_table", "with_images"]

ROW_KEY = "images"  # a row's images, before with_images
IMAGE, COUNT, FILES = "image", "images", "image_files"  # the columns after
PLACEHOLDER = "no-image.png"  # in the table's folder, for rows without images
_FILE_TYPE = "image-file"  # a TableImage in the unsent-metrics file
_UNSAFE = re.compile(r"[^\w.-]+")
_MAKING = threading.Lock()  # one thumbnail at a time (the sender, the prepare thread)


class TableImage:
    """One image file of a table not yet sent: ``path`` (run-relative) receives a thumbnail of
    ``data`` (an encoded image; empty: the placeholder). The thumbnail is made once, and the
    original bytes are let go then."""

    __slots__ = ("_data", "_file", "path")

    def __init__(self, path: str, data: bytes) -> None:
        self.path, self._data, self._file = path, data, None

    def __repr__(self) -> str:
        return f"TableImage({self.path!r})"

    def file_bytes(self) -> bytes:
        """The file's content: the thumbnail (or the placeholder, also for bytes that do not
        decode as an image)."""
        with _MAKING:
            if self._file is None:
                fmt = "jpeg" if self.path.endswith(".jpg") else "png"
                try:
                    self._file = thumbnail(self._data) if self._data else _placeholder(fmt)
                except Exception as exc:  # Pillow raises several kinds
                    warn(f"tracking: image {self.path} does not decode ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); a placeholder is logged instead")
                    self._file = _placeholder(fmt)
                self._data = b""
            return self._file


def _placeholder(fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB" if fmt == "jpeg" else "L", (64, 64), 224).save(out, format=fmt)
    return out.getvalue()


def image_cell(path: str) -> dict[str, str]:
    """The table cell MLflow's UI shows as the image at ``path`` (its thumbnail is the file
    itself: ours are small already)."""
    return {"type": "image", "filepath": path, "compressed_filepath": path}


def _images_of(row: Mapping[str, Any]) -> Sequence[Any] | None:
    """A row's images (bytes, or base64 text); None when it has none. A dataset's own
    ``images`` column reaches a row as text, never as a list, and is left alone."""
    value = row.get(ROW_KEY)
    return value if isinstance(value, list | tuple) and value else None


def has_images(rows: Sequence[Mapping[str, Any]]) -> bool:
    return any(_images_of(r) for r in rows)


def _as_bytes(item: Any) -> bytes:  # noqa: ANN401 - bytes or base64 text
    if isinstance(item, str):
        try:
            return base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            return b""
    return bytes(item)


def with_images(rows: Sequence[Mapping[str, Any]], folder: str) -> list[dict[str, Any]]:
    """``rows`` with their images as the ``image``, ``images`` and ``image_files`` columns
    (module docstring), the files in ``folder`` (the table's path without ``.json``); rows
    unchanged when none has an image."""
    if not has_images(rows):
        return [{k: v for k, v in r.items() if not (k == ROW_KEY and isinstance(v, list | tuple))}
                for r in rows]
    folder, taken = folder.rstrip("/"), set()
    placeholder = TableImage(f"{folder}/{PLACEHOLDER}", b"")
    out = []
    for n, row in enumerate(rows):
        images = [_as_bytes(x) for x in _images_of(row) or ()]
        stem = _UNSAFE.sub("_", str(row.get("uid") or f"row-{n:03d}")).strip("._")[:96] or "row"
        if stem in taken:
            stem = f"{stem}-{n:03d}"
        taken.add(stem)
        files = [TableImage(f"{folder}/{stem}-{i}.{'jpg' if image_format(b) == 'jpeg' else 'png'}",
                            b) for i, b in enumerate(images[:MAX_ROW_IMAGES])]
        rest = {k: v for k, v in row.items() if k != ROW_KEY}  # ROW_KEY: the count now
        head = ["uid"] if "uid" in rest else []  # the picture right after the uid, or first
        out.append({**{k: rest[k] for k in head}, IMAGE: files[0] if files else placeholder,
                    **{k: v for k, v in rest.items() if k not in head},
                    COUNT: len(images), FILES: files})
    return out


def _image_cells(columns: Mapping[str, list[Any]]) -> Iterator[TableImage]:
    for cells in columns.values():
        for cell in cells:
            if isinstance(cell, TableImage):
                yield cell
            elif isinstance(cell, list):
                yield from (x for x in cell if isinstance(x, TableImage))


def prepare_in_background(columns: Mapping[str, list[Any]]) -> threading.Thread | None:
    """Make the thumbnails of a queued table on a short-lived daemon thread, so that the
    original images are let go at once (not when the table is sent, maybe after an outage);
    None when the table has no images."""
    images = list({i.path: i for i in _image_cells(columns)}.values())
    if not images:
        return None
    thread = threading.Thread(target=lambda: [i.file_bytes() for i in images],
                              name="grpoflow-mlflow-thumbnails", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had: the sender makes them when it sends
        return None
    return thread


def _resolved(columns: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    """The columns as they are logged: image cells, lists of paths."""
    def cell(c: Any) -> Any:  # noqa: ANN401
        if isinstance(c, TableImage):
            return image_cell(c.path)
        if isinstance(c, list) and c and all(isinstance(x, TableImage) for x in c):
            return [x.path for x in c]
        return c

    return {k: [cell(c) for c in cells] for k, cells in columns.items()}


def send_table(client: Any, run_id: str, artifact_file: str,  # noqa: ANN401 - MlflowClient
               columns: Mapping[str, list[Any]]) -> None:
    """Upload the table's image files (if any), then log the table (``log_table``). Sending
    again overwrites the same files: a retry after a failure leaves no strays."""
    images = {i.path: i for i in _image_cells(columns)}
    if images:
        with tempfile.TemporaryDirectory(prefix="grpoflow-table-images-") as tmp:
            for path, image in images.items():
                local = Path(tmp, *path.split("/"))
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(image.file_bytes())
            client.log_artifacts(run_id, tmp)
    client.log_table(run_id, _resolved(columns), artifact_file)


def portable(columns: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    """The columns as JSON (the unsent-metrics file): each image as its thumbnail, base64."""
    def cell(c: Any) -> Any:  # noqa: ANN401
        if isinstance(c, TableImage):
            return {"type": _FILE_TYPE, "path": c.path,
                    "base64": base64.b64encode(c.file_bytes()).decode("ascii")}
        if isinstance(c, list) and any(isinstance(x, TableImage) for x in c):
            return [cell(x) for x in c]
        return c

    return {k: [cell(c) for c in cells] for k, cells in columns.items()}


def restore(columns: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    """:func:`portable`'s inverse (shared images become one object again)."""
    made: dict[str, TableImage] = {}

    def cell(c: Any) -> Any:  # noqa: ANN401
        if isinstance(c, dict) and c.get("type") == _FILE_TYPE and "path" in c:
            if c["path"] not in made:
                made[c["path"]] = TableImage(c["path"], _as_bytes(c.get("base64") or ""))
            return made[c["path"]]
        if isinstance(c, list):
            return [cell(x) for x in c]
        return c

    return {k: [cell(c) for c in cells] for k, cells in columns.items()}
