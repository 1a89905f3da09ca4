"""SGLang's native HTTP API over the embedded engine (FastAPI app + uvicorn runner).

The endpoints, request fields and response shapes are SGLang's (``/generate``, the health,
info and load endpoints, abort / pause / continue / flush, memory release and the four
weight-update paths), so one client drives this server and a real SGLang server alike. See
``/work/shared/reference/sglang-protocol.md`` §1–2 and §7 for the protocol itself.

Where the embedded engine differs, it says so instead of pretending:

- ``/update_weights_from_tensor`` takes ``load_format: "grpoflow_safetensors_b64"``: each
  element of ``serialized_named_tensors`` is base64 of a safetensors blob of named tensors
  (one element: the engine is one rank). SGLang's own formats carry pickled CUDA IPC
  handles; this server never unpickles anything and answers them with 400.
- ``/init_weights_update_group`` defaults ``backend`` to ``gloo`` on a CPU engine (SGLang's
  default, ``nccl``, needs a GPU); distributed updates are one broadcast per tensor.
- ``stream``, ``input_embeds``, top-k log-probs, penalties and grammars are refused with 400.
- ``GET /weights_checksum`` (ours; SGLang has no equivalent) answers ``{"checksum",
  "weight_version"}``: the XXH3-128 checksum of the served weights, which the training
  plane compares with its own after every weight update.
- ``/health`` is cheap (what slime configures SGLang to do); ``/health_generate`` runs a
  one-token generation unless requests are making progress, and answers 200 while
  generation is paused or memory released on purpose.

Errors: malformed bodies get SGLang's validation shape ``{"object": "error", "message",
"type": "Bad Request", "code": 400}``; rejected requests get ``{"error": {"message"}}``;
control endpoints answer ``{"success": false, "message"}`` with 400.

Hostile input (tests/test_http_fuzz.py): a body larger than ``max_request_bytes`` is refused
with 413 before it is read (``max_weights_request_bytes`` for ``/update_weights_from_tensor``);
JSON that is not standard (``NaN``, ``Infinity``) or nested too deeply is a 400; one
``/generate`` call may ask for at most ``max_request_samples`` samples (prompts x ``n``),
checked before anything is expanded; integers the sampler packs into int64 (seeds, top_k) are
range-checked; a batch is queued whole or not at all (duplicate ``rid`` included). None of
these reaches the scheduler thread, where an error would fail every running request.

Never imports Prefect or MLflow; never unpickles request data; binds 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rl_core.rollout.engine import (
    PAUSE_MODES,
    EmbeddedEngine,
    EngineRequestError,
    EngineStateError,
    GenerateOutput,
    GenerateRequest,
)
from rl_core.rollout.sampler import SamplingParams

__all__ = [
    "LOAD_FORMAT",
    "ServerThread",
    "build_server",
    "create_app",
    "decode_named_tensors",
    "encode_named_tensors",
    "main",
    "serve",
    "serve_in_thread",
]

log = logging.getLogger(__name__)

LOAD_FORMAT = "grpoflow_safetensors_b64"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
_SAMPLING_EPS = 1e-6
# Request bounds (create_app arguments; `grpoflow engine serve --max-request-mb`).
MAX_REQUEST_BYTES = 64 * 2**20
MAX_WEIGHTS_REQUEST_BYTES = 16 * 2**30
MAX_REQUEST_SAMPLES = 16384

# sampling_params keys: implemented, accepted only at their default, or accepted and ignored.
_SAMPLING_IMPLEMENTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "seed",
}
_SAMPLING_DEFAULT_ONLY: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
}
_SAMPLING_IGNORED = {"custom_params", "stream_interval"}
# Top-level /generate fields refused unless at their default.
_GENERATE_DEFAULT_ONLY: dict[str, Any] = {
    "input_embeds": None,
    "stream": False,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "lora_path": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
}
_LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


# ----------------------------------------------------------------------- tensor payloads


def encode_named_tensors(named: Mapping[str, torch.Tensor]) -> str:
    """Base64 of a safetensors blob: one element of ``serialized_named_tensors``."""
    from safetensors.torch import save

    blob = save({k: v.detach().contiguous().cpu() for k, v in named.items()})
    return base64.b64encode(blob).decode("ascii")


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_named_tensors` (safetensors: no code runs while loading)."""
    from safetensors.torch import load

    try:
        blob = base64.b64decode(payload, validate=True)
        return load(blob)
    except Exception as e:  # binascii.Error, SafetensorError
        raise EngineRequestError(f"serialized_named_tensors: not base64 safetensors ({e})") from e


# ---------------------------------------------------------------------------- errors


class _BadRequest(Exception):
    """A malformed request (wrong JSON or field types): SGLang's validation error shape."""


class _TooLarge(Exception):
    """A request body over the server's size limit: 413."""


def _validation_error(message: str) -> JSONResponse:
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
    return JSONResponse({**body, "code": 400}, status_code=400)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _control(success: bool, message: str, **extra: Any) -> JSONResponse:
    body = {"success": success, "message": message, **extra}
    return JSONResponse(body, status_code=200 if success else 400)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (use a finite number)")


async def _read_capped(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise _BadRequest(f"invalid Content-Length header {declared!r}") from None
        if size > limit:
            raise _TooLarge(f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # chunked bodies declare no length
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _body(request: Request, *, optional: bool = False) -> dict[str, Any]:
    state = request.app.state
    weights = request.url.path == "/update_weights_from_tensor"
    limit = state.max_weights_request_bytes if weights else state.max_request_bytes
    raw = await _read_capped(request, limit)
    if not raw.strip():
        if optional:
            return {}
        raise _BadRequest("request body must be a JSON object; got an empty body")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise _BadRequest(f"invalid JSON body: {e}") from None
    except RecursionError:
        raise _BadRequest("invalid JSON body: nested too deeply") from None
    if body is None and optional:
        return {}
    if not isinstance(body, dict):
        raise _BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _str_or_strs(x: Any) -> bool:
    return isinstance(x, str) or _strs(x)


# ------------------------------------------------------------------------ /generate


@dataclass
class _ItemOpts:
    """Per-sample response options."""

    prompt: list[int]
    return_logprob: bool
    logprob_start_len: int
    skip_special_tokens: bool
    no_stop_trim: bool
    return_text_in_logprobs: bool


def _field(body: dict[str, Any], name: str, check: Callable[[Any], bool], what: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise _BadRequest(f"{name} must be {what}, got {value!r}")
    return value


def _sampling_params(
    d: Any, defaults: Mapping[str, Any], vocab_size: int | None = None
) -> tuple[SamplingParams, int, dict[str, bool]]:
    """SGLang ``sampling_params`` dict → (SamplingParams, n, text options).

    A ``top_k`` of at least ``vocab_size`` keeps every token: it becomes -1 (disabled).
    """
    if not isinstance(d, dict):
        raise _BadRequest(f"sampling_params must be an object, got {d!r}")
    known = _SAMPLING_IMPLEMENTED | set(_SAMPLING_DEFAULT_ONLY) | _SAMPLING_IGNORED
    unknown = sorted(set(d) - known)
    if unknown:
        raise EngineRequestError(f"unknown sampling parameters {unknown}")
    for key, default in _SAMPLING_DEFAULT_ONLY.items():
        if d.get(key) is not None and d[key] != default:
            raise EngineRequestError(
                f"sampling parameter {key}={d[key]!r} is not supported by the embedded engine"
            )

    def get(key: str, fallback: Any) -> Any:
        v = d.get(key)
        return fallback if v is None else v

    temperature = get("temperature", defaults.get("temperature", 1.0))
    top_p = get("top_p", defaults.get("top_p", 1.0))
    top_k = get("top_k", defaults.get("top_k", -1))
    min_p = get("min_p", defaults.get("min_p", 0.0))
    max_new = get("max_new_tokens", 128)
    n = get("n", 1)
    seed = d.get("sampling_seed", d.get("seed"))
    stop = get("stop", [])
    stop_ids = get("stop_token_ids", [])
    for key, value, ok, what in (
        ("temperature", temperature, _is_num, "a number"),
        ("top_p", top_p, _is_num, "a number"),
        ("min_p", min_p, _is_num, "a number"),
        ("top_k", top_k, _is_int, "an integer"),
        ("max_new_tokens", max_new, _is_int, "an integer"),
        ("n", n, _is_int, "an integer"),
    ):
        if not ok(value):
            raise _BadRequest(f"sampling_params.{key} must be {what}, got {value!r}")
    if seed is not None and not _is_int(seed):
        raise EngineRequestError(f"sampling_seed must be an integer, got {seed!r}.")
    if seed is not None and _is_int(n) and n > 1 and seed + n - 1 >= 1 << 63:
        raise EngineRequestError(
            f"sampling_seed={seed} with n={n}: sample j uses seed + j, which must fit in a "
            "signed 64-bit integer; use a smaller seed."
        )
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _BadRequest(f"sampling_params.stop must be a string or a list of strings: {stop!r}")
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _BadRequest(f"sampling_params.stop_token_ids must be a list of ints: {stop_ids!r}")
    if top_k == 0 or top_k < -1:
        raise EngineRequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if vocab_size is not None and top_k >= vocab_size:
        top_k = -1
    if max_new < 0:
        raise EngineRequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    if n < 1:
        raise EngineRequestError(f"n must be at least 1, got {n}.")
    if not math.isfinite(temperature) or temperature < 0:
        raise EngineRequestError(
            f"temperature must be a non-negative finite number, got {temperature}."
        )
    if temperature < _SAMPLING_EPS:  # SGLang: near-zero temperature is greedy
        temperature = 0.0
    try:
        params = SamplingParams(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            min_p=float(min_p),
            max_new_tokens=int(max_new),
            stop=list(stop),
            stop_token_ids=list(stop_ids),
            ignore_eos=bool(get("ignore_eos", False)),
            seed=seed,
        )
    except ValueError as e:
        raise EngineRequestError(str(e)) from None
    opts = {
        "skip_special_tokens": bool(get("skip_special_tokens", True)),
        "no_stop_trim": bool(get("no_stop_trim", False)),
    }
    return params, n, opts


def _per_item(value: Any, batch: int, name: str, n: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * batch
    if isinstance(value, list):
        if n > 1:
            raise EngineRequestError(f"Cannot use list {name} with parallel_sample_num > 1")
        if len(value) != batch:
            raise EngineRequestError(f"The length of {name} should be equal to the batch size.")
        return value
    return [value] * batch


def _parse_generate(
    body: dict[str, Any], engine: EmbeddedEngine, max_samples: int = MAX_REQUEST_SAMPLES
) -> tuple[bool, list[GenerateRequest], list[_ItemOpts]]:
    """A /generate body → (single?, engine requests prompt-major, per-sample options).

    At most ``max_samples`` samples (prompts x n), checked before any is built.
    """
    for key, default in _GENERATE_DEFAULT_ONLY.items():
        if body.get(key) not in (None, default):
            raise EngineRequestError(f"{key} is not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and input_ids is not None:
        raise EngineRequestError("Only one of text or input_ids should be provided, not both.")
    if text is None and input_ids is None:
        raise EngineRequestError("Either text or input_ids should be provided.")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise _BadRequest("input_ids must be a list of token ids or a list of such lists")
        if not input_ids:
            raise EngineRequestError("input_ids cannot be empty.")
        single = not isinstance(input_ids[0], list)
        prompts = [input_ids] if single else input_ids
        for p in prompts:
            if not isinstance(p, list) or not all(_is_int(t) for t in p):
                raise _BadRequest("input_ids must be a list of token ids or a list of such lists")
    else:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise _BadRequest("text must be a string or a list of strings")
        if engine.tokenizer is None:
            raise EngineRequestError("text input needs a tokenizer; this model has none")
        prompts = [engine.tokenizer.encode(t) for t in texts]
    batch = len(prompts)
    if batch == 0:
        raise EngineRequestError("the batch is empty")
    if batch > max_samples:
        raise EngineRequestError(
            f"the batch has {batch} prompts; this server takes at most {max_samples} samples "
            "per request: split it into several requests"
        )

    sp = body.get("sampling_params")
    if sp is None:
        sp_list: list[Any] = [{}] * batch
    elif isinstance(sp, dict):
        sp_list = [sp] * batch
    elif isinstance(sp, list):
        if len(sp) != batch:
            raise EngineRequestError(
                "The length of sampling_params should be equal to the batch size."
            )
        sp_list = sp
    else:
        raise _BadRequest("sampling_params must be an object or a list of objects")
    vocab = getattr(engine, "vocab_size", None)
    parsed = [_sampling_params(d, engine.sampling_defaults, vocab) for d in sp_list]
    n = parsed[0][1]
    if any(p[1] != n for p in parsed):
        raise EngineRequestError(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    if batch * n > max_samples:
        raise EngineRequestError(
            f"the request asks for {batch} prompts x n={n} = {batch * n} samples; this server "
            f"takes at most {max_samples} per request: split it or lower n"
        )
    one_prompt = single
    if n > 1:
        single = False  # SGLang answers a list for n > 1

    rid = body.get("rid")
    if rid is None:
        rids = [None] * batch
    elif isinstance(rid, str):  # one prompt: its samples are rid_j; a batch: rid_i, rid_i_j
        rids = [rid] if one_prompt else [f"{rid}_{i}" for i in range(batch)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != batch:
            raise EngineRequestError(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = rid
    else:
        raise _BadRequest("The rid should be a string or a list of strings.")
    rlp = _per_item(
        _field(body, "return_logprob", lambda v: isinstance(v, bool | list), "a bool or list"),
        batch,
        "return_logprob",
        n,
        False,
    )
    starts = _per_item(
        _field(body, "logprob_start_len", lambda v: _is_int(v) or isinstance(v, list), "an int"),
        batch,
        "logprob_start_len",
        n,
        -1,
    )
    text_in_lp = bool(body.get("return_text_in_logprobs") or False)

    reqs: list[GenerateRequest] = []
    opts: list[_ItemOpts] = []
    for i, prompt in enumerate(prompts):  # prompt-major: p0s0, p0s1, ..., p1s0, ...
        params, _, text_opts = parsed[i]
        want_lp, start = bool(rlp[i]), starts[i]
        if not _is_int(start):
            raise _BadRequest(f"logprob_start_len must be an int, got {start!r}")
        for j in range(n):
            if rids[i] is None:
                sample_rid = uuid.uuid4().hex
            else:
                sample_rid = rids[i] if n == 1 else f"{rids[i]}_{j}"
            p = params
            if n > 1 and params.seed is not None:
                p = SamplingParams(**{**params.__dict__, "seed": params.seed + j})
            reqs.append(
                GenerateRequest(
                    rid=sample_rid,
                    input_ids=list(prompt),
                    params=p,
                    return_logprob=want_lp,
                    logprob_start_len=start if want_lp else -1,
                )
            )
            opts.append(
                _ItemOpts(
                    prompt=list(prompt),
                    return_logprob=want_lp,
                    logprob_start_len=start if want_lp else -1,
                    skip_special_tokens=text_opts["skip_special_tokens"],
                    no_stop_trim=text_opts["no_stop_trim"],
                    return_text_in_logprobs=text_in_lp,
                )
            )
    return single, reqs, opts


def _response_item(out: GenerateOutput, o: _ItemOpts, tokenizer: Any) -> dict[str, Any]:
    fr = out.finish_reason
    ids = out.output_ids
    matched = fr.get("matched") if fr.get("type") == "stop" else None
    if not o.no_stop_trim and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(ids, skip_special_tokens=o.skip_special_tokens)
        if not o.no_stop_trim and isinstance(matched, str) and (pos := text.find(matched)) >= 0:
            text = text[:pos]
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": fr,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "reasoning_tokens": 0,
        "weight_version": out.weight_version,
        "num_retractions": out.num_retractions,
    }
    if o.return_logprob:

        def tok_text(t: int) -> str | None:
            if o.return_text_in_logprobs and tokenizer is not None:
                return tokenizer.decode([t])
            return None

        meta["output_token_logprobs"] = [
            [lp, t, tok_text(t)] for lp, t in zip(out.output_logprobs, out.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(out.output_ids)
        if out.input_logprobs is not None and o.logprob_start_len >= 0:
            prompt_ids = o.prompt[
                o.logprob_start_len : o.logprob_start_len + len(out.input_logprobs)
            ]
            meta["input_token_logprobs"] = [
                [lp, t, tok_text(t)] for lp, t in zip(out.input_logprobs, prompt_ids, strict=True)
            ]
        else:
            meta["input_token_logprobs"] = []
    meta["e2e_latency"] = out.e2e_latency
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


# ------------------------------------------------------------------------------- app


def create_app(
    engine: EmbeddedEngine | None = None,
    *,
    health_timeout_s: float = 20.0,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_weights_request_bytes: int = MAX_WEIGHTS_REQUEST_BYTES,
    max_request_samples: int = MAX_REQUEST_SAMPLES,
) -> FastAPI:
    """The SGLang-compatible app over ``engine``.

    ``engine`` may be attached later (``app.state.engine = ...``): until then the health
    endpoints answer 503 and everything else 503 with an error body. Bodies over
    ``max_request_bytes`` (``max_weights_request_bytes`` for ``/update_weights_from_tensor``,
    whose body carries the weights) get 413; a ``/generate`` call asking for more than
    ``max_request_samples`` samples gets 400.
    """
    for name, value in (
        ("max_request_bytes", max_request_bytes),
        ("max_weights_request_bytes", max_weights_request_bytes),
        ("max_request_samples", max_request_samples),
    ):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    app = FastAPI(title="grpoflow embedded engine (SGLang protocol)")
    app.state.engine = engine
    app.state.max_request_bytes = max_request_bytes
    app.state.max_weights_request_bytes = max_weights_request_bytes

    def get_engine() -> EmbeddedEngine:
        eng = app.state.engine
        if eng is None:
            raise EngineStateError("the engine is still loading")
        return eng

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
        return _validation_error(str(exc))

    @app.exception_handler(_TooLarge)
    async def _too_large(_: Request, exc: _TooLarge) -> JSONResponse:
        # The unread rest of the body is not drained: close the connection after answering.
        return JSONResponse(
            {"error": {"message": str(exc)}}, status_code=413, headers={"connection": "close"}
        )

    @app.exception_handler(EngineStateError)
    async def _not_ready(_: Request, exc: EngineStateError) -> JSONResponse:
        return _error(str(exc), status=503)

    @app.exception_handler(TimeoutError)
    async def _busy(_: Request, exc: TimeoutError) -> JSONResponse:
        return _error(str(exc), status=503)  # no safe point in time (a very long step)

    # --------------------------------------------------------------- health and info

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if app.state.engine is not None else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        eng = app.state.engine
        if eng is None:
            return Response(status_code=503)
        if eng.paused or any(eng.memory_released.values()):
            return Response(status_code=200)  # not generating, on purpose
        if eng.load()["num_running_reqs"] and time.monotonic() - eng.last_progress < 5.0:
            return Response(status_code=200)  # busy and making progress
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        req = GenerateRequest(rid, [0], SamplingParams(temperature=0.0, max_new_tokens=1))
        try:
            fut = eng.submit(req)
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout=health_timeout_s)
        except TimeoutError:
            await asyncio.to_thread(eng.abort, rid)
            log.error("health check: no token within %.0f s", health_timeout_s)
            return Response(status_code=503)
        except (EngineRequestError, EngineStateError) as e:
            log.error("health check failed: %s", e)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return get_engine().model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        info = get_engine().server_info()
        return {**info, "host": request.url.hostname, "port": request.url.port}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": get_engine().weight_version}

    @app.get("/weights_checksum")
    async def weights_checksum_endpoint() -> dict[str, Any]:
        eng = get_engine()
        version = eng.weight_version
        checksum = await asyncio.to_thread(eng.checksum)
        return {"checksum": checksum, "weight_version": version}

    @app.get("/v1/loads")
    async def v1_loads(include: str | None = None) -> Any:
        if include is not None:
            bad = {s.strip() for s in include.split(",")} - _LOAD_SECTIONS
            if bad:
                return _error(f"Invalid include sections: {sorted(bad)}")
        eng = get_engine()
        load = eng.load()
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": eng.server_info()["version"],
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": load["num_running_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"],
                    "num_used_tokens": load["num_used_tokens"],
                    "num_total_tokens": load["num_used_tokens"],
                    "max_total_num_tokens": load["max_total_num_tokens"],
                    "max_running_requests": load["max_running_requests"],
                    "token_usage": load["token_usage"],
                }
            ],
        }

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        load = get_engine().load()
        return [
            {
                "dp_rank": 0,
                "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_tokens": load["num_used_tokens"],
            }
        ]

    # ------------------------------------------------------------------- generation

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        eng = get_engine()
        body = await _body(request)
        try:
            single, reqs, opts = _parse_generate(body, eng, max_request_samples)
            futures = eng.submit_all(reqs)  # all or none: a bad item rejects the batch
        except EngineRequestError as e:
            return _error(str(e))
        gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        while True:  # SGLang aborts the requests of a client that went away
            done, _ = await asyncio.wait({gathered}, timeout=1.0)
            if done:
                break
            if await request.is_disconnected():
                await asyncio.to_thread(eng.abort, [r.rid for r in reqs])
                gathered.cancel()
                return Response(status_code=499)
        outs: list[GenerateOutput] = gathered.result()
        for out in outs:
            code = out.finish_reason.get("status_code")
            if out.finish_reason.get("type") == "abort" and code:
                return _error(out.finish_reason.get("message") or "aborted", status=int(code))
        items = [_response_item(o, opt, eng.tokenizer) for o, opt in zip(outs, opts, strict=True)]
        # A Response, so FastAPI skips jsonable_encoder's Python walk over every
        # [logprob, token_id, null] triple (635 us per 128-token answer, json.dumps 118 us):
        # time in which this thread holds the GIL the engine's scheduler needs.
        return JSONResponse(items[0] if single else items)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _body(request, optional=True)
        rid = _field(body, "rid", _str_or_strs, "a string or a list of strings")
        await asyncio.to_thread(get_engine().abort, rid, bool(body.get("abort_all") or False))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        body = await _body(request, optional=True)
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            return _error(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await asyncio.to_thread(get_engine().pause, mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Any:
        await _body(request, optional=True)
        await asyncio.to_thread(get_engine().resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        eng = get_engine()
        if await asyncio.to_thread(eng.flush_cache):
            return PlainTextResponse("Cache flushed.\n")
        load = eng.load()
        return PlainTextResponse(
            f"Cache not flushed: {load['num_running_reqs']} running and "
            f"{load['num_waiting_reqs']} waiting requests.\n",
            status_code=400,
        )

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Any:
        return await _memory(request, get_engine().release_memory)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Any:
        return await _memory(request, get_engine().resume_memory)

    async def _memory(request: Request, fn: Callable[[Sequence[str] | None], None]) -> Any:
        body = await _body(request, optional=True)
        tags = _field(body, "tags", _strs, "a list of strings")
        try:
            await asyncio.to_thread(fn, tags)
        except EngineRequestError as e:
            return _error(str(e))
        return JSONResponse(None)

    # --------------------------------------------------------------- weight updates

    async def _run_update(fn: Callable[[], Any], success: str, **extra: Any) -> JSONResponse:
        try:
            await asyncio.to_thread(fn)
        except (EngineRequestError, EngineStateError, TimeoutError, ValueError) as e:
            return _control(False, str(e), **extra)
        except (RuntimeError, TypeError, KeyError, IndexError) as e:
            # torch.distributed failures (peer gone, timeout); metadata of the wrong shape
            return _control(False, f"{type(e).__name__}: {e}", **extra)
        return _control(True, success, **extra)

    def _group(body: dict[str, Any]) -> str:
        return _field(body, "group_name", lambda v: isinstance(v, str), "a string") or (
            "weight_update_group"
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _body(request)
        eng = get_engine()
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _control(False, "model_path is required", num_paused_requests=0)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return _control(
                False,
                f"load_format {body['load_format']!r} is not supported; use safetensors",
                num_paused_requests=0,
            )
        return await _run_update(
            lambda: eng.update_weights_from_disk(
                path,
                body.get("weight_version"),
                abort_all_requests=bool(body.get("abort_all_requests")),
            ),
            "Succeeded to update model weights.",
            num_paused_requests=0,
        )

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        body = await _body(request)
        eng = get_engine()
        if body.get("load_format") != LOAD_FORMAT:
            return _control(
                False,
                f"load_format {body.get('load_format')!r} is not supported by the embedded "
                f"engine (it never unpickles); send load_format {LOAD_FORMAT!r}: base64 "
                "safetensors of the named tensors",
            )
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != 1:
            return _control(
                False, "serialized_named_tensors must be a list with one element (one rank)"
            )
        if not isinstance(payloads[0], str):
            return _control(False, "serialized_named_tensors[0] must be a base64 string")

        def update() -> None:
            eng.update_weights_from_tensors(
                decode_named_tensors(payloads[0]),
                body.get("weight_version"),
                abort_all_requests=bool(body.get("abort_all_requests")),
            )

        return await _run_update(update, "Succeeded to update model weights.")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await _body(request)
        eng = get_engine()
        try:
            addr, port = str(body["master_address"]), int(body["master_port"])
            offset, world = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            return _control(
                False,
                f"master_address, master_port, rank_offset and world_size are required ({e!r})",
            )
        backend = body.get("backend") or ("gloo" if eng.device.type == "cpu" else "nccl")
        group = _group(body)
        return await _run_update(
            lambda: eng.init_weights_update_group(addr, port, offset, world, group, backend),
            "Succeeded to initialize custom process group.",
        )

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await _body(request)
        eng = get_engine()
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            return _control(False, "names, dtypes and shapes must be lists")
        group = _group(body)
        return await _run_update(
            lambda: eng.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group,
                body.get("weight_version"),
                load_format=body.get("load_format"),
                abort_all_requests=bool(body.get("abort_all_requests")),
            ),
            "Succeeded to update parameter online from distributed.",
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await _body(request, optional=True)
        eng = get_engine()
        group = _group(body)
        return await _run_update(
            lambda: eng.destroy_weights_update_group(group),
            "Succeeded to destroy custom process group.",
        )

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _body(request)
        eng = get_engine()
        new = body.get("new_version")
        if new is None or not isinstance(new, str | int):
            return _control(False, "new_version is required (a string)")
        abort_all = body.get("abort_all_requests")
        try:
            version = await asyncio.to_thread(
                eng.update_weight_version,
                str(new),
                abort_all_requests=True if abort_all is None else bool(abort_all),
            )
        except (EngineStateError, TimeoutError) as e:
            return _control(False, f"Failed to update weight version: {e}")
        return _control(True, f"Weight version updated to {version}", new_version=version)

    return app


# ---------------------------------------------------------------------------- running


class ServerThread:
    """A uvicorn server for ``app`` on a background thread (tests, in-process engines).

    ``port=0`` binds a free port; ``url`` is the address it actually bound.
    """

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="grpoflow-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        sockets = [s for server in self.server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=timeout)


def serve_in_thread(
    engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
) -> ServerThread:
    """Serve ``engine`` from a background thread; returns once it accepts connections."""
    return ServerThread(create_app(engine), host=host, port=port).start(timeout)


def build_server(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    log_level: str = "info",
    max_request_bytes: int = MAX_REQUEST_BYTES,
    **engine_kw: Any,
) -> Any:
    """A uvicorn server (call ``.run()``) whose engine loads on a background thread.

    Health endpoints answer 503 until the engine is attached; if loading fails, the error is
    kept in ``server.config.app.state.load_error`` and the server stops itself.
    ``max_request_bytes`` bounds every request body but the weights of
    ``/update_weights_from_tensor`` (see `create_app`).
    """
    import uvicorn

    app = create_app(None, max_request_bytes=max_request_bytes)
    app.state.load_error = None
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))

    def load() -> None:
        try:
            app.state.engine = EmbeddedEngine(model_path, **engine_kw)
            log.info("engine ready: %s on http://%s:%d", model_path, host, port)
        except BaseException as e:  # reported, then the server stops
            log.exception("could not load %s", model_path)
            app.state.load_error = e
            server.should_exit = True

    threading.Thread(target=load, name="grpoflow-engine-load", daemon=True).start()
    return server


def serve(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    log_level: str = "info",
    max_request_bytes: int = MAX_REQUEST_BYTES,
    **engine_kw: Any,
) -> int:
    """Load the engine and serve it until interrupted; health answers 503 while loading.

    Returns a process exit code (1 if the model failed to load).
    """
    server = build_server(
        model_path,
        host,
        port,
        log_level=log_level,
        max_request_bytes=max_request_bytes,
        **engine_kw,
    )
    app = server.config.app
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        if app.state.engine is not None:
            app.state.engine.close()
    return 1 if app.state.load_error is not None else 0


def _exit_with_parent(pid: int, interval_s: float = 1.0) -> None:
    """Exit (at once, no cleanup) within ``interval_s`` of process ``pid`` going away.

    An engine that a training flow started must not outlive it: a flow killed with SIGKILL
    cannot stop its children, and an orphaned engine would hold its port and memory.
    """

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != pid:
                log.warning("parent process %d is gone; exiting", pid)
                os._exit(3)

    if os.getppid() != pid:
        log.warning("--parent-pid %d is not this process's parent", pid)
    threading.Thread(target=watch, name="grpoflow-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """``grpoflow engine serve --model PATH --port P [--host 127.0.0.1] ...``."""
    ap = argparse.ArgumentParser(
        prog="grpoflow engine serve",
        description="Serve a Hugging Face causal LM with SGLang's HTTP protocol (embedded "
        "engine, CPU or one GPU).",
    )
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument(
        "--kv-layout",
        default="auto",
        choices=["auto", "slots", "padded"],
        help="KV cache layout (auto: slots for Llama-family models, padded otherwise)",
    )
    ap.add_argument("--log-level", default="info")
    ap.add_argument(
        "--control-timeout-s",
        type=float,
        default=60.0,
        help="bound on a control call's wait for the scheduler's next safe point",
    )
    ap.add_argument(
        "--weight-sync-timeout-s",
        type=float,
        default=120.0,
        help="bound on each collective of a distributed weight update (set it to the "
        "trainer's rollout.weight_sync_timeout_s)",
    )
    ap.add_argument(
        "--max-request-mb",
        type=float,
        default=MAX_REQUEST_BYTES / 2**20,
        help="refuse request bodies larger than this with 413 (weight updates by tensor excepted)",
    )
    ap.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (engines started by a training flow die with it)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    return serve(
        args.model,
        args.host,
        args.port,
        log_level=args.log_level,
        max_request_bytes=max(1, int(args.max_request_mb * 2**20)),
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        num_threads=args.num_threads,
        kv_layout=args.kv_layout,
        control_timeout_s=args.control_timeout_s,
        weight_sync_timeout_s=args.weight_sync_timeout_s,
    )


if __name__ == "__main__":  # ``python -m rl_core.rollout.server``: what EnginePool starts
    raise SystemExit(main())
