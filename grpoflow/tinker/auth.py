"""Who is calling, and how much they may send: :class:`KeyTable` maps an ``X-API-Key`` to the
caller's identity (a tenant's name, or a digest of a plain key) comparing SHA-256 digests in
constant time, and :class:`BodyLimit` answers 413 to a request body over the bound.

Keys are never stored or logged: a tenant is configured by the SHA-256 hex digests of its keys
(:func:`hash_key`; ``printf %s "$KEY" | sha256sum`` gives the same), and plain keys are turned
into digests when the app is built.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import HTTPException

__all__ = ["BodyLimit", "KeyTable", "check_tenants", "hash_key", "owner_of"]

_DIGEST = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PLAIN_PREFIX = "user-"  # the identity of a plain (non-tenant) key: user-<digest prefix>


def hash_key(key: str) -> str:
    """The SHA-256 hex digest a ``tenants`` entry lists for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of(api_key: str) -> str:
    """The identity a plain API key stands for (a digest: the key itself is never stored)."""
    return PLAIN_PREFIX + hash_key(api_key)[:16]


def check_tenants(tenants: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """``tenants`` (name -> SHA-256 hex digests of its keys) checked and normalised; a
    ValueError names the problem (a malformed name or digest, a digest listed twice)."""
    out: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for name, digests in tenants.items():
        if not isinstance(name, str) or not _TENANT.fullmatch(name) or name.startswith(
                PLAIN_PREFIX):
            raise ValueError(f"tenant name {name!r}: 1-64 letters, digits and ._- starting with "
                             f"a letter or digit, not starting with {PLAIN_PREFIX!r}")
        if isinstance(digests, str):
            digests = [digests]
        clean = []
        for i, d in enumerate(digests or []):
            d = str(d).strip().lower()
            if not _DIGEST.fullmatch(d):  # never echo it: it may be a key pasted by mistake
                raise ValueError(f"tenant {name!r}: entry {i + 1} is not a SHA-256 hex digest "
                                 "(64 hex characters); list the digest of each key, not the "
                                 "key: printf %s \"$KEY\" | sha256sum")
            if d in seen:
                raise ValueError(f"tenants {seen[d]!r} and {name!r} list the same key digest")
            seen[d] = name
            clean.append(d)
        if not clean:
            raise ValueError(f"tenant {name!r} lists no key digest")
        out[name] = clean
    return out


class KeyTable:
    """The accepted keys: tenants' digests (identity: the tenant's name) and plain keys
    (identity: :func:`owner_of`); with neither, any ``tml-`` key (identity: its digest)."""

    def __init__(self, api_keys: Iterable[str] | None = None,
                 tenants: Mapping[str, Iterable[str]] | None = None) -> None:
        keys = None if api_keys is None else [str(k) for k in api_keys]
        if keys is not None and not keys:
            raise ValueError("api_keys is empty: no request could authenticate (None: any "
                             "tml- key)")
        self.open = keys is None and not tenants
        entries = [(bytes.fromhex(d), name) for name, ds in check_tenants(tenants or {}).items()
                   for d in ds]
        plain = [(hashlib.sha256(k.encode()).digest(), None) for k in keys or []]
        self._entries: list[tuple[bytes, str | None]] = entries + plain

    def owner(self, key: str) -> str | None:
        """The identity ``key`` stands for, or None when it is not accepted. Every entry is
        compared (constant time in the key and in which entry matches)."""
        digest = hashlib.sha256(key.encode()).digest()
        if self.open:
            return owner_of(key) if key.startswith("tml-") and len(key) > 4 else None
        found: str | None = None
        matched = False
        for d, name in self._entries:
            if hmac.compare_digest(digest, d) and not matched:
                matched, found = True, name
        if not matched:
            return None
        return found if found is not None else owner_of(key)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (by its Content-Length, or counted as
    it arrives) is answered 413 with a JSON ``detail``. The body is read and dropped first (up
    to ``drain_bytes``), so that the client, which sends all of it before reading the answer,
    sees the 413 rather than a broken connection (which the SDK would retry for minutes)."""

    def __init__(self, app: Any, max_bytes: int, drain_bytes: int | None = None) -> None:  # noqa: ANN401
        self.app, self.max_bytes = app, int(max_bytes)
        self.drain_bytes = drain_bytes if drain_bytes is not None else max(
            8 * self.max_bytes, 64 << 20)

    def message(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else "a request body"
        return (f"{got} is over this server's limit of {self.max_bytes} bytes per request "
                "(max_body_bytes); send fewer or shorter datums per call")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive, 0)
            await self._refuse(send, int(length))
            return
        seen = 0
        started = False

        async def limited() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    if msg.get("more_body"):
                        seen = await self._drain(receive, seen)
                    # FastAPI re-raises its HTTPException from body parsing: the app's handler
                    # answers it as {"detail": ...} with this status
                    raise HTTPException(413, self.message(seen))
            return msg

        async def watched(msg: dict[str, Any]) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited, watched)
        except HTTPException as exc:
            if started or exc.status_code != 413:
                raise
            await self._refuse(send, seen)

    async def _drain(self, receive: Any, seen: int) -> int:  # noqa: ANN401
        while seen <= self.drain_bytes:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            seen += len(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        return seen

    async def _refuse(self, send: Any, size: int | None) -> None:  # noqa: ANN401
        body = json.dumps({"detail": self.message(size)}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"x-should-retry", b"false")]})
        await send({"type": "http.response.body", "body": body})
