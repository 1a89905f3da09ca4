"""What the rollout client reads from and writes into SGLang's HTTP bodies: a server's error
message in its own words, and fresh request ids for a retried request."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["error_message", "retry_rids"]


def error_message(resp: httpx.Response) -> str:
    """The server's own words: SGLang sends ``message`` or ``error.message`` or plain text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or resp.reason_phrase
    if isinstance(body, dict):
        if isinstance(err := body.get("error"), dict) and err.get("message"):
            return str(err["message"])
        if key := next((k for k in ("message", "detail", "error") if body.get(k)), None):
            return str(body[key])
    return str(body)[:500]


def retry_rids(body: Any, attempt: int) -> Any:
    """Fresh ids for a retry, with the original as prefix: the engine that timed out may
    still hold the old one, and ``/abort_request`` matches by prefix."""
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(rid, str):
        return {**body, "rid": f"{rid}-retry{attempt}"}
    if isinstance(rid, list):
        return {**body, "rid": [f"{r}-retry{attempt}" for r in rid]}
    return body
