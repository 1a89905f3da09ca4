"""One URI abstraction for durable storage: local paths and ``s3://bucket/prefix``.

Every function takes a local path or an ``s3://`` URI and behaves the same for both, so data
sources, model downloads and checkpoints never branch on where the bytes live. S3 goes through
boto3, so any S3-compatible store works (MinIO, Ceph RGW, Cloudflare R2):

- endpoint: the ``endpoint_url`` argument, else ``AWS_ENDPOINT_URL_S3``, else
  ``AWS_ENDPOINT_URL``, else AWS itself; region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION``.
- credentials: boto3's standard chain (environment, ``AWS_PROFILE`` and the shared files,
  SSO, web identity, container and instance roles). This module never reads, stores or logs
  a key itself.
- transfers: multipart above a threshold (``TransferConfig``), several files at once, bounded
  retries with backoff (botocore ``standard`` retry mode) and connect/read timeouts.

Directories travel with a manifest (``MANIFEST.json``: every file's size and SHA-256).
:func:`upload_dir` writes the manifest last, so a prefix without one is an interrupted upload
and :func:`download_dir` refuses it; a download lands in a temporary directory, is checked
file by file against the manifest and is then renamed into place, so the destination is
either complete and verified or untouched.

Every error raised and every line logged here passes through :func:`redact` first (access key
ids, secrets present in the environment, ``user:pass@`` in URLs, presigned signatures), and
errors name the URI, the operation and the fix.

Never imports Prefect or MLflow; never deletes outside the prefix it is given (and never a
whole bucket).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

__all__ = [
    "MANIFEST",
    "BucketNotFound",
    "ChecksumMismatch",
    "FileInfo",
    "ManifestMissing",
    "NotFound",
    "RedactFilter",
    "StorageError",
    "Unreachable",
    "build_manifest",
    "default_cache_dir",
    "delete",
    "delete_prefix",
    "download_dir",
    "download_file",
    "exists",
    "fingerprint",
    "is_remote",
    "join",
    "list_dirs",
    "list_files",
    "read_bytes",
    "redact",
    "read_manifest",
    "reset_clients",
    "resolve_endpoint",
    "s3_env",
    "stat",
    "upload_dir",
    "upload_file",
    "write_bytes",
]

MANIFEST = "MANIFEST.json"
MIB = 1 << 20
# Multipart above 64 MiB in 64 MiB parts (S3's minimum part is 5 MiB; 10,000 parts at most,
# so 64 MiB parts reach 625 GiB per file), 8 parts or files in flight.
MULTIPART_THRESHOLD = 64 * MIB
MULTIPART_CHUNKSIZE = 64 * MIB
MAX_CONCURRENCY = 8
MAX_ATTEMPTS = 5  # per request, with botocore's exponential backoff and jitter
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 120
# Values of these variables are masked wherever they appear in a message.
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
)
_MIN_SECRET_LEN = 6  # shorter values would mask ordinary words

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- redaction


_ACCESS_KEY_RE = re.compile(
    r"(?<![A-Z0-9])(?:AKIA|ASIA|AIDA|AROA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])"
)
_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@:]*:[^/\s@]*@")
_SIGNED_QUERY_RE = re.compile(
    r"(?i)(?P<name>X-Amz-(?:Signature|Security-Token|Credential)|Signature|AWSAccessKeyId)"
    r"=[^&\s\"']+"
)
_ASSIGNED_SECRET_RE = re.compile(
    r"(?i)(?P<name>aws_secret_access_key|aws_session_token|secret_access_key|secret_key|password)"
    r"(?P<sep>\s*[=:]\s*)['\"]?[^\s,;'\"]+['\"]?"
)


def redact(text: object) -> str:
    """``text`` with credentials masked: safe for logs, errors, params and artifacts.

    Masks AWS access key ids (``AKIA...``/``ASIA...``), the values of the secret variables in
    :data:`SECRET_ENV` currently set (6 characters or more), ``user:pass@`` in URLs, presigned
    URL signatures and ``secret_key=...``-style assignments.
    """
    out = str(text)
    secrets = sorted(
        {v for n in SECRET_ENV if len(v := os.environ.get(n, "")) >= _MIN_SECRET_LEN},
        key=len,
        reverse=True,
    )
    for secret in secrets:
        out = out.replace(secret, "***")
    out = _ACCESS_KEY_RE.sub(lambda m: m.group(0)[:4] + "****", out)
    out = _USERINFO_RE.sub(r"\g<scheme>***:***@", out)
    out = _SIGNED_QUERY_RE.sub(r"\g<name>=***", out)
    return _ASSIGNED_SECRET_RE.sub(r"\g<name>\g<sep>***", out)


class RedactFilter(logging.Filter):
    """A logging filter that passes every record's message through :func:`redact`.

    Attach it to a handler (``handler.addFilter(RedactFilter())``) to cover every logger that
    reaches the handler; this module's own logger carries one.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the caller's bug; keep it
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


log.addFilter(RedactFilter())


# ---------------------------------------------------------------- errors


class StorageError(RuntimeError):
    """A storage operation that failed; the message names the URI, the operation and the fix."""


class NotFound(StorageError, FileNotFoundError):
    """No object, prefix or file at the URI."""


class BucketNotFound(NotFound):
    """The URI's bucket does not exist."""


class ManifestMissing(StorageError):
    """A directory without its manifest: an interrupted upload, never to be used."""


class ChecksumMismatch(StorageError):
    """A downloaded file whose size or SHA-256 differs from the manifest."""


class Unreachable(StorageError, ConnectionError):
    """The endpoint could not be reached (network, DNS, timeout)."""


def _raise(cls: type[StorageError], message: str) -> NoReturn:
    raise cls(redact(message))


# ---------------------------------------------------------------- URIs


def is_remote(uri: str | os.PathLike[str]) -> bool:
    """Whether ``uri`` is an ``s3://`` URI (everything else is a local path)."""
    return isinstance(uri, str) and uri[:5].lower() == "s3://"


def _split(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    rest = uri[5:]
    bucket, _, key = rest.partition("/")
    if not bucket:
        _raise(StorageError, f"{uri}: no bucket name; an S3 URI looks like s3://bucket/prefix")
    return bucket, key


def _dir_key(key: str) -> str:
    """A key as a directory prefix: ``a/b`` -> ``a/b/``; the bucket root stays ``""``."""
    return key.rstrip("/") + "/" if key.strip("/") else ""


def join(uri: str | os.PathLike[str], *parts: str) -> str:
    """``uri`` with ``parts`` appended (``/``-separated for S3, ``os.path.join`` locally)."""
    if not is_remote(uri):
        return str(Path(uri, *parts))
    out = str(uri).rstrip("/")
    for part in parts:
        part = part.strip("/")
        if part:
            out += "/" + part
    return out


def default_cache_dir() -> Path:
    """Where downloads are cached when no directory is given: ``$GRPOFLOW_CACHE_DIR``, else
    ``.cache/grpoflow`` (``storage.cache_dir``'s default)."""
    return Path(os.environ.get("GRPOFLOW_CACHE_DIR") or ".cache/grpoflow")


# ---------------------------------------------------------------- the S3 client


def resolve_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint to use: the argument, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``,
    or None for AWS itself."""
    for value in (
        endpoint_url,
        os.environ.get("AWS_ENDPOINT_URL_S3"),
        os.environ.get("AWS_ENDPOINT_URL"),
    ):
        if value:
            return value
    return None


def s3_env(endpoint_url: str | None) -> dict[str, str]:
    """Environment that points boto3 *and* MLflow's artifact store at ``endpoint_url``.

    Apply it to ``os.environ`` (and to the environment of workers) when the config sets
    ``storage.s3_endpoint_url``; empty when ``endpoint_url`` is None.
    """
    if not endpoint_url:
        return {}
    return {"AWS_ENDPOINT_URL_S3": endpoint_url, "MLFLOW_S3_ENDPOINT_URL": endpoint_url}


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def reset_clients() -> None:
    """Forget cached clients (after the endpoint or the credentials in the environment change)."""
    with _clients_lock:
        _clients.clear()


def _client(endpoint_url: str | None = None) -> Any:
    """A cached boto3 S3 client (one per process, endpoint, region and profile)."""
    endpoint = resolve_endpoint(endpoint_url)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    cache_key = (os.getpid(), endpoint, region, os.environ.get("AWS_PROFILE"), _max_attempts())
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is not None:
            return client
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            _raise(StorageError, "s3:// URIs need boto3, which is not installed: pip install boto3")
        options: dict[str, Any] = {
            "retries": {"max_attempts": _max_attempts(), "mode": "standard"},
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "max_pool_connections": MAX_CONCURRENCY * 2,
        }
        if endpoint:
            # S3-compatible stores: path-style addressing (no bucket DNS names), and integrity
            # checksums only where the API requires them (several stores reject the newer
            # default trailers); grpoflow's manifests check SHA-256 end to end anyway.
            options["s3"] = {"addressing_style": "path"}
            if not os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION"):
                options["request_checksum_calculation"] = "when_required"
            if not os.environ.get("AWS_RESPONSE_CHECKSUM_VALIDATION"):
                options["response_checksum_validation"] = "when_required"
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region or ("us-east-1" if endpoint else None),
            config=Config(**options),
        )
        _clients[cache_key] = client
        return client


def _max_attempts() -> int:
    """``AWS_MAX_ATTEMPTS`` when set (boto3's own variable), else :data:`MAX_ATTEMPTS`."""
    try:
        return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS))
    except ValueError:
        return MAX_ATTEMPTS


def _transfer_config(multipart_threshold: int | None, multipart_chunksize: int | None) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=multipart_threshold or MULTIPART_THRESHOLD,
        multipart_chunksize=multipart_chunksize or MULTIPART_CHUNKSIZE,
        max_concurrency=MAX_CONCURRENCY,
        use_threads=True,
    )


def _where(uri: str) -> str:
    endpoint = resolve_endpoint()
    return f"{uri} (endpoint {endpoint})" if endpoint else uri


def _translate(op: str, uri: str, exc: BaseException) -> StorageError:
    """A boto3/botocore failure -> a StorageError naming the URI, the operation and the fix."""
    where = _where(uri)
    # boto3's upload_file wraps the ClientError (S3UploadFailedError): look through it.
    inner = exc.__cause__ or exc.__context__
    if type(exc).__name__ == "S3UploadFailedError" and inner is not None:
        exc = inner
    code, message = "", str(exc)
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {}) or {}
        code = str(err.get("Code", ""))
        message = str(err.get("Message", "")) or message
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if not code and status:
            code = str(status)
    name = type(exc).__name__
    bucket = _split(uri)[0] if is_remote(uri) else ""
    if code == "NoSuchBucket":
        return BucketNotFound(
            redact(
                f"{op} {where}: bucket {bucket!r} does not exist; create the bucket or fix the "
                "URI in the config"
            )
        )
    if code in ("NoSuchKey", "404", "NotFound"):
        return NotFound(redact(f"{op} {where}: no such object; check the URI"))
    if code in (
        "AccessDenied",
        "403",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AllAccessDisabled",
    ):
        return StorageError(
            redact(
                f"{op} {where}: access denied ({code}); check the credentials boto3 finds "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the machine's role), "
                f"the bucket policy for {bucket!r}, and the endpoint (AWS_ENDPOINT_URL)"
            )
        )
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return StorageError(
            redact(
                f"{op} {where}: no usable S3 credentials ({name}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an instance/pod role"
            )
        )
    if name in (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
    ) or isinstance(exc, ConnectionError | TimeoutError):
        return Unreachable(
            redact(
                f"{op} {where}: the S3 endpoint cannot be reached ({name}: {message}) after "
                f"{_max_attempts()} attempts; check storage.s3_endpoint_url / AWS_ENDPOINT_URL and "
                "this machine's network"
            )
        )
    if code == "InvalidBucketName":
        return StorageError(
            redact(f"{op} {where}: invalid bucket name {bucket!r} (3-63 lowercase characters)")
        )
    detail = f"{code}: {message}" if code else f"{name}: {message}"
    return StorageError(redact(f"{op} {where} failed: {detail}"))


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


def _is_missing(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    return code in ("NoSuchKey", "404", "NotFound")


# ---------------------------------------------------------------- listing and small files


@dataclass(frozen=True)
class FileInfo:
    """One file under a prefix: its name relative to the prefix, size and version tag."""

    name: str
    size: int
    etag: str  # the S3 ETag; locally the modification time in ns


def stat(uri: str | os.PathLike[str]) -> FileInfo:
    """Size and ETag of one object (or local file); :class:`NotFound` if there is none."""
    if not is_remote(uri):
        p = Path(uri)
        if not p.is_file():
            _raise(NotFound, f"stat {p}: no such file")
        st = p.stat()
        return FileInfo(p.name, st.st_size, str(st.st_mtime_ns))
    uri = str(uri)
    bucket, key = _split(uri)
    if not key or key.endswith("/"):
        _raise(NotFound, f"stat {_where(uri)}: a prefix, not an object")
    with _s3_errors("stat", uri):
        try:
            head = _client().head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            if _is_missing(exc):
                _raise(NotFound, f"stat {_where(uri)}: no such object")
            raise
    return FileInfo(PurePosixPath(key).name, int(head["ContentLength"]), head["ETag"].strip('"'))


def exists(uri: str | os.PathLike[str]) -> bool:
    """Whether a file/object, or a directory/non-empty prefix, is at ``uri``."""
    if not is_remote(uri):
        return Path(uri).exists()
    uri = str(uri)
    bucket, key = _split(uri)
    with _s3_errors("exists", uri):
        if key and not key.endswith("/"):
            try:
                _client().head_object(Bucket=bucket, Key=key)
                return True
            except Exception as exc:
                if not _is_missing(exc):
                    raise
        resp = _client().list_objects_v2(Bucket=bucket, Prefix=_dir_key(key), MaxKeys=1)
    return bool(resp.get("KeyCount", 0))


def _pages(uri: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
    bucket, key = _split(uri)
    paginator = _client().get_paginator("list_objects_v2")
    yield from paginator.paginate(Bucket=bucket, Prefix=_dir_key(key), **kwargs)


def list_dirs(uri: str | os.PathLike[str]) -> list[str]:
    """Names of the immediate sub-directories (S3: common prefixes) of ``uri``, sorted."""
    if not is_remote(uri):
        p = Path(uri)
        return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []
    uri = str(uri)
    names: list[str] = []
    with _s3_errors("list", uri):
        for page in _pages(uri, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                names.append(common["Prefix"].rstrip("/").rsplit("/", 1)[-1])
    return sorted(names)


def list_files(uri: str | os.PathLike[str]) -> list[FileInfo]:
    """Every file under ``uri`` (recursively), names relative to it, sorted by name."""
    if not is_remote(uri):
        root = Path(uri)
        if not root.is_dir():
            return []
        out = []
        for f in sorted(root.rglob("*")):
            if f.is_file():
                st = f.stat()
                out.append(
                    FileInfo(f.relative_to(root).as_posix(), st.st_size, str(st.st_mtime_ns))
                )
        return out
    uri = str(uri)
    prefix = _dir_key(_split(uri)[1])
    out = []
    with _s3_errors("list", uri):
        for page in _pages(uri):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if name and not name.endswith("/"):  # skip "directory marker" objects
                    out.append(FileInfo(name, int(obj["Size"]), str(obj["ETag"]).strip('"')))
    return sorted(out, key=lambda f: f.name)


def fingerprint(uri: str | os.PathLike[str]) -> str:
    """A digest that changes when anything at ``uri`` changes (names, sizes, ETags/mtimes).

    Cheap (one listing, no download): use it to key caches of things derived from ``uri``.
    """
    try:
        one = stat(uri)
        entries = [["", one.size, one.etag]]
    except NotFound:
        entries = [[f.name, f.size, f.etag] for f in list_files(uri)]
    blob = json.dumps([str(uri), entries], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def read_bytes(uri: str | os.PathLike[str]) -> bytes:
    """The content of a small file or object (manifests, state); :class:`NotFound` if none."""
    if not is_remote(uri):
        p = Path(uri)
        if not p.is_file():
            _raise(NotFound, f"read {p}: no such file")
        return p.read_bytes()
    uri = str(uri)
    bucket, key = _split(uri)
    with _s3_errors("read", uri):
        try:
            return _client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as exc:
            if _is_missing(exc):
                _raise(NotFound, f"read {_where(uri)}: no such object")
            raise


def write_bytes(uri: str | os.PathLike[str], data: bytes) -> None:
    """Write a small file or object in one piece (locally: temp file, fsync, rename)."""
    if not is_remote(uri):
        p = Path(uri)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)
        return
    uri = str(uri)
    bucket, key = _split(uri)
    with _s3_errors("write", uri):
        _client().put_object(Bucket=bucket, Key=key, Body=data)


def delete(uri: str | os.PathLike[str]) -> None:
    """Delete one file or object; nothing happens if it does not exist."""
    if not is_remote(uri):
        Path(uri).unlink(missing_ok=True)
        return
    uri = str(uri)
    bucket, key = _split(uri)
    with _s3_errors("delete", uri):
        _client().delete_object(Bucket=bucket, Key=key)


def delete_prefix(uri: str | os.PathLike[str]) -> int:
    """Delete everything under the directory/prefix ``uri``; returns how many files went.

    ``s3://b/ckpt/step-000002`` deletes ``step-000002/...`` only, never ``step-0000020/``.
    Refuses a bucket root.
    """
    if not is_remote(uri):
        p = Path(uri)
        if p.is_dir():
            count = sum(1 for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p)
            return count
        return 0
    uri = str(uri)
    bucket, key = _split(uri)
    if not key.strip("/"):
        _raise(StorageError, f"delete {uri}: refusing to delete a whole bucket; name a prefix")
    deleted = 0
    with _s3_errors("delete", uri):
        for page in _pages(uri):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if not keys:
                continue
            resp = _client().delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            errors = resp.get("Errors", [])
            if errors:
                first = errors[0]
                _raise(
                    StorageError,
                    f"delete {_where(uri)}: {len(errors)} object(s) could not be deleted "
                    f"(first: {first.get('Key')}: {first.get('Code')} {first.get('Message')}); "
                    "check the credentials' s3:DeleteObject permission",
                )
            deleted += len(keys)
    return deleted


# ---------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def _safe_name(name: str, uri: str) -> PurePosixPath:
    """A manifest entry as a relative path that cannot escape the destination."""
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\\" in name:
        _raise(StorageError, f"{uri}: the manifest names an unsafe path {name!r}; not using it")
    return rel


def download_file(
    uri: str | os.PathLike[str],
    local: str | os.PathLike[str],
    *,
    multipart_threshold: int | None = None,
    multipart_chunksize: int | None = None,
) -> Path:
    """Copy one object (or file) to ``local``, atomically (temp name, then rename)."""
    dest = Path(local)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        if is_remote(uri):
            uri = str(uri)
            bucket, key = _split(uri)
            with _s3_errors("download", uri):
                try:
                    _client().download_file(
                        bucket,
                        key,
                        str(tmp),
                        Config=_transfer_config(multipart_threshold, multipart_chunksize),
                    )
                except Exception as exc:
                    if _is_missing(exc):
                        _raise(NotFound, f"download {_where(uri)}: no such object")
                    raise
        else:
            if not Path(uri).is_file():
                _raise(NotFound, f"copy {uri}: no such file")
            shutil.copyfile(uri, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def upload_file(
    local: str | os.PathLike[str],
    uri: str | os.PathLike[str],
    *,
    multipart_threshold: int | None = None,
    multipart_chunksize: int | None = None,
) -> None:
    """Copy one local file to ``uri`` (multipart above the threshold)."""
    src = Path(local)
    if not src.is_file():
        _raise(NotFound, f"upload {src}: no such file")
    if not is_remote(uri):
        _copy_local(src, Path(uri))
        return
    uri = str(uri)
    bucket, key = _split(uri)
    with _s3_errors("upload", uri):
        _client().upload_file(
            str(src), bucket, key, Config=_transfer_config(multipart_threshold, multipart_chunksize)
        )


def _copy_local(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- directories


def build_manifest(
    local: str | os.PathLike[str], *, manifest_name: str = MANIFEST
) -> dict[str, Any]:
    """``{"created": ..., "files": {name: {"bytes", "sha256"}}}`` of every file under ``local``
    (the manifest itself left out)."""
    root = Path(local)
    files = {
        f.relative_to(root).as_posix(): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(root.rglob("*"))
        if f.is_file() and f.relative_to(root).as_posix() != manifest_name
    }
    return {"created": time.time(), "files": files}


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e6:.1f} MB in {seconds:.1f}s ({nbytes / 1e6 / max(seconds, 1e-6):.0f} MB/s)"


def upload_dir(
    local: str | os.PathLike[str],
    uri: str | os.PathLike[str],
    *,
    manifest_name: str = MANIFEST,
    manifest: Mapping[str, Any] | None = None,
    multipart_threshold: int | None = None,
    multipart_chunksize: int | None = None,
) -> dict[str, Any]:
    """Upload every file under ``local`` to the prefix ``uri``; the manifest goes LAST.

    The manifest (``{"files": {name: {"bytes", "sha256"}}, ...}``) is computed here, or the
    caller passes ``manifest`` when it has just computed one (a checkpoint); then only sizes
    are re-checked. Any manifest already at the destination is deleted first, so while the upload
    runs the prefix reads as incomplete. Files already there and not in the new manifest are
    left alone (they are ignored by :func:`download_dir`). Returns the manifest.
    """
    src = Path(local)
    if not src.is_dir():
        _raise(NotFound, f"upload {src}: no such directory")
    uri = str(uri)
    if manifest is None:
        manifest = build_manifest(src, manifest_name=manifest_name)
    manifest = dict(manifest)
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
    if is_remote(uri):
        bucket, key = _split(uri)
        prefix = _dir_key(key)
        from boto3.s3.transfer import create_transfer_manager

        config = _transfer_config(multipart_threshold, multipart_chunksize)
        with (
            _s3_errors("upload", uri),
            _progress(total, f"upload {uri}") as progress,
            create_transfer_manager(_client(), config) as manager,
        ):
            futures = [
                manager.upload(
                    str(src / name), bucket, prefix + name, subscribers=progress.subscribers()
                )
                for name in files
            ]
            for future in futures:
                future.result()
    else:
        dest = Path(uri)
        for name in files:
            _copy_local(src / name, dest / name)
    write_bytes(manifest_uri, json.dumps(manifest, indent=1, sort_keys=True).encode())
    log.info(
        "uploaded %s: %s, manifest written last", uri, _rate(total, time.perf_counter() - started)
    )
    return manifest


def read_manifest(uri: str | os.PathLike[str], *, manifest_name: str = MANIFEST) -> dict[str, Any]:
    """The manifest of the directory ``uri``; :class:`ManifestMissing` if it has none."""
    uri = str(uri)
    try:
        raw = read_bytes(join(uri, manifest_name))
    except BucketNotFound:
        raise
    except NotFound:
        _raise(
            ManifestMissing,
            f"{_where(uri)} has no {manifest_name}: it is an interrupted or foreign upload and "
            "is not used; upload it again (grpoflow writes the manifest last)",
        )
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
        for name, meta in files.items():
            _safe_name(name, uri)
            if not isinstance(meta["bytes"], int) or not isinstance(meta["sha256"], str):
                raise TypeError(f"{name}: bytes must be an integer and sha256 a string")
    except (ValueError, KeyError, TypeError) as exc:
        _raise(ManifestMissing, f"{_where(uri)}: {manifest_name} is not a valid manifest ({exc})")
    return manifest


def download_dir(
    uri: str | os.PathLike[str],
    local: str | os.PathLike[str],
    *,
    manifest_name: str = MANIFEST,
    require_manifest: bool = True,
    include: Callable[[str], bool] | None = None,
    multipart_threshold: int | None = None,
    multipart_chunksize: int | None = None,
) -> dict[str, Any]:
    """Download the directory ``uri`` into ``local``, verified, atomically.

    With a manifest, exactly the files it lists are fetched and each one's size and SHA-256
    must match (:class:`ChecksumMismatch` names the file otherwise); the manifest is written
    into ``local`` too. Without one, :class:`ManifestMissing` is raised, unless
    ``require_manifest=False`` (a directory grpoflow did not upload, such as a base model
    synced by other tools): then every listed file is fetched and its size checked against
    the listing. ``include(name)`` narrows the files fetched. Everything lands in a temporary
    sibling directory first and is renamed onto ``local`` (replacing it) only when complete.
    Returns the manifest (with ``"verified": "sha256"`` or ``"size"``).
    """
    uri = str(uri)
    dest = Path(local)
    try:
        manifest = read_manifest(uri, manifest_name=manifest_name)
        verified = "sha256"
    except ManifestMissing:
        if require_manifest or exists(join(uri, manifest_name)):
            raise
        listing = list_files(uri)
        if not listing:
            _raise(NotFound, f"download {_where(uri)}: nothing there; check the URI")
        manifest = {"files": {f.name: {"bytes": f.size} for f in listing}}
        verified = "size"
    files: dict[str, dict[str, Any]] = {
        name: meta for name, meta in manifest["files"].items() if include is None or include(name)
    }
    total = sum(int(m["bytes"]) for m in files.values())
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    started = time.perf_counter()
    log.info("downloading %d files (%.1f MB) from %s to %s", len(files), total / 1e6, uri, dest)
    try:
        _fetch(uri, tmp, files, multipart_threshold, multipart_chunksize, total)
        for name, meta in files.items():
            path = tmp / _safe_name(name, uri)
            size = path.stat().st_size
            if size != int(meta["bytes"]):
                _raise(
                    ChecksumMismatch,
                    f"download {_where(uri)}: {name} has {size} bytes, the manifest says "
                    f"{meta['bytes']}; the stored copy is damaged or was overwritten since the upload, "
                    "so it is not used: upload the directory again",
                )
            if "sha256" in meta and _sha256(path) != meta["sha256"]:
                _raise(
                    ChecksumMismatch,
                    f"download {_where(uri)}: {name} does not match its SHA-256 in "
                    f"{manifest_name}; the stored copy is damaged or was overwritten since the "
                    "upload, so it is not used: upload the directory again",
                )
        if verified == "sha256":
            (tmp / manifest_name).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if dest.exists():
            aside = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(dest, aside)
            os.rename(tmp, dest)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "downloaded %s: %s, verified (%s)",
        uri,
        _rate(total, time.perf_counter() - started),
        verified,
    )
    return {**manifest, "verified": verified}


def _fetch(
    uri: str,
    tmp: Path,
    files: Mapping[str, Any],
    multipart_threshold: int | None,
    multipart_chunksize: int | None,
    total: int,
) -> None:
    if not is_remote(uri):
        for name in files:
            source = Path(uri) / name
            if not source.is_file():
                _raise(NotFound, f"copy {uri}: {name} is listed in the manifest but missing")
            _copy_local(source, tmp / name)
        return
    bucket, key = _split(uri)
    prefix = _dir_key(key)
    from boto3.s3.transfer import create_transfer_manager

    config = _transfer_config(multipart_threshold, multipart_chunksize)
    for name in files:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
    with (
        _s3_errors("download", uri),
        _progress(total, f"download {uri}") as progress,
        create_transfer_manager(_client(), config) as manager,
    ):
        futures = {
            name: manager.download(
                bucket, prefix + name, str(tmp / name), subscribers=progress.subscribers()
            )
            for name in files
        }
        for name, future in futures.items():
            try:
                future.result()
            except Exception as exc:
                if _is_missing(exc):
                    _raise(
                        ChecksumMismatch,
                        f"download {_where(uri)}: {name} is listed in the manifest but missing; "
                        "the upload is damaged, so it is not used: upload the directory again",
                    )
                raise


# ---------------------------------------------------------------- progress


class _Progress:
    """A tqdm bar for transfers large enough to take a while (off when stderr is no TTY)."""

    def __init__(self, total: int, label: str) -> None:
        self.bar = None
        if total >= 256 * MIB:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=redact(label),
                disable=None,
                leave=False,
            )

    def subscribers(self) -> list[Any]:
        if self.bar is None:
            return []
        from s3transfer.subscribers import BaseSubscriber

        bar = self.bar

        class _Sub(BaseSubscriber):
            def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
                bar.update(bytes_transferred)

        return [_Sub()]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[_Progress]:
    progress = _Progress(total, label)
    try:
        yield progress
    finally:
        progress.close()
