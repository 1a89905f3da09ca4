"""One URI abstraction for durable storage: local paths and ``s3://bucket/prefix``.

Every function behaves the same for both, so callers never branch on where bytes live. S3 goes
through boto3 (any S3-compatible store; endpoint, region, credentials, timeouts and retries:
docs/storage.md). Directories travel with a ``MANIFEST.json`` (sizes, SHA-256) written last; a
prefix without one is an interrupted upload, refused on download; downloads are verified aside,
then renamed into place. Errors and log lines are redacted and name the URI, operation and fix.
Never reads, stores or logs credentials; never imports Prefect or MLflow; never deletes outside
the prefix it is given (nor a bucket).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rl_core.secrets import RedactFilter, redact
from rl_core.storage.errors import (
    _DENIED,
    _MISSING,
    _NETWORK,
    _NO_CREDENTIALS,
    BucketNotFound,
    ChecksumMismatch,
    ManifestMissing,
    NotFound,
    StorageError,
    Unreachable,
    _code,
    _raise,
)

__all__ = [
    "MANIFEST", "BucketNotFound", "ChecksumMismatch", "FileInfo", "ManifestMissing", "NotFound",
    "StorageError", "Unreachable", "build_manifest", "default_cache_dir", "delete", "delete_prefix",
    "download_dir", "download_file", "exists", "file_sha256", "fingerprint", "is_remote", "join",
    "list_dirs", "list_files", "read_bytes", "read_manifest", "reset_clients", "resolve_endpoint",
    "s3_env", "stat", "upload_dir", "upload_file", "write_bytes",
]

MANIFEST = "MANIFEST.json"
MIB = 1 << 20
# Multipart above 64 MiB in 64 MiB parts (S3's minimum part is 5 MiB; 10,000 parts at most,
# so 64 MiB parts reach 625 GiB per file), 8 parts or files in flight.
MULTIPART_THRESHOLD = MULTIPART_CHUNKSIZE = 64 * MIB
MAX_CONCURRENCY = 8
MAX_ATTEMPTS = 5  # per request, with botocore's exponential backoff and jitter
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10, 120
PROGRESS_BAR_BYTES = 256 * MIB  # a tqdm bar for transfers at least this large (on a TTY)
log = logging.getLogger(__name__)
log.addFilter(RedactFilter())
PathOrUri = str | os.PathLike[str]  # a local path or an s3:// URI


def is_remote(uri: PathOrUri) -> bool:
    """Whether ``uri`` is an ``s3://`` URI (everything else is a local path)."""
    return isinstance(uri, str) and uri[:5].lower() == "s3://"


def _split(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        _raise(StorageError, f"{uri}: no bucket name; an S3 URI looks like s3://bucket/prefix")
    return bucket, key


def _dir_key(key: str) -> str:
    """A key as a directory prefix: ``a/b`` -> ``a/b/``; the bucket root stays ``""``."""
    return key.rstrip("/") + "/" if key.strip("/") else ""


def join(uri: PathOrUri, *parts: str) -> str:
    """``uri`` with ``parts`` appended (``/``-separated for S3, ``os.path.join`` locally)."""
    if not is_remote(uri):
        return str(Path(uri, *parts))
    return "/".join([str(uri).rstrip("/"), *(p.strip("/") for p in parts if p.strip("/"))])


def default_cache_dir() -> Path:
    """Where downloads go by default: ``$GRPOFLOW_CACHE_DIR``, else ``.cache/grpoflow``."""
    return Path(os.environ.get("GRPOFLOW_CACHE_DIR") or ".cache/grpoflow")


def resolve_endpoint(endpoint_url: str | None = None) -> str | None:
    """The endpoint: the argument, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, None (AWS)."""
    env = os.environ
    return endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def s3_env(endpoint_url: str | None) -> dict[str, str]:
    """Environment pointing boto3 and MLflow's artifact store at ``storage.s3_endpoint_url``."""
    names = ("AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL")
    return dict.fromkeys(names, endpoint_url) if endpoint_url else {}


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def reset_clients() -> None:
    """Forget cached clients (after the endpoint or the credentials in the environment change)."""
    with _clients_lock:
        _clients.clear()


def _max_attempts() -> int:
    """``AWS_MAX_ATTEMPTS`` when set (boto3's own variable), else :data:`MAX_ATTEMPTS`."""
    try:
        return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS))
    except ValueError:
        return MAX_ATTEMPTS


def _client() -> Any:
    """A cached boto3 S3 client (one per process, endpoint, region, profile and retry count)."""
    import boto3  # a dependency; ``grpoflow doctor`` names the fix where it is missing
    from botocore.config import Config

    endpoint = resolve_endpoint()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    cache_key = (os.getpid(), endpoint, region, os.environ.get("AWS_PROFILE"), _max_attempts())
    with _clients_lock:
        if cache_key in _clients:
            return _clients[cache_key]
        options: dict[str, Any] = dict(
            retries={"max_attempts": _max_attempts(), "mode": "standard"},
            connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
            max_pool_connections=MAX_CONCURRENCY * 2)
        if endpoint:
            # S3-compatible stores: path-style addressing (no bucket DNS names), and integrity
            # checksums only where the API requires them (several stores reject the newer
            # default trailers); grpoflow's manifests check SHA-256 end to end anyway.
            options["s3"] = {"addressing_style": "path"}
            for option in ("request_checksum_calculation", "response_checksum_validation"):
                if not os.environ.get(f"AWS_{option.upper()}"):
                    options[option] = "when_required"
        _clients[cache_key] = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region or ("us-east-1" if endpoint else None),
            config=Config(**options))
        return _clients[cache_key]


def _transfer_config(multipart_threshold: int | None, multipart_chunksize: int | None) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=multipart_threshold or MULTIPART_THRESHOLD,
                          multipart_chunksize=multipart_chunksize or MULTIPART_CHUNKSIZE,
                          max_concurrency=MAX_CONCURRENCY, use_threads=True)


def _where(uri: str) -> str:
    return f"{uri} (endpoint {endpoint})" if (endpoint := resolve_endpoint()) else uri


def _translate(op: str, uri: str, exc: BaseException) -> StorageError:
    """A boto3/botocore failure -> a StorageError naming the URI, the operation and the fix."""
    where, name = _where(uri), type(exc).__name__
    if name == "S3UploadFailedError" and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # boto3's upload_file wraps the ClientError
        name = type(exc).__name__
    code, message = _code(exc)
    bucket = _split(uri)[0] if is_remote(uri) else ""
    if code == "NoSuchBucket":
        cls, text = BucketNotFound, (f"bucket {bucket!r} does not exist; create the bucket or "
                                     "fix the URI in the config")
    elif code in _MISSING:
        cls, text = NotFound, "no such object; check the URI"
    elif code in _DENIED:
        cls, text = StorageError, (f"access denied ({code}); check the credentials boto3 finds "
                                   "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the "
                                   f"machine's role), the bucket policy for {bucket!r}, and the "
                                   "endpoint (AWS_ENDPOINT_URL)")
    elif name in _NO_CREDENTIALS:
        cls, text = StorageError, (f"no usable S3 credentials ({name}); set AWS_ACCESS_KEY_ID "
                                   "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an "
                                   "instance/pod role")
    elif name in _NETWORK or isinstance(exc, ConnectionError | TimeoutError):
        cls, text = Unreachable, (f"the S3 endpoint cannot be reached ({name}: {message}) after "
                                  f"{_max_attempts()} attempts; check storage.s3_endpoint_url / "
                                  "AWS_ENDPOINT_URL and this machine's network")
    elif code == "InvalidBucketName":
        cls, text = StorageError, f"invalid bucket name {bucket!r} (3-63 lowercase characters)"
    else:
        return StorageError(redact(f"{op} {where} failed: {code or name}: {message}"))
    return cls(redact(f"{op} {where}: {text}"))


@contextlib.contextmanager
def _s3_errors(op: str, uri: str) -> Iterator[None]:
    """Translate boto3 failures; ``from None`` so no raw exception text (which could carry
    request details) is chained into tracebacks; the redacted reason is in the message."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified by _translate
        raise _translate(op, uri, exc) from None


@dataclass(frozen=True)
class FileInfo:
    """One file under a prefix: its name relative to the prefix, size and version tag."""

    name: str
    size: int
    etag: str  # the S3 ETag; locally the modification time in ns


def stat(uri: PathOrUri) -> FileInfo:
    """Size and ETag of one object (or local file); :class:`NotFound` if there is none."""
    if not is_remote(uri):
        if not (p := Path(uri)).is_file():
            _raise(NotFound, f"stat {p}: no such file")
        return FileInfo(p.name, p.stat().st_size, str(p.stat().st_mtime_ns))
    bucket, key = _split(uri := str(uri))
    if not key or key.endswith("/"):
        _raise(NotFound, f"stat {_where(uri)}: a prefix, not an object")
    with _s3_errors("stat", uri):
        head = _client().head_object(Bucket=bucket, Key=key)
    return FileInfo(PurePosixPath(key).name, int(head["ContentLength"]), head["ETag"].strip('"'))


def exists(uri: PathOrUri) -> bool:
    """Whether a file/object, or a directory/non-empty prefix, is at ``uri``."""
    if not is_remote(uri):
        return Path(uri).exists()
    with contextlib.suppress(NotFound):  # a missing bucket raises again from the listing
        stat(uri)
        return True
    with _s3_errors("exists", uri := str(uri)):
        return bool(next(_pages(uri, MaxKeys=1)).get("KeyCount", 0))


def _pages(uri: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
    bucket, key = _split(uri)
    yield from _client().get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=_dir_key(key), **kwargs)


def list_dirs(uri: PathOrUri) -> list[str]:
    """Names of the immediate sub-directories (S3: common prefixes) of ``uri``, sorted."""
    if not is_remote(uri):
        p = Path(uri)
        return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []
    with _s3_errors("list", uri := str(uri)):
        return sorted(c["Prefix"].rstrip("/").rsplit("/", 1)[-1]
                      for page in _pages(uri, Delimiter="/")
                      for c in page.get("CommonPrefixes", []))


def list_files(uri: PathOrUri) -> list[FileInfo]:
    """Every file under ``uri`` (recursively), names relative to it, sorted by name."""
    if not is_remote(uri):
        root = Path(uri)
        files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else []
        return [FileInfo(f.relative_to(root).as_posix(), (st := f.stat()).st_size,
                         str(st.st_mtime_ns)) for f in files]
    prefix = _dir_key(_split(uri := str(uri))[1])
    with _s3_errors("list", uri):
        objects = [o for page in _pages(uri) for o in page.get("Contents", [])]
    return sorted((FileInfo(o["Key"][len(prefix):], int(o["Size"]), str(o["ETag"]).strip('"'))
                   for o in objects if o["Key"][len(prefix):] and not o["Key"].endswith("/")),
                  key=lambda f: f.name)  # skips "directory marker" objects; fmt: skip


def fingerprint(uri: PathOrUri) -> str:
    """A cache key for things derived from ``uri``: a digest of its names, sizes, ETags/mtimes."""
    try:
        entries = [["", (one := stat(uri)).size, one.etag]]
    except NotFound:
        entries = [[f.name, f.size, f.etag] for f in list_files(uri)]
    blob = json.dumps([str(uri), entries], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def read_bytes(uri: PathOrUri) -> bytes:
    """The content of a small file or object (manifests, state); :class:`NotFound` if none."""
    if not is_remote(uri):
        if not Path(uri).is_file():
            _raise(NotFound, f"read {uri}: no such file")
        return Path(uri).read_bytes()
    bucket, key = _split(uri := str(uri))
    with _s3_errors("read", uri):
        return _client().get_object(Bucket=bucket, Key=key)["Body"].read()


def _replace_atomically(dest: Path, write: Callable[[Path], Any], tag: str = "tmp") -> Path:
    """``write(tmp)`` to a hidden temporary sibling of ``dest``, then rename it onto ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{tag}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_bytes(uri: PathOrUri, data: bytes) -> None:
    """Write a small file or object in one piece (locally: temp file, fsync, rename)."""
    if not is_remote(uri):
        _replace_atomically(Path(uri), lambda tmp: _write_synced(tmp, data))
        return
    bucket, key = _split(uri := str(uri))
    with _s3_errors("write", uri):
        _client().put_object(Bucket=bucket, Key=key, Body=data)


def delete(uri: PathOrUri) -> None:
    """Delete one file or object; nothing happens if it does not exist."""
    if not is_remote(uri):
        Path(uri).unlink(missing_ok=True)
        return
    bucket, key = _split(uri := str(uri))
    with _s3_errors("delete", uri):
        _client().delete_object(Bucket=bucket, Key=key)


def delete_prefix(uri: PathOrUri) -> int:
    """Delete everything under the directory/prefix ``uri`` (never a bucket root); returns how
    many files went. ``s3://b/c/step-000002`` deletes ``step-000002/...``, not ``step-0000020/``."""
    if not is_remote(uri):
        if not (p := Path(uri)).is_dir():
            return 0
        count = sum(f.is_file() for f in p.rglob("*"))
        shutil.rmtree(p)
        return count
    bucket, key = _split(uri := str(uri))
    if not key.strip("/"):
        _raise(StorageError, f"delete {uri}: refusing to delete a whole bucket; name a prefix")
    deleted = 0
    with _s3_errors("delete", uri):
        for page in _pages(uri):
            if not (keys := [{"Key": obj["Key"]} for obj in page.get("Contents", [])]):
                continue
            resp = _client().delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            if errors := resp.get("Errors", []):
                _raise(StorageError, f"delete {_where(uri)}: {len(errors)} object(s) could not "
                       f"be deleted (first: {(first := errors[0]).get('Key')}: {first.get('Code')} "
                       f"{first.get('Message')}); check the credentials' s3:DeleteObject "
                       "permission")
            deleted += len(keys)
    return deleted


def file_sha256(path: PathOrUri) -> str:
    """The SHA-256 (hex) of a local file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def _safe_name(name: str, uri: str) -> PurePosixPath:
    """A manifest entry as a relative path that cannot escape the destination."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\\" in name:
        _raise(StorageError, f"{uri}: the manifest names an unsafe path {name!r}; not using it")
    return rel


def download_file(uri: PathOrUri, local: PathOrUri, *, multipart_threshold: int | None = None,
                  multipart_chunksize: int | None = None) -> Path:
    """Copy one object (or file) to ``local``, atomically (temp name, then rename)."""
    if not is_remote(uri):
        if not Path(uri).is_file():
            _raise(NotFound, f"copy {uri}: no such file")
        return _replace_atomically(Path(local), lambda tmp: shutil.copyfile(uri, tmp), "partial")
    bucket, key = _split(uri := str(uri))
    config = _transfer_config(multipart_threshold, multipart_chunksize)
    with _s3_errors("download", uri):
        return _replace_atomically(Path(local), lambda tmp: _client().download_file(
            bucket, key, str(tmp), Config=config), "partial")


def upload_file(local: PathOrUri, uri: PathOrUri, *, multipart_threshold: int | None = None,
                multipart_chunksize: int | None = None) -> None:
    """Copy one local file to ``uri`` (multipart above the threshold)."""
    if not (src := Path(local)).is_file():
        _raise(NotFound, f"upload {src}: no such file")
    if not is_remote(uri):
        _copy_local(src, Path(uri))
        return
    bucket, key = _split(uri := str(uri))
    with _s3_errors("upload", uri):
        _client().upload_file(str(src), bucket, key,
                              Config=_transfer_config(multipart_threshold, multipart_chunksize))


def _copy_local(src: Path, dest: Path) -> None:
    _replace_atomically(dest, lambda tmp: shutil.copyfile(src, tmp))


def build_manifest(local: PathOrUri, *, manifest_name: str = MANIFEST) -> dict[str, Any]:
    """``{"created", "files": {name: {"bytes", "sha256"}}}`` of the files under ``local``."""
    root = Path(local)
    files = {f.relative_to(root).as_posix(): {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(root.rglob("*"))
             if f.is_file() and f.relative_to(root).as_posix() != manifest_name}
    return {"created": time.time(), "files": files}


def _rate(nbytes: int, started: float) -> str:
    seconds = time.perf_counter() - started
    return f"{nbytes / 1e6:.1f} MB in {seconds:.1f}s ({nbytes / 1e6 / max(seconds, 1e-6):.0f} MB/s)"


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[list[Any]]:
    """s3transfer subscribers moving a tqdm bar (off without a TTY) from PROGRESS_BAR_BYTES up."""
    if total < PROGRESS_BAR_BYTES:
        yield []
        return
    from s3transfer.subscribers import BaseSubscriber
    from tqdm import tqdm

    class _Bar(BaseSubscriber):
        def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
            bar.update(bytes_transferred)

    with tqdm(total=total, unit="B", unit_scale=True, desc=redact(label), disable=None,
              leave=False) as bar:
        yield [_Bar()]


def _transfer(op: str, uri: str, local: Path, names: list[str], total: int,
              *multipart: int | None) -> None:
    """Upload or download ``names`` between the directory ``local`` and ``uri`` (S3: several at
    once); one that ``uri`` lacks is :class:`NotFound` locally, :class:`ChecksumMismatch` in S3."""
    if not is_remote(uri):
        for n in names:
            if op == "download" and not (Path(uri) / n).is_file():
                _raise(NotFound, f"copy {uri}: {n} is listed in the manifest but missing")
            pair = (local / n, Path(uri) / n)
            _copy_local(*(pair if op == "upload" else pair[::-1]))
        return
    from boto3.s3.transfer import create_transfer_manager

    bucket, key = _split(uri)
    prefix, config = _dir_key(key), _transfer_config(*multipart)
    with (_s3_errors(op, uri), _progress(total, f"{op} {uri}") as subs,
          create_transfer_manager(_client(), config) as manager):
        for n in names:  # where a download lands (an upload's directories exist)
            (local / n).parent.mkdir(parents=True, exist_ok=True)
        futures = {n: manager.upload(str(local / n), bucket, prefix + n, subscribers=subs)
                   if op == "upload" else
                   manager.download(bucket, prefix + n, str(local / n), subscribers=subs)
                   for n in names}
        for name, future in futures.items():
            try:
                future.result()
            except Exception as exc:
                if op == "download" and _code(exc)[0] in _MISSING:
                    _raise(ChecksumMismatch, f"download {_where(uri)}: {name} is listed in the "
                           "manifest but missing; the upload is damaged, so it is not used: "
                           "upload the directory again")
                raise


def upload_dir(local: PathOrUri, uri: PathOrUri, *, manifest_name: str = MANIFEST,
               manifest: Mapping[str, Any] | None = None, multipart_threshold: int | None = None,
               multipart_chunksize: int | None = None) -> dict[str, Any]:
    """Upload every file under ``local`` to the prefix ``uri``, the manifest LAST; returns it. The
    manifest is computed here or passed by a caller that just did (sizes re-checked); one already at
    ``uri`` is deleted first. Files there that the new manifest omits are left alone."""
    src, uri = Path(local), str(uri)
    if not src.is_dir():
        _raise(NotFound, f"upload {src}: no such directory")
    manifest = dict(manifest or build_manifest(src, manifest_name=manifest_name))
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name, meta in files.items():
        path = src / _safe_name(name, str(src))
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            _raise(StorageError, f"upload {src}: {name} changed or vanished after it was hashed")
    total = sum(int(m["bytes"]) for m in files.values())
    started = time.perf_counter()
    log.info("uploading %d files (%.1f MB) from %s to %s", len(files), total / 1e6, src, uri)
    manifest_uri = join(uri, manifest_name)
    delete(manifest_uri)  # from here on the destination reads as incomplete
    _transfer("upload", uri, src, list(files), total, multipart_threshold, multipart_chunksize)
    write_bytes(manifest_uri, json.dumps(manifest, indent=1, sort_keys=True).encode())
    log.info("uploaded %s: %s, manifest written last", uri, _rate(total, started))
    return manifest


def read_manifest(uri: PathOrUri, *, manifest_name: str = MANIFEST) -> dict[str, Any]:
    """The manifest of the directory ``uri``; :class:`ManifestMissing` if it has none."""
    uri = str(uri)
    try:
        raw = read_bytes(join(uri, manifest_name))
    except BucketNotFound:
        raise
    except NotFound:
        _raise(ManifestMissing, f"{_where(uri)} has no {manifest_name}: an interrupted or foreign "
               "upload, not used; upload it again (grpoflow writes the manifest last)")
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest["files"], dict):
            raise TypeError("files is not a mapping")
        for name, meta in manifest["files"].items():
            _safe_name(name, uri)
            if not isinstance(meta["bytes"], int) or not isinstance(meta["sha256"], str):
                raise TypeError(f"{name}: bytes must be an integer and sha256 a string")
    except (ValueError, KeyError, TypeError) as exc:
        _raise(ManifestMissing, f"{_where(uri)}: {manifest_name} is not a valid manifest ({exc})")
    return manifest


def download_dir(uri: PathOrUri, local: PathOrUri, *, manifest_name: str = MANIFEST,
                 require_manifest: bool = True, include: Callable[[str], bool] | None = None,
                 multipart_threshold: int | None = None,
                 multipart_chunksize: int | None = None) -> dict[str, Any]:
    """Download the directory ``uri`` into ``local``, verified (size and SHA-256 against its
    manifest, else :class:`ChecksumMismatch`) and atomically. No manifest: :class:`ManifestMissing`,
    unless ``require_manifest=False`` (sizes checked against the listing). ``include(name)`` narrows
    the files. Returns the manifest with ``"verified": "sha256"`` or ``"size"``."""
    uri, dest = str(uri), Path(local)
    try:
        manifest, verified = read_manifest(uri, manifest_name=manifest_name), "sha256"
    except ManifestMissing:
        if require_manifest or exists(join(uri, manifest_name)):
            raise
        if not (listing := list_files(uri)):
            _raise(NotFound, f"download {_where(uri)}: nothing there; check the URI")
        manifest, verified = {"files": {f.name: {"bytes": f.size} for f in listing}}, "size"
    files = {n: m for n, m in manifest["files"].items() if include is None or include(n)}
    for name in files:  # before anything is written (a listing's names are unchecked)
        _safe_name(name, uri)
    total = sum(int(m["bytes"]) for m in files.values())
    dest.parent.mkdir(parents=True, exist_ok=True)
    (tmp := dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")).mkdir()
    started = time.perf_counter()
    log.info("downloading %d files (%.1f MB) from %s to %s", len(files), total / 1e6, uri, dest)
    damaged = ("the stored copy is damaged or was overwritten since the upload, so it is not "
               "used: upload the directory again")
    try:
        _transfer("download", uri, tmp, list(files), total, multipart_threshold,
                  multipart_chunksize)
        for name, meta in files.items():
            if (size := (path := tmp / name).stat().st_size) != int(meta["bytes"]):
                _raise(ChecksumMismatch, f"download {_where(uri)}: {name} has {size} bytes, the "
                       f"manifest says {meta['bytes']}; {damaged}")
            if "sha256" in meta and file_sha256(path) != meta["sha256"]:
                _raise(ChecksumMismatch, f"download {_where(uri)}: {name} does not match its "
                       f"SHA-256 in {manifest_name}; {damaged}")
        if verified == "sha256":
            (tmp / manifest_name).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        aside = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        if dest.exists():
            os.rename(dest, aside)
        os.rename(tmp, dest)
        shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("downloaded %s: %s, verified (%s)", uri, _rate(total, started), verified)
    return {**manifest, "verified": verified}
