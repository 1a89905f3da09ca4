"""The Tinker-compatible HTTP service: :func:`create_app` puts the routes the real Tinker SDK
(0.38.0) calls in front of a :class:`~grpoflow.tinker.backend.Backend` (the protocol:
docs/tinker-protocol.md; section numbers below refer to it).

Every ``/api/v1`` request carries ``X-API-Key``: it must be a tenant's key (``tenants``: its
SHA-256 digest listed) or one of ``api_keys``; with neither, any ``tml-`` key is accepted; a
wrong key is answered 401. The caller's identity is the tenant's name, else the key's digest
(:mod:`.auth`): its sessions, models, runs, checkpoints and request ids are its own, and
another caller's are 404. Errors are JSON ``{"detail": ...}`` with a non-empty body (400 bad
request, 401, 404 unknown id or route, 410 finished session, 413 body over ``max_body_bytes``,
422 malformed body, 429 full queue; never 402 or 409);
a failed request's future answers ``{"error": ..., "category": "user" | "server"}``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from grpoflow.tinker.auth import BodyLimit, KeyTable, owner_of
from grpoflow.tinker.backend import Backend, MetricsTracker, require_tinker
from grpoflow.tinker.errors import ApiError
from grpoflow.tinker.proto import WireError, decode_forward_backward
from grpoflow.tinker.rest import rest_routes
from grpoflow.tinker.schemas import (
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    FinishBody,
    LoadWeightsBody,
    OptimStepBody,
    RetrieveBody,
    SampleBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
    SessionIdBody,
)
from grpoflow.tinker.schemas import ModelIdBody as GetInfoBody
from grpoflow.tinker.service import TinkerService

__all__ = ["CLIENT_CONFIG", "create_app", "owner_of"]

log = logging.getLogger(__name__)

# client/config (section 19): plain API keys, httpx (not pyqwest), uncompressed requests,
# one forward_backward chunk at a time, per-request polling, losses computed client-side.
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
POLL_TIMEOUT_S = 30.0  # a retrieve_future long-poll's bound (the SDK's read timeout is 45 s)


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def create_app(backend: Backend, *, root: Path | str, api_keys: Iterable[str] | None = None,
               tracker: MetricsTracker | None = None, poll_timeout_s: float = POLL_TIMEOUT_S,
               max_queued: int = 256, session_ttl_s: float = 1800.0,
               tenants: Mapping[str, Iterable[str]] | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """The service for ``backend``'s base models; runs and checkpoints under ``root``.

    ``api_keys``: plain keys accepted (None: none besides the tenants', or any ``tml-`` key
    when there are no ``tenants`` either); ``tenants``: name -> SHA-256 hex digests of its
    keys; ``tracker``: where training metrics and lineage go
    (:class:`~grpoflow.tinker.backend.MetricsTracker`, optionally a
    :class:`~grpoflow.tinker.backend.LineageTracker`); ``poll_timeout_s``: how
    long ``retrieve_future`` holds an unfinished request before answering try_again;
    ``max_queued``: a base model's queued requests (or a training client's requests waiting
    for an earlier ``seq_id``) beyond which a submission answers 429;
    ``max_body_bytes``: a larger request body is answered 413 (None: no bound);
    ``session_ttl_s``: a session without a heartbeat (the SDK beats every 10 s) for this
    long is finished, its models dropped.
    ``app.state.tinker.close()`` stops its workers (the server's shutdown does it too).
    """
    require_tinker()  # the protobuf schema: a clear ImportError now, not at the first request
    service = TinkerService(backend, Path(root), tracker=tracker, max_queued=max_queued,
                            session_ttl_s=session_ttl_s)
    table = KeyTable(api_keys, tenants)  # digests only: the keys are not kept

    def authenticate(request: Request) -> str:
        key = request.headers.get("x-api-key", "")
        if (owner := table.owner(key)) is None:
            raise ApiError(401, "invalid API key (X-API-Key)" if key else
                           "missing API key: send X-API-Key (ServiceClient(api_key='tml-...'))")
        return owner

    auth = Depends(authenticate)  # a default, not an annotation: these are strings here
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(service.close)  # the workers finish their queues

    app = FastAPI(title="grpoflow Tinker-compatible service", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    app.state.tinker = service
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _json_error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):  # unknown routes are 404, never 405 (section 2)
            return _json_error(404, f"no route {request.method} {request.url.path}")
        return _json_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _json_error(500, f"internal error: {type(exc).__name__}: {exc}")

    r = APIRouter(prefix="/api/v1")

    # ------------------------------------------------------------ session (section 3)
    @r.post("/client/config")
    async def client_config(owner: str = auth) -> dict[str, Any]:
        return CLIENT_CONFIG

    @r.post("/client/dynamic_config")
    async def dynamic_config(owner: str = auth) -> dict[str, Any]:
        return {}

    @r.post("/create_session")
    async def create_session(body: CreateSessionBody, owner: str = auth) -> dict[str, Any]:
        session = service.registry.new_session(owner, body.tags, body.user_metadata or {})
        log.info("session %s created (%s)", session.id, owner)
        return {"session_id": session.id, "type": "create_session"}

    @r.post("/session_heartbeat")
    async def heartbeat(body: SessionIdBody, owner: str = auth) -> dict[str, Any]:
        return service.heartbeat(body.session_id, owner)

    @r.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, owner: str = auth, body: FinishBody | None = None,
                     ) -> dict[str, Any]:
        service.finish_session(session_id, owner)
        return {}

    @r.post("/telemetry")
    async def telemetry(request: Request, owner: str = auth) -> dict[str, Any]:
        try:
            events = (await request.json()).get("events") or []
        except ValueError:
            events = []
        for event in events if isinstance(events, list) else []:
            if isinstance(event, dict) and event.get("event") == "UNHANDLED_EXCEPTION":
                log.info("client exception (%s): %s: %s", owner, event.get("error_type"),
                         str(event.get("error_message"))[:300])
        return {"status": "accepted"}

    @r.get("/get_server_capabilities")
    async def capabilities(owner: str = auth) -> dict[str, Any]:
        return service.capabilities()

    @r.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    # ------------------------------------------------------------ models (section 5)
    @r.post("/create_model")
    async def create_model(body: CreateModelBody, owner: str = auth) -> dict[str, Any]:
        return service.create_model(body, owner)

    @r.post("/get_info")
    async def get_info(body: GetInfoBody, owner: str = auth) -> dict[str, Any]:
        return service.get_info(body.model_id, owner)

    @r.post("/load_weights")
    async def load_weights(body: LoadWeightsBody, owner: str = auth) -> dict[str, Any]:
        return await run_in_threadpool(service.load_weights, body, owner)

    # ------------------------------------------------------------ training (sections 8-11)
    @r.post("/forward_backward")
    async def forward_backward(request: Request, owner: str = auth) -> dict[str, Any]:
        raw = await request.body()
        try:
            req = await run_in_threadpool(decode_forward_backward, raw,
                                          request.headers.get("content-encoding"))
        except WireError as exc:
            raise ApiError(400, str(exc)) from None
        return service.forward_backward(req, owner)

    @r.post("/optim_step")
    async def optim_step(body: OptimStepBody, owner: str = auth) -> dict[str, Any]:
        return service.optim_step(body, owner)

    @r.post("/save_weights")
    async def save_weights(body: SaveWeightsBody, owner: str = auth) -> dict[str, Any]:
        return service.save_weights(body, owner)

    @r.post("/save_weights_for_sampler")
    async def save_for_sampler(body: SaveWeightsForSamplerBody, owner: str = auth) -> dict[str, Any]:
        return service.save_weights_for_sampler(body, owner)

    # ------------------------------------------------------------ sampling (section 12)
    @r.post("/create_sampling_session")
    async def create_sampling_session(body: CreateSamplingSessionBody,
                                      owner: str = auth) -> dict[str, Any]:
        return await run_in_threadpool(service.create_sampling_session, body, owner)

    @r.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, owner: str = auth) -> dict[str, Any]:
        return service.get_sampler(sampler_id, owner)

    @r.post("/asample")
    async def asample(body: SampleBody, owner: str = auth) -> dict[str, Any]:
        return await run_in_threadpool(service.sample, body, owner)

    # ------------------------------------------------------------ futures (section 6)
    @r.post("/retrieve_future")
    async def retrieve_future(body: RetrieveBody, request: Request, owner: str = auth) -> Response:
        bound = poll_timeout_s
        # stay under the client's own read timeout (45 s for retrieve_future)
        with contextlib.suppress(KeyError, ValueError):
            bound = min(bound, max(1.0, float(request.headers["x-stainless-read-timeout"]) - 5))
        try:
            result = await service.futures.wait(body.request_id, bound, owner)
        except KeyError:
            raise ApiError(404, f"unknown request_id {body.request_id!r} (a result is kept "
                           "until retrieved, then 10 minutes)") from None
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": body.request_id,
                                 "queue_state": "active"})
        if result.proto is not None:
            return Response(result.proto, media_type="application/x-protobuf")
        return JSONResponse(result.json)

    @r.post("/cancel_future")
    async def cancel_future(owner: str = auth) -> dict[str, Any]:
        return {}  # sample_cancel_enabled is off; a queued sample just runs

    rest_routes(r, service, auth)
    app.include_router(r)
    return app
