"""What the rollout client reads from and writes into SGLang's HTTP bodies: a server's error
message in its own words, fresh request ids for a retried request, and a streamed
``/generate``'s server-sent events (:class:`StreamedGenerate`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from rl_core.errors import RolloutError

__all__ = ["StreamedGenerate", "TokenHook", "error_message", "retry_rids"]

# A streamed request's hook: (token id, log-prob, its top-k alternatives or None) per token.
TokenHook = Callable[[int, float, list[list[Any]] | None], None]


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


class StreamedGenerate:
    """One ``/generate`` with ``"stream": true`` (SGLang's cumulative events; a batch's carry
    their ``index``): each prompt's hook sees each new token as its event arrives, and
    :meth:`send` returns the finished answer as the unstreamed call's response (each
    request's last event, the body the server would have answered). Kept across a request's
    attempts: a retry's tokens that the hooks already saw are checked, not shown again; a
    retry that samples other tokens than they saw raises :class:`RolloutError` (never
    retried: what went out cannot be taken back). An ``error`` event is answered as an HTTP
    error of its ``code`` (400 without one: SGLang sends its request errors so)."""

    def __init__(self, hooks: Sequence[TokenHook | None], *, single: bool,
                 n: int = 1) -> None:
        if len(hooks) != n:
            raise ValueError(f"{len(hooks)} token hooks for {n} prompts")
        self.hooks, self.single = list(hooks), single
        self.seen: list[list[int]] = [[] for _ in self.hooks]  # what each hook was shown

    async def send(self, http: httpx.AsyncClient, method: str, url: str, body: Any,
                   headers: dict[str, str] | None) -> httpx.Response:
        async with http.stream(method, url, json=body, headers=headers) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                return resp
            last: dict[int, dict[str, Any]] = {}
            acc: dict[tuple[int, str], list[Any]] = {}  # this attempt's log-probs so far
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return self._answer(resp, last)
                event = json.loads(data)
                if isinstance(err := event.get("error"), dict):
                    code = err.get("code") if isinstance(err.get("code"), int) else 400
                    return httpx.Response(code, json=event, request=resp.request)
                i = int(event.pop("index", 0))
                self._tokens(i, event, acc)
                last[i] = event
        raise httpx.RemoteProtocolError(f"{url}: the event stream ended before data: [DONE]")

    def _tokens(self, i: int, event: dict[str, Any], acc: dict[tuple[int, str], list[Any]]
                ) -> None:
        """Show hook ``i`` the event's tokens it has not seen. Log-probs shorter than the
        cumulative ``output_ids`` are deltas (SGLang versions that send them so): gathered."""
        meta = event.get("meta_info") or {}
        ids = [int(t) for t in event.get("output_ids") or []]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if (got := meta.get(key)) is not None:
                have = acc.setdefault((i, key), [])
                have[:] = [*have, *got] if len(got) < len(ids) else got
                meta[key] = list(have)
        entries = meta.get("output_token_logprobs") or []
        ids = [int(e[1]) for e in entries] if entries else ids
        tops, seen, hook = meta.get("output_top_logprobs"), self.seen[i], self.hooks[i]
        for p in range(len(ids)):
            if p < len(seen):
                if ids[p] != seen[p]:
                    raise RolloutError(
                        f"a retried streamed request sampled token {ids[p]} at position {p} "
                        f"where its first attempt streamed {seen[p]}: the stream cannot go on")
                continue
            seen.append(ids[p])
            if hook is not None:
                hook(ids[p], float(entries[p][0]) if entries else math.nan,
                     tops[p] if tops and p < len(tops) else None)

    def _answer(self, resp: httpx.Response, last: dict[int, dict[str, Any]]) -> httpx.Response:
        n = len(self.hooks)
        if sorted(last) != list(range(n)) or any(
                not (e.get("meta_info") or {}).get("finish_reason") for e in last.values()):
            raise httpx.RemoteProtocolError(
                f"the event stream ended without the finished answer of each of {n} requests")
        items = [last[i] for i in range(n)]
        return httpx.Response(200, json=items[0] if self.single else items,
                              request=resp.request)
