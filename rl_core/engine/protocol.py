"""SGLang's native HTTP protocol over the embedded engine: request bodies in, responses out.

Reads bodies under a size cap (413), turns ``/generate`` bodies into
:class:`~rl_core.engine.core.GenerateRequest` (prompt-major for ``n > 1``, seeds ``seed + j``,
at most ``max_request_samples``, checked before expanding) and answers in SGLang's three
shapes (malformed, refused, control); what is refused: docs/rollout.md, "The embedded engine".
Routers get the engine from the dependency :data:`Engine` (503 while none is attached).
Never unpickles request data.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from rl_core.engine.core import (
    EmbeddedEngine,
    EngineRequestError,
    EngineStateError,
    GenerateOutput,
    GenerateRequest,
)
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.vision import image_list

MAX_REQUEST_BYTES = 64 * 2**20  # create_app arguments; `grpoflow engine serve --max-request-mb`
MAX_REQUEST_SAMPLES = 16384
_SAMPLING_EPS = 1e-6
# sampling_params keys: implemented, accepted only at their default, or accepted and ignored.
_SAMPLING_IMPLEMENTED = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
    "stop_token_ids", "n", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "sampling_seed", "seed"}
_SAMPLING_DEFAULT_ONLY: dict[str, Any] = {"min_new_tokens": 0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "logit_bias": None}
_SAMPLING_IGNORED = {"custom_params", "stream_interval"}
_SAMPLING_KNOWN = _SAMPLING_IMPLEMENTED | set(_SAMPLING_DEFAULT_ONLY) | _SAMPLING_IGNORED
# Top-level /generate fields refused unless at their default.
_GENERATE_DEFAULT_ONLY: dict[str, Any] = {
    "input_embeds": None, "token_ids_logprob": None,
    "video_data": None, "audio_data": None,
    "return_hidden_states": False}


class BadRequest(Exception):
    """A malformed request (wrong JSON or field types): SGLang's validation error shape."""


class _TooLarge(Exception):
    """A request body over the server's size limit: 413."""


def error(message: str, status: int = 400) -> JSONResponse:
    """A rejected request: ``{"error": {"message"}}``."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def control(success: bool, message: str, **extra: Any) -> JSONResponse:
    """A control endpoint's answer: ``{"success", "message", ...}``, 400 on failure."""
    return JSONResponse({"success": success, "message": message, **extra},
                        status_code=200 if success else 400)


async def _bad_request(_: Request, exc: Exception) -> JSONResponse:
    body = {"object": "error", "message": str(exc), "type": "Bad Request", "param": None}
    return JSONResponse({**body, "code": 400}, status_code=400)


async def _too_large(_: Request, exc: Exception) -> JSONResponse:
    # The unread rest of the body is not drained: close the connection after answering.
    return JSONResponse({"error": {"message": str(exc)}}, status_code=413,
                        headers={"connection": "close"})


async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    return error(str(exc), status=503)  # no engine yet, or no safe point in time


EXCEPTION_HANDLERS = {BadRequest: _bad_request, _TooLarge: _too_large,
                      EngineStateError: _unavailable, TimeoutError: _unavailable}


def get_engine(request: Request) -> EmbeddedEngine:
    """The app's engine (``app.state.engine``); 503 while it is still loading."""
    if (engine := request.app.state.engine) is None:
        raise EngineStateError("the engine is still loading")
    return engine


Engine = Annotated[EmbeddedEngine, Depends(get_engine)]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (use a finite number)")


async def read_body(request: Request, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object in the body, read up to ``app.state.max_request_bytes`` (413 beyond:
    from the declared length if there is one, else while it streams); ``optional``: an
    empty or ``null`` body is ``{}``."""
    limit = request.app.state.max_request_bytes
    if (declared := request.headers.get("content-length")) is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"invalid Content-Length header {declared!r}") from None
        if size > limit:
            raise _TooLarge(f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies declare no length
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if optional:
            return {}
        raise BadRequest("request body must be a JSON object; got an empty body")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise BadRequest(f"invalid JSON body: {e}") from None
    except RecursionError:
        raise BadRequest("invalid JSON body: nested too deeply") from None
    if body is None and optional:
        return {}
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def field(body: dict[str, Any], name: str, check: Callable[[Any], bool], what: str) -> Any:
    """``body[name]`` (None if absent); a 400 naming the field if ``check`` refuses it."""
    value = body.get(name)
    if value is not None and not check(value):
        raise BadRequest(f"{name} must be {what}, got {value!r}")
    return value


@dataclass
class ItemOpts:
    """Per-sample response options."""

    prompt: list[int]
    return_logprob: bool
    logprob_start_len: int
    skip_special_tokens: bool
    no_stop_trim: bool
    return_text_in_logprobs: bool
    top_logprobs_num: int = 0


def _sampling_params(d: Any, defaults: Mapping[str, Any],
                     vocab_size: int) -> tuple[SamplingParams, int, dict[str, bool]]:
    """SGLang ``sampling_params`` dict → (SamplingParams, n, text options); a ``top_k`` of at
    least ``vocab_size`` keeps every token: it becomes -1 (disabled)."""
    if not isinstance(d, dict):
        raise BadRequest(f"sampling_params must be an object, got {d!r}")
    if unknown := sorted(set(d) - _SAMPLING_KNOWN):
        raise EngineRequestError(f"unknown sampling parameters {unknown}")
    for key, default in _SAMPLING_DEFAULT_ONLY.items():
        if d.get(key) is not None and d[key] != default:
            raise EngineRequestError(
                f"sampling parameter {key}={d[key]!r} is not supported by the embedded engine")

    def get(key: str, fallback: Any) -> Any:
        return fallback if d.get(key) is None else d[key]

    temperature, top_p, top_k, min_p = (get(k, defaults.get(k, v)) for k, v in (
        ("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0)))
    max_new, n = get("max_new_tokens", 128), get("n", 1)
    stop, stop_ids = get("stop", []), get("stop_token_ids", [])
    seed = d.get("sampling_seed", d.get("seed"))
    for key, value, ok, what in (
        ("temperature", temperature, _is_num, "a number"), ("top_p", top_p, _is_num, "a number"),
        ("min_p", min_p, _is_num, "a number"), ("top_k", top_k, is_int, "an integer"),
        ("max_new_tokens", max_new, is_int, "an integer"), ("n", n, is_int, "an integer")):
        if not ok(value):
            raise BadRequest(f"sampling_params.{key} must be {what}, got {value!r}")
    if seed is not None and not is_int(seed):
        raise EngineRequestError(f"sampling_seed must be an integer, got {seed!r}.")
    if seed is not None and n > 1 and seed < 1 << 63 <= seed + n - 1:
        raise EngineRequestError(f"sampling_seed={seed} with n={n}: sample j uses seed + j, "
                                 "which must fit in a signed 64-bit integer; use a smaller seed.")
    stop = [stop] if isinstance(stop, str) else stop
    if not strs(stop):
        raise BadRequest(f"sampling_params.stop must be a string or a list of strings: {stop!r}")
    if not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of ints: {stop_ids!r}")
    if n < 1:
        raise EngineRequestError(f"n must be at least 1, got {n}.")
    try:
        params = SamplingParams(
            temperature=0.0 if 0 <= temperature < _SAMPLING_EPS else float(temperature),  # SGLang
            top_p=float(top_p), top_k=-1 if top_k >= vocab_size else int(top_k),
            min_p=float(min_p), max_new_tokens=int(max_new), stop=list(stop), seed=seed,
            stop_token_ids=list(stop_ids), ignore_eos=bool(get("ignore_eos", False)))
    except (ValueError, OverflowError) as e:  # OverflowError: an int too large for a float
        raise EngineRequestError(str(e)) from None
    return params, n, {"skip_special_tokens": bool(get("skip_special_tokens", True)),
                       "no_stop_trim": bool(get("no_stop_trim", False))}


def _per_item(value: Any, batch: int, name: str, n: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * batch
    if not isinstance(value, list):
        return [value] * batch
    if n > 1:
        raise EngineRequestError(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != batch:
        raise EngineRequestError(f"The length of {name} should be equal to the batch size.")
    return value


def parse_generate(body: dict[str, Any], engine: EmbeddedEngine, max_samples: int
                   ) -> tuple[bool, list[GenerateRequest], list[ItemOpts]]:
    """A /generate body → (single?, engine requests prompt-major, per-sample options); at most
    ``max_samples`` samples (prompts x n), checked before any is built. Raises
    :class:`BadRequest` (malformed) or ``EngineRequestError`` (refused)."""
    for key, default in _GENERATE_DEFAULT_ONLY.items():
        if body.get(key) not in (None, default):
            raise EngineRequestError(f"{key} is not supported by the embedded engine")
    field(body, "stream", lambda v: isinstance(v, bool), "a bool")  # engine/generate_stream.py
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and input_ids is not None:
        raise EngineRequestError("Only one of text or input_ids should be provided, not both.")
    if text is None and input_ids is None:
        raise EngineRequestError("Either text or input_ids should be provided.")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise BadRequest("input_ids must be a list of token ids or a list of such lists")
        if not input_ids:
            raise EngineRequestError("input_ids cannot be empty.")
        single = not isinstance(input_ids[0], list)
        prompts = [input_ids] if single else input_ids
        if not all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompts):
            raise BadRequest("input_ids must be a list of token ids or a list of such lists")
    else:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not strs(texts):
            raise BadRequest("text must be a string or a list of strings")
        if engine.tokenizer is None:
            raise EngineRequestError("text input needs a tokenizer; this model has none")
        prompts = [engine.tokenizer.encode(t) for t in texts]
    if (batch := len(prompts)) == 0:
        raise EngineRequestError("the batch is empty")
    if batch > max_samples:
        raise EngineRequestError(f"the batch has {batch} prompts; this server takes at most "
                                 f"{max_samples} samples per request: split it into several "
                                 "requests")

    if (sp := body.get("sampling_params")) is not None and not isinstance(sp, dict | list):
        raise BadRequest("sampling_params must be an object or a list of objects")
    parsed = [_sampling_params(d, engine.sampling_defaults, engine.vocab_size)
              for d in _per_item(sp, batch, "sampling_params", 1, {})]
    n = parsed[0][1]
    if any(p[1] != n for p in parsed):
        raise EngineRequestError(
            "The parallel_sample_num should be the same for all samples in sample params.")
    if batch * n > max_samples:
        raise EngineRequestError(
            f"the request asks for {batch} prompts x n={n} = {batch * n} samples; this server "
            f"takes at most {max_samples} per request: split it or lower n")

    rid = body.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * batch
    elif isinstance(rid, str):  # one prompt: its samples are rid_j; a batch: rid_i, rid_i_j
        rids = [rid] if single else [f"{rid}_{i}" for i in range(batch)]
    elif strs(rid):
        if len(rid) != batch:
            raise EngineRequestError("The specified rids length mismatch with the batch_size "
                                     "for batch processing.")
        rids = rid
    else:
        raise BadRequest("The rid should be a string or a list of strings.")
    rlp = _per_item(field(body, "return_logprob", lambda v: isinstance(v, bool | list),
                          "a bool or list"), batch, "return_logprob", n, False)
    starts = _per_item(field(body, "logprob_start_len", lambda v: is_int(v) or isinstance(v, list),
                             "an int"), batch, "logprob_start_len", n, -1)
    text_in_lp = bool(body.get("return_text_in_logprobs") or False)
    tops = _per_item(field(body, "top_logprobs_num", lambda v: is_int(v) or isinstance(v, list),
                           "an int"), batch, "top_logprobs_num", n, 0)
    if not all(is_int(k) and 0 <= k <= engine.vocab_size for k in tops):
        raise BadRequest(f"top_logprobs_num must be an int in [0, {engine.vocab_size}]")
    routed = _per_item(field(body, "return_routed_experts", lambda v: isinstance(v, bool | list),
                             "a bool or list"), batch, "return_routed_experts", n, False)
    loras = _per_item(body.get("lora_path"), batch, "lora_path", n, None)
    # SGLang's image_data: one prompt's image(s), or (a batch) one entry per prompt
    images = body.get("image_data")
    per_prompt = [images] if single else _per_item(images, batch, "image_data", 1, None)
    prepared = [engine.images.prepare(list(p), image_list(per_prompt[i]))
                for i, p in enumerate(prompts)]
    if not all(x is None or isinstance(x, str) for x in loras):
        raise BadRequest("lora_path must be an adapter name, a list of them, or null")

    reqs: list[GenerateRequest] = []
    opts: list[ItemOpts] = []
    for i, (prompt, pixels) in enumerate(prepared):  # prompt-major: p0s0, p0s1, ..., p1s0, ...
        params, _, text_opts = parsed[i]
        want_lp, start = bool(rlp[i]), starts[i]
        if not is_int(start):
            raise BadRequest(f"logprob_start_len must be an int, got {start!r}")
        start = start if want_lp else -1
        for j in range(n):
            sample_rid = uuid.uuid4().hex if rids[i] is None else (
                rids[i] if n == 1 else f"{rids[i]}_{j}")
            seeded = n > 1 and params.seed is not None
            p = replace(params, seed=params.seed + j) if seeded else params
            reqs.append(GenerateRequest(sample_rid, list(prompt), p, want_lp, start, loras[i],
                                        bool(routed[i]), images=pixels,
                                        top_logprobs_num=tops[i] if want_lp else 0))
            opts.append(ItemOpts(list(prompt), want_lp, start, **text_opts,
                                 return_text_in_logprobs=text_in_lp,
                                 top_logprobs_num=tops[i] if want_lp else 0))
    return single and n == 1, reqs, opts  # SGLang answers a list for n > 1


def response_item(out: GenerateOutput, o: ItemOpts, tokenizer: Any) -> dict[str, Any]:
    """One finished sample as SGLang's ``{"text", "output_ids", "meta_info"}``; the text
    drops a matched stop token or string unless ``no_stop_trim``, the ids keep it."""
    fr, ids = out.finish_reason, out.output_ids
    matched = fr.get("matched") if fr.get("type") == "stop" else None
    if not o.no_stop_trim and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(ids, skip_special_tokens=o.skip_special_tokens)
        if not o.no_stop_trim and isinstance(matched, str) and (pos := text.find(matched)) >= 0:
            text = text[:pos]
    meta: dict[str, Any] = {"id": out.rid, "finish_reason": fr, "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
        "reasoning_tokens": 0, "weight_version": out.weight_version,
        "num_retractions": out.num_retractions,
        # grpoflow's: each output token's weight version (run-length), KV recomputed
        "weight_version_spans": out.weight_version_spans,
        "recomputed_tokens": out.recomputed_tokens}
    if o.return_logprob:
        with_text = o.return_text_in_logprobs and tokenizer is not None

        def items(logprobs: list[Any], tokens: list[int]) -> list[list[Any]]:
            return [[lp, t, tokenizer.decode([t]) if with_text else None]
                    for lp, t in zip(logprobs, tokens, strict=True)]

        meta["output_token_logprobs"] = items(out.output_logprobs, out.output_ids)
        meta["output_token_logprobs_length"] = len(out.output_ids)
        if o.top_logprobs_num:  # SGLang's: per output position, [[logprob, token_id, text]]
            meta["output_top_logprobs"] = [items([v for v, _ in top], [int(t) for _, t in top])
                                           for top in out.output_top_logprobs or []]
            meta["input_top_logprobs"] = []
        meta["input_token_logprobs"] = []
        if out.input_logprobs is not None and (k := o.logprob_start_len) >= 0:
            prompt = o.prompt[k : k + len(out.input_logprobs)]
            meta["input_token_logprobs"] = items(out.input_logprobs, prompt)
    if out.routed_experts is not None:
        meta["routed_experts"] = out.routed_experts
    meta["e2e_latency"] = out.e2e_latency
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


def package_version() -> str:
    try:
        return f"{version('grpoflow')}+embedded"
    except PackageNotFoundError:  # a source checkout
        return "0+embedded"


def model_info(eng: EmbeddedEngine) -> dict[str, Any]:
    """``/model_info``: SGLang's keys for the served model."""
    cfg = eng.model.config
    return {"model_path": eng.model_path, "is_generation": True, "preferred_sampling_params": None,
            "tokenizer_path": eng.tokenizer_path if eng.tokenizer is not None else None,
            "weight_version": eng.weight_version,
            "has_image_understanding": eng.images.processor is not None,
            "has_audio_understanding": False, "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None)}


def server_info(eng: EmbeddedEngine) -> dict[str, Any]:
    """``/server_info``: the ``ServerArgs`` and scheduler keys clients (slime) check."""
    load = eng.load()
    state = {"max_total_num_tokens": eng.max_total_tokens, "memory_released": eng.memory_released,
             "num_running_reqs": load["num_running_reqs"],
             "num_waiting_reqs": load["num_waiting_reqs"],
             "decode_steps": eng.stats["decode_steps"], **eng.prefix_cache_stats}
    return {"engine": "grpoflow-embedded", "model_path": eng.model_path,
            "tokenizer_path": eng.tokenizer_path if eng.tokenizer is not None else None,
            "skip_tokenizer_init": eng.tokenizer is None, "dtype": eng.dtype,
            "device": str(eng.device), "context_length": eng.context_length,
            "max_running_requests": eng.max_running_requests,
            "max_total_tokens": eng.max_total_tokens, "max_total_num_tokens": eng.max_total_tokens,
            "max_req_input_len": eng.context_length - 1, "tp_size": 1, "pp_size": 1, "dp_size": 1,
            "disable_radix_cache": not eng.prefix_cache_stats["prefix_cache_max_tokens"],
            "ep_size": 1, "disaggregation_mode": "null", "enable_memory_saver": True,
            "weight_version": eng.weight_version, "eos_token_ids": eng.eos_token_ids,
            "internal_states": [state], "version": package_version()}
