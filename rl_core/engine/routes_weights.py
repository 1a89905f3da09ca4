"""Weight and memory routes of the embedded engine's server: SGLang's update paths and ours.

Disk, shared memory (ours), distributed (``backend`` defaults to ``gloo`` on a CPU engine),
version bumps, memory release/resume, LoRA adapters by name, and ``GET /weights_checksum``
(ours: the cached checksum for the trainer to compare). No ``/update_weights_from_tensor``: its
payloads are pickled CUDA IPC handles, never unpickled here. Fields: docs/rollout.md, "The
embedded engine".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rl_core.engine.core import EngineRequestError, EngineStateError
from rl_core.engine.protocol import Engine, control, error, field, read_body, strs

router = APIRouter()


async def _run(fn: Callable[[], Any], success: str, **extra: Any) -> JSONResponse:
    try:
        await asyncio.to_thread(fn)
    except (EngineRequestError, EngineStateError, TimeoutError, ValueError) as e:
        return control(False, str(e), **extra)
    except (RuntimeError, TypeError, KeyError, IndexError) as e:
        # torch.distributed failures (peer gone, timeout); metadata of the wrong shape
        return control(False, f"{type(e).__name__}: {e}", **extra)
    return control(True, success, **extra)


def _group(body: dict[str, Any]) -> str:
    name = field(body, "group_name", lambda v: isinstance(v, str), "a string")
    return name or "weight_update_group"


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, eng: Engine) -> JSONResponse:
    body = await read_body(request)
    if not isinstance(path := body.get("model_path"), str) or not path:
        return control(False, "model_path is required", num_paused_requests=0)
    if (fmt := body.get("load_format")) not in (None, "auto", "safetensors"):
        return control(False, f"load_format {fmt!r} is not supported; use safetensors",
                       num_paused_requests=0)
    return await _run(lambda: eng.update_weights_from_disk(
        path, body.get("weight_version"), abort_all_requests=bool(body.get("abort_all_requests"))),
        "Succeeded to update model weights.", num_paused_requests=0)


@router.post("/update_weights_from_shared_memory")
async def update_weights_from_shared_memory(request: Request, eng: Engine) -> JSONResponse:
    """Ours (``rollout.weight_sync: shm``): serve the weights of a segment on this host."""
    body = await read_body(request)
    path, layout, size = body.get("path"), body.get("layout"), body.get("size")
    if not (isinstance(path, str) and path and isinstance(layout, list) and isinstance(size, int)):
        return control(False, "path (a string), layout (a list) and size (bytes) are required")
    return await _run(lambda: eng.update_weights_from_shared_memory(
        path, layout, size, body.get("weight_version")), "Succeeded to update model weights.")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, eng: Engine) -> JSONResponse:
    body = await read_body(request)
    try:
        addr, port = str(body["master_address"]), int(body["master_port"])
        offset, world = int(body["rank_offset"]), int(body["world_size"])
    except (KeyError, TypeError, ValueError) as e:
        return control(False, "master_address, master_port, rank_offset and world_size are "
                       f"required ({e!r})")
    args = (addr, port, offset, world, _group(body),
            body.get("backend") or ("gloo" if eng.device.type == "cpu" else "nccl"))
    return await _run(lambda: eng.init_weights_update_group(*args),
                      "Succeeded to initialize custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, eng: Engine) -> JSONResponse:
    body = await read_body(request)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        return control(False, "names, dtypes and shapes must be lists")
    group, version, fmt = _group(body), body.get("weight_version"), body.get("load_format")
    return await _run(lambda: eng.update_weights_from_distributed(
        names, dtypes, shapes, group, version, load_format=fmt,
        abort_all_requests=bool(body.get("abort_all_requests"))),
        "Succeeded to update parameter online from distributed.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, eng: Engine) -> JSONResponse:
    group = _group(await read_body(request, optional=True))
    return await _run(lambda: eng.destroy_weights_update_group(group),
                      "Succeeded to destroy custom process group.")


@router.post("/update_weight_version")
async def update_weight_version(request: Request, eng: Engine) -> JSONResponse:
    body = await read_body(request)
    if (new := body.get("new_version")) is None or not isinstance(new, str | int):
        return control(False, "new_version is required (a string)")
    abort_all = (a := body.get("abort_all_requests")) is None or bool(a)  # SGLang: abort all
    try:
        version = await asyncio.to_thread(eng.update_weight_version, str(new),
                                          abort_all_requests=abort_all)
    except (EngineStateError, TimeoutError) as e:
        return control(False, f"Failed to update weight version: {e}")
    return control(True, f"Weight version updated to {version}", new_version=version)


@router.get("/weights_checksum")
async def weights_checksum(eng: Engine, lora_name: str | None = None) -> Any:
    try:
        return {"checksum": eng.checksum(lora_name), "weight_version": eng.weight_version}
    except ValueError as e:  # no such adapter
        return error(str(e))


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, eng: Engine) -> JSONResponse:
    body = await read_body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        return control(False, "lora_name and lora_path are required (strings)")
    return await _run(lambda: eng.load_lora_adapter(name, path),
                      f"LoRA adapter {name!r} loaded.", loaded_adapters=[name])


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, eng: Engine) -> JSONResponse:
    name = (await read_body(request)).get("lora_name")
    if not (isinstance(name, str) and name):
        return control(False, "lora_name is required (a string)")
    return await _run(lambda: eng.unload_lora_adapter(name), f"LoRA adapter {name!r} unloaded.")


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def memory_occupation(request: Request, eng: Engine) -> Any:
    release = request.url.path == "/release_memory_occupation"
    tags = field(await read_body(request, optional=True), "tags", strs, "a list of strings")
    try:
        await asyncio.to_thread(eng.release_memory if release else eng.resume_memory, tags)
    except EngineRequestError as e:
        return error(str(e))
    return JSONResponse(None)
