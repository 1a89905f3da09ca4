"""OpenAI-compatible routes of the embedded engine (``/v1/chat/completions``, ``/v1/completions``).

Also ``/v1/models``, and the request/response code the agent gateway shares. OpenAI's fields
plus SGLang's extensions; ``stream=true`` as server-sent events (engine/openai_stream.py);
``top_logprobs`` / ``logprobs=k`` from the engine's own log-softmax; Hermes tool calls parsed
into ``message.tool_calls`` only when the request offers ``tools`` (and ``tool_choice`` is not
``"none"``); ``model`` names the served model or a loaded LoRA adapter (else 404). Anything the
engine cannot honour, or does not know, is refused in OpenAI's error shape, so a client never
gets silently different behaviour (docs/rollout.md, "OpenAI-compatible routes"). Bodies are
size-capped, every wait is bounded (:data:`OPENAI_TIMEOUT_S`). Never unpickles request data;
never re-tokenizes a completion.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rl_core.engine.core import EngineRequestError, EngineStateError, GenerateRequest
from rl_core.engine.openai_messages import (
    OpenAIError,
    checked,
    is_int,
    is_number,
    message_images,
    normalize_messages,
    openai_error,
    prompt_list,
)
from rl_core.engine.openai_stream import sse_response, stream_chunks, text_pieces
from rl_core.engine.protocol import BadRequest, _TooLarge, get_engine, read_body
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.tool_parser import parse_tool_calls

__all__ = ["OPENAI_TIMEOUT_S", "OpenAIError", "OpenAIRequest", "chat_choice", "chat_prompt_ids",
           "completion_choice", "completion_text", "envelope", "message_images", "normalize_messages",
           "openai_error", "parse_openai_request", "read_openai_body", "respond", "router",
           "served_names", "token_logprobs", "tool_call_id"]

router = APIRouter()

OPENAI_TIMEOUT_S = 600.0  # bound on one request's wait for the engine
MAX_N = 128  # OpenAI's own limit on ``n``
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (vLLM's default for logprobs=k too)
# Accepted and ignored: they change nothing about what is generated.
_IGNORED = {"user", "metadata", "service_tier", "parallel_tool_calls", "store",
            "prompt_cache_key", "safety_identifier", "rid"}
# Refused unless at one of these (default) values.
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "logit_bias": ({},), "min_tokens": (0,),
    "response_format": ({"type": "text"},), "functions": (), "function_call": (),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "echo": (False,), "suffix": (),
    "best_of": (1,), "regex": (), "ebnf": (), "json_schema": ()}
_WHY = {"best_of": "best_of is not supported: use n and pick on the client"}
# chat_template_kwargs may not change how the template is called, only what it renders.
_TEMPLATE_RESERVED = {"conversation", "tools", "tokenize", "add_generation_prompt",
                      "continue_final_message", "return_dict", "return_tensors", "documents"}
_CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                "top_k", "min_p", "n", "stop", "stop_token_ids", "ignore_eos", "seed",
                "logprobs", "tools", "tool_choice", "skip_special_tokens",
                "chat_template_kwargs", "return_token_ids", "top_logprobs", "model", "stream",
                "stream_options"}
_COMPLETION_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
                      "stop", "stop_token_ids", "ignore_eos", "seed", "logprobs",
                      "skip_special_tokens", "return_token_ids", "model", "stream",
                      "stream_options"}


async def read_openai_body(request: Request) -> dict[str, Any]:
    """The JSON object in the body under ``app.state.max_request_bytes``; OpenAI-shaped
    errors (400 malformed, 413 too large)."""
    try:
        return await read_body(request)
    except BadRequest as e:
        raise OpenAIError(str(e)) from None
    except _TooLarge as e:  # the protocol's own size cap, reported in OpenAI's shape
        raise OpenAIError(str(e), 413, code="request_too_large") from None


@dataclass
class OpenAIRequest:
    """A parsed ``/v1/chat/completions`` or ``/v1/completions`` body."""

    kind: str  # "chat" or "completions"
    model: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat, normalized
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    single: bool = True  # completions: one prompt (not a list of them)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (chat: top_logprobs; completions: logprobs=k)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool = False
    parse_tools: bool = False  # tools offered and tool_choice not "none": calls parsed
    skip_special_tokens: bool = True

    def sampling(self, defaults: dict[str, Any], max_new_tokens: int, seed: int | None,
                 vocab_size: int) -> SamplingParams:
        """The engine's parameters: request values, else ``defaults`` (the model's), else
        SGLang's; a ``top_k`` of at least ``vocab_size`` keeps every token (-1). Raises
        :class:`OpenAIError` for values the sampler refuses."""
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        temperature, top_k = float(pick("temperature", 1.0)), int(pick("top_k", -1))
        try:
            return SamplingParams(
                temperature=0.0 if temperature < 1e-6 else temperature,
                top_p=float(pick("top_p", 1.0)), top_k=-1 if top_k >= vocab_size else top_k,
                min_p=float(pick("min_p", 0.0)), max_new_tokens=max_new_tokens,
                stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                ignore_eos=self.ignore_eos, seed=seed)
        except (ValueError, OverflowError) as e:
            raise OpenAIError(str(e)) from None


def parse_openai_request(body: dict[str, Any], kind: str, *, max_n: int = MAX_N) -> OpenAIRequest:
    """Check a body field by field (OpenAI's names and limits); :class:`OpenAIError` names
    the first field refused and why."""
    known = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
    if unknown := sorted(set(body) - known - _IGNORED - set(_DEFAULT_ONLY)):
        raise OpenAIError(f"unrecognized request argument(s) {unknown} for /v1/"
                          f"{'chat/completions' if kind == 'chat' else 'completions'}",
                          param=unknown[0], code="unknown_parameter")
    for name, defaults in _DEFAULT_ONLY.items():
        value = body.get(name)
        if value is not None and value not in defaults:
            why = _WHY.get(name, f"{name}={json.dumps(value)[:80]} is not supported by this "
                           "server; leave it out")
            raise OpenAIError(why, param=name, code="unsupported_parameter")
    req = OpenAIRequest(kind)
    if kind == "chat":
        req.messages = normalize_messages(body.get("messages"))
        req.max_tokens = checked(body, "max_completion_tokens", is_int, "an integer")
        if req.max_tokens is None:
            req.max_tokens = checked(body, "max_tokens", is_int, "an integer")
        tools = checked(body, "tools", lambda v: isinstance(v, list) and all(
            isinstance(t, dict) and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in v), 'a list of {"type": "function", "function": {"name", ...}}')
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise OpenAIError(f"tool_choice={json.dumps(choice)[:80]} is not supported: use "
                              '"auto" or "none" (calls are parsed from the text, not forced)',
                              param="tool_choice", code="unsupported_parameter")
        req.parse_tools = bool(tools) and choice != "none"
        req.tools = tools or None if req.parse_tools else None
        req.template_kwargs = checked(body, "chat_template_kwargs", lambda v: isinstance(v, dict)
                                   and not set(v) & _TEMPLATE_RESERVED,
                                   f"an object without {sorted(_TEMPLATE_RESERVED)}") or {}
        lp = checked(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
        req.logprobs = bool(lp)
        req.top_logprobs = checked(body, "top_logprobs", lambda v: is_int(v) and
                                   0 <= v <= MAX_TOP_LOGPROBS,
                                   f"an integer in [0, {MAX_TOP_LOGPROBS}]") or 0
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
    else:
        if body.get("prompt") is None:
            raise OpenAIError("prompt is required", param="prompt")
        req.prompts, req.single = prompt_list(body["prompt"])
        req.max_tokens = checked(body, "max_tokens", is_int, "an integer")
        lp = checked(body, "logprobs", lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                     f"an integer in [0, {MAX_TOP_LOGPROBS}] (the sampled token's log-prob and "
                     "that many alternatives)")
        req.logprobs, req.top_logprobs = lp is not None, lp or 0
    if req.max_tokens is not None and req.max_tokens < 1:
        raise OpenAIError(f"max_tokens must be at least 1, got {req.max_tokens}",
                          param="max_tokens")
    req.temperature = checked(body, "temperature", lambda v: is_number(v) and v >= 0,
                           "a non-negative number")
    req.top_p = checked(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    req.top_k = checked(body, "top_k", lambda v: is_int(v) and (v == -1 or v >= 1),
                     "-1 or a positive integer")
    req.min_p = checked(body, "min_p", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
    n = checked(body, "n", lambda v: is_int(v) and 1 <= v <= max_n, f"an integer in [1, {max_n}]")
    req.n = 1 if n is None else n
    stop = checked(body, "stop", lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) and s for s in v)),
        "a string or a list of non-empty strings")
    req.stop = [stop] if isinstance(stop, str) else list(stop or [])
    req.stop = [s for s in req.stop if s]
    req.stop_token_ids = list(checked(body, "stop_token_ids", lambda v: isinstance(v, list) and all(
        is_int(t) for t in v), "a list of token ids") or [])
    req.ignore_eos = bool(checked(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean"))
    req.seed = checked(body, "seed", lambda v: is_int(v) and -(1 << 63) <= v < (1 << 63) - MAX_N,
                    "a 64-bit integer")
    skip = checked(body, "skip_special_tokens", lambda v: isinstance(v, bool), "a boolean")
    req.skip_special_tokens = True if skip is None else skip
    req.return_token_ids = bool(checked(body, "return_token_ids", lambda v: isinstance(v, bool),
                                     "a boolean"))
    req.model = checked(body, "model", lambda v: isinstance(v, str), "a string")
    req.stream = bool(checked(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    options = checked(body, "stream_options", lambda v: isinstance(v, dict) and set(v) <= {
        "include_usage", "continuous_usage_stats"} and all(isinstance(x, bool) for x in v.values()),
        'an object {"include_usage": bool}')
    if options and not req.stream:
        raise OpenAIError("stream_options is only allowed with stream=true",
                          param="stream_options")
    req.include_usage = bool((options or {}).get("include_usage"))
    return req


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """``messages`` rendered by the tokenizer's chat template with the generation prompt,
    as token ids (the template's text, encoded without added special tokens, as
    :class:`~rl_core.agents.chat.ChatTokens` encodes it)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIError("this model's tokenizer has no chat template, so chat messages cannot "
                          "be rendered; use /v1/completions with a prompt")
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=True,
            **(template_kwargs or {}))
    except Exception as e:  # the template's own checks (role order, missing fields)
        raise OpenAIError(f"the chat template could not render these messages: "
                          f"{type(e).__name__}: {e}", param="messages") from None
    if not isinstance(text, str):
        raise OpenAIError("the chat template did not render a string", status=500)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_text(tokenizer: Any, ids: Sequence[int], finish_reason: dict[str, Any], *,
                    skip_special_tokens: bool = True) -> str:
    """What the client sees of a completion: its ids decoded without the matched stop token,
    cut at a matched stop string (as SGLang and OpenAI answer)."""
    matched = finish_reason.get("matched") if finish_reason.get("type") == "stop" else None
    ids = list(ids)
    if isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    if tokenizer is None:
        return ""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if isinstance(matched, str) and (pos := text.find(matched)) >= 0:
        text = text[:pos]
    return text


def _finish(finish_reason: dict[str, Any]) -> str:
    return "length" if finish_reason.get("type") == "length" else "stop"


def _token_entry(tokenizer: Any, t: int, lp: float) -> dict[str, Any]:
    token = tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else ""
    return {"token": token, "logprob": float(lp), "bytes": list(token.encode())}


def token_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                   top: Sequence[Sequence[Sequence[Any]]] | None = None) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: each token's entry with its ``top_logprobs`` (``top``:
    the engine's ``[[logprob, id], ...]`` per token, or SGLang's ``[logprob, id, text]``)."""
    out = []
    for k, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
        alts = top[k] if top is not None and k < len(top) else []
        out.append({**_token_entry(tokenizer, t, lp),
                    "top_logprobs": [_token_entry(tokenizer, int(i), v) for v, i, *_ in alts]})
    return out


def tool_call_id(key: str, k: int) -> str:
    """A tool call's id, a function of what made it (a replayed episode gets the same ids)."""
    return f"call_{hashlib.sha256(f'{key}:{k}'.encode()).hexdigest()[:24]}"


def chat_choice(index: int, tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                finish_reason: dict[str, Any], req: OpenAIRequest, *, key: str,
                prompt_ids: Sequence[int] | None = None, text: str | None = None,
                top: Sequence[Sequence[Sequence[Any]]] | None = None) -> dict[str, Any]:
    """One ``choices[i]`` of a chat completion: the text as ``content``, Hermes tool calls
    parsed into ``tool_calls`` when the request offered tools (ids derived from ``key``),
    per-token log-probs (and ``top`` alternatives) when asked."""
    if text is None:
        text = completion_text(tokenizer, ids, finish_reason,
                               skip_special_tokens=req.skip_special_tokens)
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    reason = _finish(finish_reason)
    calls = [c for c in parse_tool_calls(text) if c.error is None] if req.parse_tools else []
    if calls:
        message["tool_calls"] = [
            {"id": tool_call_id(key, k), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for k, c in enumerate(calls)]
        reason = "tool_calls" if reason == "stop" else reason
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": reason,
                              "logprobs": None, "matched_stop": finish_reason.get("matched")}
    if req.logprobs:
        choice["logprobs"] = {"content": token_logprobs(tokenizer, ids, logprobs, top),
                              "refusal": None}
    if req.return_token_ids:
        choice["token_ids"] = list(ids)
        if prompt_ids is not None:
            choice["prompt_token_ids"] = list(prompt_ids)
    return choice


def completion_choice(index: int, tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                      finish_reason: dict[str, Any], req: OpenAIRequest, *,
                      prompt_ids: Sequence[int] | None = None, text: str | None = None,
                      top: Sequence[Sequence[Sequence[Any]]] | None = None) -> dict[str, Any]:
    """One ``choices[i]`` of a text completion (OpenAI's legacy log-prob layout; with
    ``logprobs=k``, ``top_logprobs`` maps each position's k best tokens to their log-probs)."""
    if text is None:
        text = completion_text(tokenizer, ids, finish_reason,
                               skip_special_tokens=req.skip_special_tokens)
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                              "finish_reason": _finish(finish_reason),
                              "matched_stop": finish_reason.get("matched")}
    if req.logprobs:
        entries = token_logprobs(tokenizer, ids, logprobs, top)
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        choice["logprobs"] = {"tokens": [e["token"] for e in entries],
                              "token_logprobs": [e["logprob"] for e in entries],
                              "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]}
                                               for e in entries] if req.top_logprobs else None,
                              "text_offset": offsets}
    if req.return_token_ids:
        choice["token_ids"] = list(ids)
        if prompt_ids is not None:
            choice["prompt_token_ids"] = list(prompt_ids)
    return choice


def envelope(req: OpenAIRequest, rid: str, model: str, choices: list[dict[str, Any]],
             prompt_tokens: int, completion_tokens: int,
             weight_version: Any = None) -> dict[str, Any]:
    """The response object around ``choices``; ``metadata.weight_version`` as SGLang adds it."""
    chat = req.kind == "chat"
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "metadata": {"weight_version": weight_version}}


def respond(req: OpenAIRequest, body: dict[str, Any], tokenizer: Any,
            ids: Sequence[Sequence[int]]) -> Response:
    """``body`` as JSON, or with ``stream=true`` as server-sent events (``ids``: each choice's
    completion ids, to cut its text into per-token pieces)."""
    if not req.stream:
        return JSONResponse(body)
    key = "content" if req.kind == "chat" else "text"
    pieces = [text_pieces(tokenizer, t, (c.get("message") or c)[key] or "",
                          skip_special_tokens=req.skip_special_tokens)
              for c, t in zip(body["choices"], ids, strict=True)]
    return sse_response(stream_chunks(body, pieces, include_usage=req.include_usage))


# ---------------------------------------------------------------------------- embedded routes

def _engine(request: Request) -> Any:
    try:
        return get_engine(request)
    except EngineStateError as e:
        raise OpenAIError(str(e), 503, code="engine_loading") from None


async def _generate(request: Request, eng: Any, reqs: list[GenerateRequest]) -> list[Any]:
    """Submit ``reqs`` together and wait, bounded; a client gone or the bound passed aborts
    them."""
    try:
        futures = eng.submit_all(reqs)
    except EngineRequestError as e:
        raise OpenAIError(str(e), code="invalid_request") from None
    except EngineStateError as e:
        raise OpenAIError(str(e), 503) from None
    limit = float(getattr(request.app.state, "openai_timeout_s", OPENAI_TIMEOUT_S))
    deadline = time.monotonic() + limit
    gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    while not (await asyncio.wait({gathered}, timeout=1.0))[0]:
        gone = await request.is_disconnected()
        if gone or time.monotonic() > deadline:
            await asyncio.to_thread(eng.abort, [r.rid for r in reqs])
            gathered.cancel()
            if gone:
                raise OpenAIError("client disconnected", 499)
            raise OpenAIError(f"generation did not finish within {limit:g}s", 504,
                              code="timeout")
    outs = gathered.result()
    for out in outs:
        fr = out.finish_reason
        if fr.get("type") == "abort":  # a weight update or an engine error: retry later
            status = int(fr.get("status_code") or 503)
            raise OpenAIError(f"generation aborted: {fr.get('message')}", status,
                              code="aborted")
    return outs


def _max_new(req: OpenAIRequest, eng: Any, prompt_len: int) -> int:
    """``max_tokens`` or, absent, what fits in the context (SGLang's default)."""
    room = min(eng.context_length, eng.max_total_tokens) - prompt_len
    if req.max_tokens is not None:
        return req.max_tokens
    if room < 1:
        raise OpenAIError(f"the prompt has {prompt_len} tokens, which fills the model's context "
                          f"of {eng.context_length} tokens", code="context_length_exceeded")
    return room


def served_names(eng: Any) -> list[str]:
    """The base model's names ``model`` may take: its path and that path's last part."""
    path = str(eng.model_path)
    return list(dict.fromkeys([path, path.rstrip("/").rsplit("/", 1)[-1]]))


def _model(eng: Any, name: str | None) -> str | None:
    """The LoRA adapter ``name`` selects (None: the base model); 404 for a name the engine
    does not serve, as vLLM and SGLang answer."""
    if name is None or name in served_names(eng):
        return None
    if name in eng.lora_names:
        return name
    raise OpenAIError(f"The model `{name}` does not exist: this engine serves "
                      f"{[eng.model_path, *eng.lora_names]} (GET /v1/models lists them)", 404,
                      param="model", code="model_not_found")


async def _serve(request: Request, kind: str) -> Response:
    try:
        eng = _engine(request)
        body = await read_openai_body(request)
        max_n = min(MAX_N, int(request.app.state.max_request_samples))
        req = parse_openai_request(body, kind, max_n=max_n)
        lora = _model(eng, req.model)
        tok = eng.tokenizer
        pixels = None
        if kind == "chat":
            prompts: list[list[int]] = [chat_prompt_ids(tok, req.messages, req.tools,
                                                        req.template_kwargs)]
            try:
                prompts[0], pixels = eng.images.prepare(prompts[0], message_images(req.messages))
            except EngineRequestError as exc:
                raise OpenAIError(str(exc), param="messages") from None
        else:
            if tok is None and any(isinstance(p, str) for p in req.prompts):
                raise OpenAIError("a text prompt needs a tokenizer; this model has none: send "
                                  "token ids", param="prompt")
            prompts = [tok.encode(p) if isinstance(p, str) else p for p in req.prompts]
        if len(prompts) * req.n > int(request.app.state.max_request_samples):
            raise OpenAIError(f"{len(prompts)} prompts x n={req.n} is more samples than this "
                              "server takes per request: split the request", param="n")
        rid = uuid.uuid4().hex
        reqs, owners = [], []
        for i, prompt in enumerate(prompts):
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                params = req.sampling(eng.sampling_defaults, _max_new(req, eng, len(prompt)), seed,
                                      eng.vocab_size)
                reqs.append(GenerateRequest(f"{rid}-{i}-{j}", list(prompt), params,
                                            return_logprob=True, images=pixels, lora=lora,
                                            top_logprobs_num=req.top_logprobs))
                owners.append(i)
        outs = await _generate(request, eng, reqs)
    except OpenAIError as e:
        return e.response()
    choices = []
    for k, (out, i) in enumerate(zip(outs, owners, strict=True)):
        args = (k, tok, out.output_ids, out.output_logprobs, out.finish_reason, req)
        top = out.output_top_logprobs
        choices.append(chat_choice(*args, key=f"{rid}-{k}", prompt_ids=prompts[i], top=top)
                       if kind == "chat" else
                       completion_choice(*args, prompt_ids=prompts[i], top=top))
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.output_ids) for o in outs)
    body = envelope(req, rid, req.model or eng.model_path, choices, prompt_tokens,
                    completion_tokens, eng.weight_version)
    return respond(req, body, tok, [o.output_ids for o in outs])


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, "completions")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The base model and every loaded LoRA adapter (``parent``: the base), as vLLM lists
    them; each ``id`` is a ``model`` the routes take."""
    try:
        eng = _engine(request)
    except OpenAIError as e:
        return e.response()
    base = {"object": "model", "created": 0, "owned_by": "grpoflow", "root": eng.model_path,
            "max_model_len": eng.context_length}
    return JSONResponse({"object": "list", "data": [
        {"id": eng.model_path, **base, "parent": None},
        *({"id": name, **base, "parent": eng.model_path} for name in eng.lora_names)]})
