"""Load records from wherever they live, and write/read our own Parquet snapshots.

:func:`load_records` reads JSONL/JSON, CSV, Parquet, Arrow, a ``datasets.save_to_disk``
directory, a hub dataset name or, through ``_SCHEME_READERS``, ``s3://`` objects and prefixes
(downloaded once into ``<cache_dir>/s3-data/``; docs/data-and-rewards.md). Every column of a
row is kept (it travels with the samples to the reward). Never imports prefect or mlflow;
never downloads what was not named explicitly; never crashes on a bad row: bad rows are
reported by number (:class:`~rl_core.data.records.DataValidationError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rl_core import storage
from rl_core.data import records as _records
from rl_core.data.images import ImageSpec
from rl_core.data.records import (
    AnswerCheck,
    BadRow,
    DataValidationError,
    Record,
    validate_numbered_rows,
)
from rl_core.secrets import redact

__all__ = ["SourceRequest", "dispatch_source", "load_records", "read_parquet", "source_image_spec",
           "write_parquet"]

log = logging.getLogger(__name__)

DIGEST_METADATA_KEY = b"grpoflow.records_digest"
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PATH_SUFFIXES = (*_JSON_SUFFIXES, ".parquet", ".arrow", ".csv")
_SAVE_TO_DISK_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

Row = Mapping[str, Any] | BadRow


@dataclass
class RowSource:
    """Rows read from one source, before validation."""

    name: str
    rows: Iterable[tuple[int, Row]]
    row_label: str = "row"
    note: str | None = None


@dataclass(frozen=True)
class SourceRequest:
    split: str
    subset: str | None
    required: tuple[str, ...]  # question and answer fields
    cache_dir: Path | None = None  # where remote sources are downloaded


_S3_DATA_FILES = (*_JSON_SUFFIXES, ".parquet", ".arrow", ".csv")


def _read_s3(uri: str, request: SourceRequest) -> RowSource:
    """An object (``.jsonl``/``.json``/``.parquet``) or a prefix, read through a local copy in
    ``<cache_dir>/s3-data/<digest of URI, ETags, sizes>/`` (only changed objects download again)."""
    cache = (request.cache_dir or storage.default_cache_dir()) / "s3-data"
    try:
        try:
            obj = storage.stat(uri)
        except storage.NotFound:
            obj = None
        if obj is not None:
            suffix = Path(obj.name).suffix.lower()
            if suffix not in _S3_DATA_FILES:
                raise _unsupported(uri, suffix)
            local = cache / _cache_key(uri, [(obj.name, obj.size, obj.etag)]) / obj.name
            if not (local.is_file() and local.stat().st_size == obj.size):
                storage.download_file(uri, local)
            return replace(_read_file(local, request), name=uri)
        if not (listing := [f for f in storage.list_files(uri) if _is_data_file(f.name)]):
            raise FileNotFoundError(
                f"data source {uri!r} not found: no such object, and no data files "
                f"({', '.join(_S3_DATA_FILES)}) under that prefix")
        local = cache / _cache_key(uri, [(f.name, f.size, f.etag) for f in listing])
        if not local.is_dir():
            storage.download_dir(uri, local, require_manifest=False, include=_is_data_file)
    except storage.StorageError as exc:
        raise type(exc)(redact(f"data source {uri}: {exc}")) from None
    try:
        read = _read_dir(local, request)
    except (FileNotFoundError, ValueError) as exc:
        if type(exc) not in (FileNotFoundError, ValueError):
            raise
        raise type(exc)(str(exc).replace(str(local), uri)) from None  # name the S3 URI
    return replace(read, name=read.name.replace(str(local), uri))


def _is_data_file(name: str) -> bool:
    return (name.lower().endswith(_S3_DATA_FILES)
            or PurePosixPath(name).name in _SAVE_TO_DISK_MARKERS)


def _cache_key(uri: str, files: Sequence[tuple[str, int, str]]) -> str:
    blob = json.dumps([uri, sorted(files)], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# scheme -> reader(source, request). Register a new scheme (gs://, https://) here.
_SCHEME_READERS: dict[str, Callable[[str, SourceRequest], RowSource]] = {
    "s3": _read_s3, "file": lambda uri, request: _read_local_or_hub(uri[len("file://"):], request)}


def dispatch_source(source: str, request: SourceRequest) -> RowSource:
    if (match := _SCHEME_RE.match(source)) is None:
        return _read_local_or_hub(source, request)
    scheme = match.group(1).lower()
    if (reader := _SCHEME_READERS.get(scheme)) is None:
        known = ", ".join(f"{s}://" for s in sorted(_SCHEME_READERS))
        raise ValueError(
            f"{source}: unsupported URI scheme {scheme}:// (supported: {known}, local paths "
            "and hub dataset names like openai/gsm8k)")
    return reader(source, request)


def _looks_like_path(source: str, path: Path) -> bool:
    return (source.startswith(("/", ".", "~", "\\")) or path.suffix.lower() in _PATH_SUFFIXES
            or len(path.parts) > 2  # hub names are at most owner/name
            or (len(path.parts) == 2 and path.parent.is_dir()))


def _read_local_or_hub(source: str, request: SourceRequest) -> RowSource:
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_dir(path, request)
    if path.is_file():
        return _read_file(path, request)
    if _looks_like_path(source, path):
        raise FileNotFoundError(
            f"data source {source!r} not found: no such file or directory ({path.absolute()})")
    return _read_hub(source, request)


def _unsupported(name: object, suffix: str) -> ValueError:
    return ValueError(f"{name}: unsupported file type {suffix or '(no suffix)'!r}; "
                      "use .jsonl (one JSON object per line), .json, .csv, .parquet or .arrow")


def _read_file(path: Path, request: SourceRequest) -> RowSource:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_source([path], str(path), request)
    if suffix == ".csv":
        return _csv_source(path, request)
    if suffix == ".arrow":
        return _arrow_source(path, request)
    if suffix in _JSON_SUFFIXES:
        if suffix == ".json" and _first_non_space_byte(path) == b"[":
            return _json_array_source(path)
        return RowSource(name=str(path), rows=_jsonl_rows(path), row_label="line")
    raise _unsupported(path, suffix)


def _read_dir(path: Path, request: SourceRequest) -> RowSource:
    if request.subset and (path / request.subset).is_dir():
        path = path / request.subset
    if any((path / marker).is_file() for marker in _SAVE_TO_DISK_MARKERS):
        return _saved_dataset_source(path, request)
    split, searched = request.split, []
    for folder in (path, path / "data"):
        if not folder.is_dir():
            continue
        for name in (f"{split}.jsonl", f"{split}.json", f"{split}.csv", f"{split}.parquet",
                     f"{split}-*.parquet"):
            searched.append(str(folder / name))
            if "*" not in name and (folder / name).is_file():
                return _read_file(folder / name, request)
            if "*" in name and (shards := sorted(folder.glob(name))):
                return _parquet_source(shards, searched[-1], request)
    present = ", ".join(sorted(p.name for p in path.iterdir())[:20]) or "(empty)"
    raise FileNotFoundError(f"{path}: no data for split {split!r}: looked for "
                            f"{', '.join(searched)}; the directory has: {present}")


def _saved_dataset_source(path: Path, request: SourceRequest) -> RowSource:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # corrupt arrow files, a half-copied folder, a foreign layout
        raise ValueError(
            f"{path}: looks like a datasets.save_to_disk folder but does not load "
            f"({type(exc).__name__}: {_first_line(exc)}); save it again, or export the split "
            "as .jsonl or .parquet") from exc
    name = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if request.split not in loaded:
            raise ValueError(f"{path}: split {request.split!r} not found; available splits: "
                             f"{', '.join(sorted(loaded))} (set the split to one of them)")
        loaded, name = loaded[request.split], f"{path} [{request.split}]"
    elif (saved := getattr(loaded, "split", None)) is not None and str(saved) != request.split:
        raise ValueError(f"{path}: this saved dataset holds split {str(saved)!r}, not "
                         f"{request.split!r}; set the split to {str(saved)!r} or point at the "
                         "right directory")
    return RowSource(name=name, rows=_dataset_rows(loaded, name, request))


def _read_hub(name: str, request: SourceRequest) -> RowSource:
    import datasets

    try:
        loaded = datasets.load_dataset(name, request.subset, split=request.split)
    except Exception as exc:
        exc.add_note(
            f"grpoflow: {name!r} is not a local path, so it was read as a Hugging Face hub "
            f"dataset (subset={request.subset!r}, split={request.split!r}); if you meant a "
            f"local file, it does not exist at {Path(name).absolute()}")
        raise
    label = name + (f" ({request.subset})" if request.subset else "") + f" [{request.split}]"
    return RowSource(name=label, rows=_dataset_rows(loaded, label, request))


def _dataset_rows(dataset: Any, name: str, request: SourceRequest) -> Iterator[tuple[int, Row]]:
    """Rows of a ``datasets`` Dataset (or any iterable of mappings), every column."""
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list):
        _check_columns(name, column_names, request)
    return enumerate(dataset, start=1)


def _check_columns(name: str, columns: Sequence[str], request: SourceRequest) -> None:
    if not (missing := [c for c in request.required if c not in columns]):
        return
    args = {request.required[0]: "question_field", request.required[1]: "answer_field"}
    fixes = ", ".join(f"data.{args[c]}=<column>" for c in missing)
    raise DataValidationError(
        name, [], f"{name}: missing column(s) {', '.join(map(repr, missing))}; the columns are: "
        f"{', '.join(columns) or '(none)'}. Pass {fixes} to map them.")


def _first_non_space_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            if stripped := chunk.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip():
                return stripped[:1]
    return b""


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Row]]:
    """(line number, row) per non-blank line; undecodable or unparsable lines become BadRow."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, BadRow(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                     f"{exc.start + 1}); re-save the file as UTF-8")
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                obj = BadRow(f"invalid JSON ({exc.msg} at column {exc.colno})")
            except RecursionError:
                obj = BadRow("invalid JSON (nested too deeply to parse)")
            yield lineno, (obj if isinstance(obj, dict | BadRow)
                           else BadRow(f"expected a JSON object, got {type(obj).__name__}"))


def _json_array_source(path: Path) -> RowSource:
    try:
        items = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(
            f"{path}: not a valid UTF-8 JSON array ({exc}); fix the file or convert it to "
            "JSONL (one object per line) so bad rows can be skipped individually") from exc
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON array of objects or JSONL lines")
    rows = ((n, item if isinstance(item, dict)
             else BadRow(f"expected a JSON object, got {type(item).__name__}"))
            for n, item in enumerate(items, start=1))
    return RowSource(name=str(path), rows=rows, row_label="item")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"{path}: not a readable Parquet file ({_first_line(exc)}); the file is empty, "
            "truncated or another format: write it again (pyarrow.parquet.write_table or "
            "DataFrame.to_parquet) or use .jsonl") from exc


def _csv_source(path: Path, request: SourceRequest) -> RowSource:
    """A CSV file with a header row; cells stay text (rows numbered from 1 after the header)."""
    import csv

    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            header, rows = reader.fieldnames or [], list(reader)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: not a readable UTF-8 CSV file ({exc}); re-save it as UTF-8 "
                         "with a header row, or use .jsonl") from exc
    _check_columns(str(path), header, request)
    numbered = ((n, BadRow(f"{len(row[None])} more cells than the header's {len(header)}")
                 if None in row else row) for n, row in enumerate(rows, start=1))
    return RowSource(name=str(path), rows=numbered)


def _arrow_source(path: Path, request: SourceRequest) -> RowSource:
    """An Arrow IPC file or stream (``datasets`` caches its splits as the latter)."""
    try:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Arrow file ({_first_line(exc)}); write it "
                         "again (pyarrow.ipc) or use .parquet") from exc
    _check_columns(str(path), table.column_names, request)
    return RowSource(name=str(path), rows=enumerate(table.to_pylist(), start=1))


def _parquet_source(paths: Sequence[Path], name: str, request: SourceRequest) -> RowSource:
    files, ranges, start = [_open_parquet(p) for p in paths], [], 1
    for p, f in zip(paths, files, strict=True):
        _check_columns(str(p), f.schema_arrow.names, request)
        ranges.append(f"{p.name}: rows {start}-{start + f.metadata.num_rows - 1}")
        start += f.metadata.num_rows
    note = f"Rows are numbered across files in order: {'; '.join(ranges)}" if paths[1:] else None

    def rows() -> Iterator[tuple[int, Row]]:
        number = 0
        for p, f in zip(paths, files, strict=True):
            batches = f.iter_batches()
            while True:
                try:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    decoded = batch.to_pylist()
                except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
                    raise ValueError(
                        f"{p}: Parquet data after row {number} does not read ({_first_line(exc)}); "
                        "the file is corrupt or truncated: write it again") from exc
                for row in decoded:
                    number += 1
                    yield number, row

    return RowSource(name=name, rows=rows(), note=note)


def source_image_spec(images: ImageSpec, source: str | os.PathLike[str]) -> ImageSpec:
    """``images`` for the rows of ``source``: relative paths read from the data file's folder
    (the directory itself for a directory source), ``s3://`` through :mod:`rl_core.storage`."""
    local = Path(os.fspath(source)).expanduser()
    return replace(images, read_uri=images.read_uri or storage.read_bytes, base_dir=(
        images.base_dir or (local if local.is_dir() else local.parent if local.exists() else None)))


def load_records(
    source: str | os.PathLike[str], split: str = "train", *, subset: str | None = None,
    question_field: str = "question", answer_field: str = "answer", id_field: str | None = "id",
    limit: int | None = None, max_bad_fraction: float = 0.0,
    cache_dir: str | os.PathLike[str] | None = None, answer_check: AnswerCheck | None = None,
    images: ImageSpec | None = None,
) -> list[Record]:
    """Load and validate records from a file, directory, ``s3://`` URI or hub dataset name
    (``subset``: the hub configuration or local sub-folder; ``limit``: the first N good records;
    ``answer_check``: what the reward needs of an answer, :func:`~rl_core.data.records.
    validate_records`; ``images``: how a row's images are read and checked, relative paths from
    the data file's folder). Raises FileNotFoundError (missing path or object),
    DataValidationError (a ValueError: bad rows) or :class:`rl_core.storage.StorageError`."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    request = SourceRequest(split, subset, (question_field, answer_field),
                            Path(cache_dir) if cache_dir is not None else None)
    read = dispatch_source(os.fspath(source), request)
    if images is not None:
        images = source_image_spec(images, source)
    records, problems = validate_numbered_rows(read.rows, read.name, question_field=question_field,
        answer_field=answer_field, id_field=id_field, max_bad_fraction=max_bad_fraction,
        row_label=read.row_label, note=read.note, answer_check=answer_check, images=images)
    if problems:  # a counted skip, within max_bad_fraction: say how many and which
        shown = "; ".join(f"{read.row_label} {n}: {why}" for n, why in problems[:3])
        more = f"; ... and {len(problems) - 3} more" if len(problems) > 3 else ""
        log.warning("%s: skipped %d of %d rows (within max_bad_fraction=%s): %s%s", read.name,
                    len(problems), len(problems) + len(records), max_bad_fraction, shown, more)
    return records if limit is None else records[:limit]


_SNAPSHOT_COLUMNS = ("id", "question", "answer")


def _text(value: Any) -> tuple[str, bool]:  # noqa: ANN401
    """(text, whether it is JSON): a string as itself, anything else JSON-encoded."""
    return (value, False) if isinstance(value, str) else (json.dumps(value, default=str), True)


def write_parquet(records: Sequence[Record], path: str | os.PathLike[str]) -> str:
    """Write records as Parquet (columns id, question, answer; ``encoded`` names which of the
    last two are JSON for a row whose prompt is chat messages or whose answer is no string;
    ``columns``: the row's columns as JSON; ``images``, where a record has any: their bytes),
    atomically (temp file + rename); return their
    digest, also stored in the schema metadata under ``grpoflow.records_digest``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = _records.records_digest(records)
    data: dict[str, list[Any]] = {c: [] for c in (*_SNAPSHOT_COLUMNS, "encoded", "columns")}
    for r in records:
        (q, qj), (a, aj) = _text(r.question), _text(r.answer)
        for name, value in (("id", r.id), ("question", q), ("answer", a),
                            ("encoded", "q" * qj + "a" * aj),
                            ("columns", json.dumps(r.columns, default=str) if r.columns else "")):
            data[name].append(value)
    fields = [(c, pa.string()) for c in data]
    if any(r.images for r in records):  # the image bytes themselves: the digest covers them
        data["images"] = [list(r.images) for r in records]
        fields.append(("images", pa.list_(pa.binary())))
    schema = pa.schema(fields, metadata={DIGEST_METADATA_KEY: digest.encode()})
    table = pa.table(data, schema=schema)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return digest


def read_parquet(path: str | os.PathLike[str]) -> list[Record]:
    """Read records written by :func:`write_parquet` (also the older snapshots with only id,
    question and answer), in order."""
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(f"records file not found: {target.absolute()}")
    try:
        table = pq.read_table(target)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"{target}: the records snapshot does not read ({_first_line(exc)}); it is "
            "corrupt or truncated: delete it (and its meta.json) so it is prepared again") from exc
    if missing := [c for c in _SNAPSHOT_COLUMNS if c not in table.column_names]:
        raise ValueError(
            f"{target}: missing column(s) {', '.join(missing)} (has: "
            f"{', '.join(table.column_names)}); use load_records() for arbitrary Parquet files")
    records: list[Record] = []
    for number, row in enumerate(table.to_pylist(), 1):
        values = [row[c] for c in _SNAPSHOT_COLUMNS]
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"{target}: row {number} has a null or non-string field: {row!r}")
        encoded = row.get("encoded") or ""
        if "q" in encoded:
            values[1] = json.loads(values[1])
        if "a" in encoded:
            values[2] = json.loads(values[2])
        columns = json.loads(row["columns"]) if row.get("columns") else {}
        records.append(Record(*values, columns=columns, images=tuple(row.get("images") or ())))
    return records
