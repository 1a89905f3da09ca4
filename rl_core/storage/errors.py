"""The errors of :mod:`rl_core.storage`: each names the URI, the operation and the fix, and
is redacted; botocore's error codes are sorted into them here."""

from __future__ import annotations

from typing import NoReturn

from rl_core.secrets import redact

__all__ = ["BucketNotFound", "ChecksumMismatch", "ManifestMissing", "NotFound", "StorageError",
           "Unreachable"]


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


_MISSING = ("NoSuchKey", "404", "NotFound")
_DENIED = ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "AllAccessDisabled")
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
_NETWORK = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
            "ConnectionClosedError", "ProxyConnectionError")


def _code(exc: BaseException) -> tuple[str, str]:
    """``(code or HTTP status, message)`` of a botocore ``ClientError``, else ``("", str(exc))``."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", str(exc)
    err = response.get("Error", {}) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(err.get("Code", "") or status or ""), str(err.get("Message", "")) or str(exc)
