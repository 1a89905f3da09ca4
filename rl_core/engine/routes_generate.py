"""The ``/generate`` route of the embedded engine's SGLang-compatible server.

A body (one prompt, a batch, ``n`` samples each) becomes engine requests that are queued all
or none; the answer keeps request order (prompt-major for ``n > 1``); ``"stream": true``
answers with SGLang's server-sent events (engine/generate_stream.py). A client that goes away
has its requests aborted, as SGLang does. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rl_core.engine.core import EngineRequestError
from rl_core.engine.generate_stream import stream_generate
from rl_core.engine.lora import AdapterError
from rl_core.engine.protocol import Engine, error, parse_generate, read_body, response_item

router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, eng: Engine) -> Any:
    body = await read_body(request)
    try:
        single, reqs, opts = parse_generate(body, eng, request.app.state.max_request_samples)
        if body.get("stream"):
            return stream_generate(eng, reqs, opts, single)
        futures = eng.submit_all(reqs)  # all or none: a bad item rejects the batch
    except (EngineRequestError, AdapterError) as e:
        return error(str(e))
    gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    while not (await asyncio.wait({gathered}, timeout=1.0))[0]:
        if await request.is_disconnected():  # SGLang aborts the requests of a client gone
            await asyncio.to_thread(eng.abort, [r.rid for r in reqs])
            gathered.cancel()
            return Response(status_code=499)
    outs = gathered.result()
    for fr in (out.finish_reason for out in outs):
        if fr.get("type") == "abort" and fr.get("status_code"):
            return error(fr.get("message") or "aborted", status=int(fr["status_code"]))
    items = [response_item(o, opt, eng.tokenizer) for o, opt in zip(outs, opts, strict=True)]
    # A Response, so FastAPI skips jsonable_encoder's Python walk over every
    # [logprob, token_id, null] triple (635 us per 128-token answer, json.dumps 118 us):
    # time in which this thread holds the GIL the engine's scheduler needs.
    return JSONResponse(items[0] if single else items)
