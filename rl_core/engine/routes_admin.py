"""Health, information, load and scheduling routes of the embedded engine's server.

``/health`` is cheap (as slime configures SGLang); ``/health_generate`` runs a one-token
generation unless requests are making progress, and answers 200 while generation is paused or
memory released on purpose; both answer 503 until an engine is attached. ``/flush_cache``
answers 400 while requests run or wait. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from rl_core.engine.core import PAUSE_MODES, EngineRequestError, EngineStateError, GenerateRequest
from rl_core.engine.protocol import Engine, error, field, model_info, read_body, server_info, strs
from rl_core.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
router = APIRouter()
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
_LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


@router.get("/health")
async def health(request: Request) -> Response:
    return Response(status_code=200 if request.app.state.engine is not None else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    if (eng := request.app.state.engine) is None:
        return Response(status_code=503)
    if eng.paused or any(eng.memory_released.values()):
        return Response(status_code=200)  # not generating, on purpose
    if eng.load()["num_running_reqs"] and time.monotonic() - eng.last_progress < 5.0:
        return Response(status_code=200)  # busy and making progress
    rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
    timeout = request.app.state.health_timeout_s
    try:
        fut = eng.submit(GenerateRequest(rid, [0], SamplingParams(temperature=0, max_new_tokens=1)))
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout=timeout)
    except TimeoutError:
        await asyncio.to_thread(eng.abort, rid)
        log.error("health check: no token within %.0f s", timeout)
        return Response(status_code=503)
    except (EngineRequestError, EngineStateError) as e:
        log.error("health check failed: %s", e)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(eng: Engine) -> dict[str, Any]:
    return model_info(eng)


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request, eng: Engine) -> dict[str, Any]:
    return {**server_info(eng), "host": request.url.hostname, "port": request.url.port}


@router.get("/get_weight_version")
async def get_weight_version(eng: Engine) -> dict[str, Any]:
    return {"weight_version": eng.weight_version}


@router.get("/v1/loads")
async def v1_loads(eng: Engine, include: str | None = None) -> Any:
    if include is not None and (bad := {s.strip() for s in include.split(",")} - _LOAD_SECTIONS):
        return error(f"Invalid include sections: {sorted(bad)}")
    load = eng.load()
    keys = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
            "max_running_requests", "token_usage")
    return {"timestamp": datetime.now(UTC).isoformat(), "version": server_info(eng)["version"],
            "loads": [{"dp_rank": 0, "num_total_tokens": load["num_used_tokens"],
                       **{k: load[k] for k in keys}}]}


@router.get("/get_load")
async def get_load(eng: Engine) -> list[dict[str, Any]]:
    load = eng.load()
    return [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
             "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_used_tokens"]}]


@router.post("/abort_request")
async def abort_request(request: Request, eng: Engine) -> Response:
    body = await read_body(request, optional=True)
    rid = field(body, "rid", lambda x: isinstance(x, str) or strs(x),
                "a string or a list of strings")
    await asyncio.to_thread(eng.abort, rid, bool(body.get("abort_all") or False))
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request, eng: Engine) -> Any:
    body = await read_body(request, optional=True)  # old servers send no body
    if (mode := body.get("mode") or "abort") not in PAUSE_MODES:
        return error(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    await asyncio.to_thread(eng.pause, mode)
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request, eng: Engine) -> Any:
    await read_body(request, optional=True)
    await asyncio.to_thread(eng.resume)
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(eng: Engine) -> Response:
    if await asyncio.to_thread(eng.flush_cache):
        return PlainTextResponse("Cache flushed.\n")
    load = eng.load()
    return PlainTextResponse(f"Cache not flushed: {load['num_running_reqs']} running and "
                             f"{load['num_waiting_reqs']} waiting requests.\n", status_code=400)
