"""A gateway session's streamed turn: OpenAI's server-sent events as the tokens are sampled.

A plane that takes a per-token hook (the in-process plane) feeds :class:`TokenFeed` from the
thread that drives the engine; :func:`live_response` sends each token's chunk (its text and,
when asked, its log-prob entry with the top-k alternatives) as soon as the next token shows it
is safe: the text runs one token behind (the last token may be a stop token the answer drops),
holds back whatever may start a stop string, and never splits a character. When the turn is
done the rest goes out as the unstreamed answer would stream it (engine/openai_stream.py: the
remaining text, the tool calls whole, the ``finish_reason``, the usage), after the turn is
recorded exactly as an unstreamed one. An error after the first chunk is an ``error`` event
(what SGLang and OpenAI send mid-stream), and the turn is not recorded. The session is freed
when the stream ends however it ends, a client gone before its first byte included
(:class:`~rl_core.engine.generate_stream.GuardedStream`). Never re-tokenizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from rl_core.engine.generate_stream import GuardedStream
from rl_core.engine.openai_stream import stream_chunks, text_pieces
from rl_core.engine.routes_openai import (
    OpenAIError,
    OpenAIRequest,
    chat_choice,
    completion_choice,
)

__all__ = ["LiveText", "TokenFeed", "consume", "live_response"]

log = logging.getLogger(__name__)


class TokenFeed:
    """A streamed request's per-token hook: hands each ``(token, logprob, top)`` from the
    plane's thread to the handler's event loop (never raises)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue[tuple[int, float, Any]]()

    def __call__(self, token: int, logp: float, top: list[list[Any]] | None) -> None:
        with contextlib.suppress(RuntimeError):  # the server's loop is gone
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, logp, top))


class LiveText:
    """A turn's text as its tokens arrive: :meth:`push` returns what may be sent now."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], *,  # noqa: ANN401
                 skip_special_tokens: bool = True) -> None:
        self.tok, self.stop, self.skip = tokenizer, [s for s in stop if s], skip_special_tokens
        self.ids: list[int] = []
        self.text, self.sent = "", 0  # the decoded text of ids[:-1]; how much of it went out
        self._prefix = self._read = 0  # incremental detokenization (as vLLM's)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        """Add ``token``; the text newly safe to send (the previous tokens')."""
        self.ids.append(token)
        t = len(self.ids) - 2  # the token whose text may show now
        if t < 0 or self.tok is None:
            return ""
        new = self._decode(self.ids[self._prefix : t + 1])
        old = self._decode(self.ids[self._prefix : self._read])
        if len(new) > len(old) and not new.endswith("\ufffd") and new.startswith(old):
            self.text += new[len(old):]
            self._prefix, self._read = self._read, t + 1
        end = len(self.text)
        for s in self.stop:  # never past a stop string, nor into what may begin one
            if (at := self.text.find(s, max(0, self.sent - len(s)))) >= 0:
                end = min(end, at)
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    end = min(end, len(self.text) - n)
                    break
        piece = self.text[self.sent : max(self.sent, end)]
        self.sent += len(piece)
        return piece

    def rest(self, final: str) -> str:
        """What of the finished turn's text ``final`` was not sent."""
        sent = self.text[: self.sent]
        if not final.startswith(sent):  # a tokenizer whose pieces do not add up
            log.warning("streamed text %r is not a prefix of the turn's text %r", sent, final)
            return ""
        return final[len(sent):]


def consume(f: asyncio.Future) -> None:
    """Retrieve a finished wait's outcome (an abandoned one's error is no one's)."""
    if not f.cancelled():
        f.exception()


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


class _Chunks:
    """The chunks of one streamed turn (one choice), in the engine's stream layout."""

    def __init__(self, req: OpenAIRequest, tokenizer: Any, head: dict[str, Any]) -> None:  # noqa: ANN401
        self.req, self.tok, self.head = req, tokenizer, head
        self.chat, self.offset, self.pieces = req.kind == "chat", 0, []

    def body(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [choice]}

    def role(self) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None}
        return next(stream_chunks(self.body(choice), [[]], include_usage=self.req.include_usage))

    def token(self, token: int, logp: float, top: Any, piece: str) -> dict[str, Any]:  # noqa: ANN401
        """The chunk of one token: its text piece and log-prob entry."""
        req, tops = self.req, None if top is None else [top]
        if self.chat:
            choice = chat_choice(0, self.tok, [token], [logp], {}, req, key="", text=piece,
                                 top=tops)
        else:
            choice = completion_choice(0, self.tok, [token], [logp], {}, req, text=piece, top=tops)
            if choice["logprobs"] is not None:
                choice["logprobs"]["text_offset"] = [self.offset]
                self.offset += len(choice["logprobs"]["tokens"][0])
        self.pieces.append(piece)
        chunks = stream_chunks(self.body(choice), [[piece]], include_usage=req.include_usage)
        return list(chunks)[1 if self.chat else 0]

    def tail(self, body: dict[str, Any], ids: Sequence[int], rest: str) -> list[dict[str, Any]]:
        """The finished turn's chunks after those already sent: its other tokens' pieces
        (``rest``: the text not sent yet; the last token is never sent before the end), the
        tool calls, the finish, the usage."""
        k = len(self.pieces)
        more = text_pieces(self.tok, ids[k:], rest, skip_special_tokens=self.req.skip_special_tokens)
        chunks = stream_chunks(body, [[*self.pieces, *more]], include_usage=self.req.include_usage)
        return list(chunks)[(1 if self.chat else 0) + k:]


async def live_response(
    feed: TokenFeed, first: tuple[int, float, Any], req: OpenAIRequest, tokenizer: Any,  # noqa: ANN401
    head: dict[str, Any], stop: Sequence[str], outcome: Callable[[float], Awaitable[Any]],  # noqa: E501
    finish: Callable[[Any], tuple[dict[str, Any], list[int]]], deadline: float,
    release: Callable[[], None],
) -> StreamingResponse:
    """The streamed turn from its ``first`` token on. ``outcome(timeout)``: waits for the
    generation, the session's close or ``timeout`` (whichever first) and returns the done
    generation, else raises :class:`OpenAIError`; ``finish(done)`` checks and records the turn and returns its body
    and completion ids (raising :class:`OpenAIError`); ``release()`` runs once when the
    stream ends, however it ends (its client gone before the first byte included)."""
    text = LiveText(tokenizer, stop, skip_special_tokens=req.skip_special_tokens)
    chunks = _Chunks(req, tokenizer, head)
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            release()

    async def events() -> AsyncIterator[str]:
        try:
            yield _event(chunks.role())
            text.push(first[0])
            prev, done = first, None
            while done is None:
                getter = asyncio.ensure_future(feed.queue.get())
                waiter = asyncio.ensure_future(outcome(max(0.0, deadline - time.monotonic())))
                waiter.add_done_callback(consume)
                await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    done = waiter.result()  # the turn is over (or the error to send)
                    break
                waiter.cancel()
                nxt = getter.result()
                piece = text.push(nxt[0])  # the previous token's text is safe now
                yield _event(chunks.token(*prev, piece))
                prev = nxt
            body, ids = finish(done)  # recorded, as an unstreamed turn is
            choice = body["choices"][0]
            final = (choice["message"]["content"] if chunks.chat else choice["text"]) or ""
            for chunk in chunks.tail(body, ids, text.rest(final)):
                yield _event(chunk)
        except OpenAIError as e:
            yield _event({"error": {"message": str(e), "type": e.type, "param": e.param,
                                    "code": e.code}})
        finally:
            release_once()
        yield "data: [DONE]\n\n"

    return GuardedStream(events(), release_once)
