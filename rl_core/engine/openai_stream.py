"""OpenAI's streaming form (server-sent events) of a finished chat or text completion.

The engine's OpenAI routes and the agent gateway's sessions answer ``stream=true`` from the
same finished completion they would return whole, so a streamed turn has exactly the tokens,
log-probs and tool calls of the unstreamed one, and a session records the same trajectory
either way. :func:`stream_chunks` splits a response body into ``chat.completion.chunk`` (or
``text_completion``) chunks: the role, the text token by token (each piece with its token's
log-prob entry when asked), the tool calls as deltas, the ``finish_reason``, and with
``stream_options.include_usage`` a last chunk with the usage; :func:`sse_response` frames them
as ``data: {json}`` events ending in ``data: [DONE]``. Never generates, never re-tokenizes:
the pieces are cut from the text already returned.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

__all__ = ["sse_response", "stream_chunks", "text_pieces"]

def text_pieces(tokenizer: Any, ids: Sequence[int], text: str, *,  # noqa: ANN401
                skip_special_tokens: bool = True) -> list[str]:
    """``text`` cut into one piece per token of ``ids`` (the text those ids decode to, cut at
    a stop): joined, the pieces are ``text`` exactly. Incremental detokenization, as Hugging
    Face's ``TextStreamer`` and vLLM do it: a token whose text is not complete yet (part of a
    multi-byte character) gets an empty piece and the character goes with the token that
    completes it; so does a token that shows nothing (a stop token)."""
    if not ids:
        return [text] if text else []
    ends, at, prefix, read = [], 0, 0, 0

    def decode(part: Sequence[int]) -> str:
        return tokenizer.decode(list(part), skip_special_tokens=skip_special_tokens)

    for t in range(len(ids)):
        if tokenizer is not None:
            new, old = decode(ids[prefix : t + 1]), decode(ids[prefix:read])
            if len(new) > len(old) and not new.endswith("\ufffd"):
                at = min(len(text), at + len(new) - len(old))
                prefix, read = read, t + 1
        ends.append(at)
    ends[-1] = len(text)
    return [text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _chunk(body: dict[str, Any], choices: list[dict[str, Any]],
           include_usage: bool) -> dict[str, Any]:
    chat = body["object"] == "chat.completion"
    out = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
           "created": body["created"], "model": body["model"], "choices": choices}
    if include_usage:
        out["usage"] = None
    return out


def stream_chunks(body: dict[str, Any], pieces: Sequence[Sequence[str]], *,
                  include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The chunks of ``body`` (a ``chat.completion`` or ``text_completion`` as the routes
    return it), choice by choice; ``pieces[i]``: choice i's text per token
    (:func:`text_pieces`), aligned with its log-prob entries when it has them."""
    chat = body["object"] == "chat.completion"
    for choice, parts in zip(body["choices"], pieces, strict=True):
        i, lp = choice["index"], choice.get("logprobs")
        if chat:
            msg = choice["message"]
            yield _chunk(body, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], include_usage)
            entries = (lp or {}).get("content") or []
            for k, piece in enumerate(parts):
                logprobs = ({"content": entries[k : k + 1], "refusal": None}
                            if lp is not None and k < len(entries) else None)
                yield _chunk(body, [{"index": i, "delta": {"content": piece},
                                     "logprobs": logprobs, "finish_reason": None}], include_usage)
            calls = msg.get("tool_calls") or []
            if calls:
                yield _chunk(body, [{"index": i, "delta": {"tool_calls": [
                    {"index": j, **c} for j, c in enumerate(calls)]},
                    "logprobs": None, "finish_reason": None}], include_usage)
            last: dict[str, Any] = {"index": i, "delta": {}, "logprobs": None}
        else:
            for k, piece in enumerate(parts):
                logprobs = None
                if lp is not None and k < len(lp["tokens"]):
                    tops = lp.get("top_logprobs")
                    logprobs = {"tokens": lp["tokens"][k : k + 1],
                                "token_logprobs": lp["token_logprobs"][k : k + 1],
                                "top_logprobs": None if tops is None else tops[k : k + 1],
                                "text_offset": lp["text_offset"][k : k + 1]}
                yield _chunk(body, [{"index": i, "text": piece, "logprobs": logprobs,
                                     "finish_reason": None}], include_usage)
            last = {"index": i, "text": "", "logprobs": None}
        last.update({k: v for k, v in choice.items()
                     if k in ("finish_reason", "matched_stop", "token_ids", "prompt_token_ids")})
        yield _chunk(body, [last], include_usage)
    if include_usage:
        yield {**_chunk(body, [], False), "usage": body["usage"]}


def sse_response(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    """``chunks`` as server-sent events, then ``data: [DONE]``."""
    def events() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
