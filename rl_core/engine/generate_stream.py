"""``/generate`` with ``"stream": true``: SGLang's server-sent events as the tokens are sampled.

Each event is ``data: {json}\\n\\n`` with one request's answer so far, cumulative as SGLang's
default (``text``, ``output_ids``, ``meta_info`` with ``finish_reason: null`` until the last,
``output_token_logprobs`` and ``output_top_logprobs`` when asked); a batch's (or ``n > 1``'s)
events carry the request's ``index`` (SGLang's ``_handle_batch_request``), in the order the
tokens come. A request's last event is exactly its unstreamed answer (:func:`response_item`).
The stream ends with ``data: [DONE]``; an error on the way (an abort with a status code, a
failed engine) is ``data: {"error": {"message", "code"}}`` first. A client that goes away,
before or during the stream, has its unfinished requests aborted. The tokens come from the
engine's per-request ``on_token`` hook (engine/requests.py). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.protocol import ItemOpts, response_item

__all__ = ["GuardedStream", "sse", "stream_generate"]

DONE = "data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body)}\n\n"


class GuardedStream(StreamingResponse):
    """A server-sent event stream whose ``on_close`` runs once when the response ends, however
    it ends: finished, failed, or its client gone before the body's first byte (Starlette then
    cancels the body before it starts, and a generator's ``finally`` never runs)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close: Callable[[], None] | None = on_close

    def close_once(self) -> None:
        close, self._on_close = self._on_close, None
        if close is not None:
            close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close_once()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:  # a generator left at a yield: its finally runs now
                with contextlib.suppress(Exception):
                    await asyncio.shield(aclose())


class _Refused(Exception):
    """A request aborted with a status code (SGLang answers such an abort as an error)."""


def _partial(i: int, req: GenerateRequest, opt: ItemOpts, ids: list[int], lps: list[float],
             tops: list[Any], eng: EmbeddedEngine) -> dict[str, Any]:
    """Request ``i``'s answer so far (not finished): SGLang's cumulative stream chunk."""
    tok = eng.tokenizer
    meta: dict[str, Any] = {"id": req.rid, "finish_reason": None,
                            "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids),
                            "cached_tokens": 0, "weight_version": eng.weight_version}
    if opt.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        meta["output_token_logprobs_length"] = len(ids)
        if opt.top_logprobs_num:
            meta["output_top_logprobs"] = [[[v, int(t), None] for v, t in top] for top in tops]
    text = tok.decode(ids, skip_special_tokens=opt.skip_special_tokens) if tok is not None else ""
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def stream_generate(eng: EmbeddedEngine, reqs: Sequence[GenerateRequest], opts: Sequence[ItemOpts],
                    single: bool) -> GuardedStream:
    """Queue ``reqs`` (all or none, as the unstreamed route; raises its errors before any byte
    is sent) and stream their tokens as SGLang does."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    n = len(reqs)
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    tops: list[list[Any]] = [[] for _ in range(n)]

    def hook(i: int) -> Callable[[int, float, Any], None]:
        def on_token(token: int, logp: float, top: Any) -> None:  # the scheduler's thread
            with contextlib.suppress(RuntimeError):  # the server's loop is gone
                loop.call_soon_threadsafe(queue.put_nowait, (i, (token, logp, top)))
        return on_token

    for i, r in enumerate(reqs):
        r.on_token = hook(i)
    futures = [asyncio.wrap_future(f) for f in eng.submit_all(reqs)]
    for i, f in enumerate(futures):  # after the request's tokens: the same thread-safe queue
        f.add_done_callback(lambda _, i=i: queue.put_nowait((i, None)))
    pending = set(range(n))

    def event(i: int, body: dict[str, Any]) -> str:
        return sse(body if single else {**body, "index": i})

    async def events() -> AsyncIterator[str]:
        try:
            while pending:
                items = [await queue.get()]
                while not queue.empty():  # a burst of tokens: one event per request
                    items.append(queue.get_nowait())
                changed: dict[int, None] = {}
                for i, item in items:
                    if item is not None:
                        ids[i].append(item[0])
                        lps[i].append(item[1])
                        if item[2] is not None:
                            tops[i].append(item[2])
                        changed[i] = None
                        continue
                    pending.discard(i)
                    changed.pop(i, None)
                    out = futures[i].result()
                    fr = out.finish_reason
                    if fr.get("type") == "abort" and fr.get("status_code"):
                        raise _Refused(fr.get("message") or "aborted", int(fr["status_code"]))
                    yield event(i, response_item(out, opts[i], eng.tokenizer))
                for i in changed:
                    if i in pending:
                        yield event(i, _partial(i, reqs[i], opts[i], ids[i], lps[i], tops[i],
                                                eng))
        except _Refused as e:  # SGLang's mid-stream form
            yield sse({"error": {"message": e.args[0], "code": e.args[1]}})
        except Exception as e:  # noqa: BLE001 - the engine failed
            yield sse({"error": {"message": f"{type(e).__name__}: {e}", "code": 500}})
        finally:
            stop()
        yield DONE

    def stop() -> None:
        """Abort what is unfinished (a client gone, an error); never waits on the engine."""
        if left := [reqs[i].rid for i in pending]:
            pending.clear()
            loop.run_in_executor(None, eng.abort, left)

    return GuardedStream(events(), stop)
