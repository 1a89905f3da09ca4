"""Client for SGLang's native HTTP API: the one protocol every rollout engine speaks.

The same client drives real SGLang, the embedded engine, or ``sglang-router`` in front of
either. Every request is bounded (connect, read, total); connection errors, timeouts and 5xx
are retried with jittered exponential backoff, on another engine when there are several; a 4xx
raises :class:`RolloutRequestError` with the server's message and is never retried, nor is a
collective weight-update call (docs/rollout.md, "Client, router, pool"). Never starts or stops
processes (``pool.py`` does).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import inspect
import logging
import random
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from rl_core.errors import RolloutError, RolloutRequestError
from rl_core.rollout.affinity import ROUTING_KEY_HEADER, StickyRoutes
from rl_core.rollout.wire import StreamedGenerate, TokenHook
from rl_core.rollout.wire import error_message as _error_message
from rl_core.rollout.wire import retry_rids as _retry_rids
from rl_core.types import Sample

__all__ = ["RolloutError", "RolloutRequestError", "RolloutUnavailableError", "SGLangClient",
           "SyncSGLangClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_GROUP = "weight_update_group"


class RolloutUnavailableError(RolloutError):
    """Every attempt failed on connection errors, timeouts or 5xx."""


def _sample(prompt: Sequence[int], body: dict[str, Any], base_url: str, rid: str | None,
            images: Sequence[bytes] = ()) -> Sample:
    """One ``/generate`` answer as a :class:`~rl_core.types.Sample`, naming the server. With
    images, the server's prompt must be the client's token for token (the same number of
    image pads): else the trainer would see other tokens than the engine sampled from."""
    sample = Sample.from_sglang(prompt, body)
    sample.meta.update(base_url=base_url, id=sample.meta.get("id", rid))
    if images:
        sample.images = tuple(images)
        served = sample.meta.get("prompt_tokens")
        if served is not None and int(served) != len(prompt):
            raise RolloutError(
                f"{base_url}/generate expanded the prompt's image pads to {served} prompt tokens; "
                f"the client's prompt has {len(prompt)}: the engine's image processor resizes "
                "differently (check the model's preprocessor_config.json min/max_pixels and "
                "data.image_min_pixels / image_max_pixels)")
    return sample


def _images_payload(images: Sequence[Sequence[bytes]], *, single: bool) -> dict[str, Any]:
    """SGLang's ``image_data`` for prompts' images (base64 strings; none: no field)."""
    if not any(images):
        return {}
    encoded = [[base64.b64encode(x).decode("ascii") for x in per] for per in images]
    return {"image_data": encoded[0] if single else encoded}


def _tags(tags: Sequence[str] | None) -> dict[str, Any]:
    return {"tags": list(tags) if tags is not None else None}


def _version(weight_version: int | str | None) -> dict[str, str]:
    return {} if weight_version is None else {"weight_version": str(weight_version)}


class SGLangClient:
    """Async client for one or more SGLang-protocol servers (engines or a router).
    Generation is spread round-robin over ``base_urls``, failing over (a failed engine cools
    down ``engine_cooldown_s``); control calls need ``url=`` unless there is one base URL.
    A client belongs to the event loop that first uses it (httpx connections do)."""

    def __init__(self, base_urls: str | Sequence[str], *, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 600.0, total_timeout_s: float = 900.0,
                 control_timeout_s: float = 120.0, max_retries: int = 4,
                 backoff_base_s: float = 0.1, backoff_max_s: float = 5.0,
                 max_concurrency: int = 256, engine_cooldown_s: float = 2.0) -> None:
        self.set_base_urls(base_urls)
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.total_timeout_s, self.control_timeout_s = total_timeout_s, control_timeout_s
        self.max_retries, self.backoff_base_s, self.backoff_max_s = (
            max_retries, backoff_base_s, backoff_max_s)
        self.max_concurrency, self.engine_cooldown_s = max_concurrency, engine_cooldown_s
        # A weight update's flush_cache when the caller does not say: off while a pause holds
        # requests (rollout.pause_mode retract / in_place: SGLang fails the flush then)
        self.update_flush_cache = True
        self._sem, self._rr = asyncio.Semaphore(max_concurrency), 0
        self._down_until: dict[str, float] = {}  # base URL -> end of its cooldown
        self._sticky = StickyRoutes()  # session affinity: routing key -> its engine
        self._inflight: dict[str, str] = {}  # rid -> base URL serving it
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s,
                                  write=read_timeout_s, pool=total_timeout_s),
            # Headroom above the semaphore so control calls never queue behind generation.
            limits=httpx.Limits(max_connections=max_concurrency + 32, max_keepalive_connections=64))

    @property
    def base_urls(self) -> list[str]:
        return list(self._urls)

    def set_base_urls(self, base_urls: str | Sequence[str]) -> None:
        """Replace the set of servers generation requests are spread over."""
        urls = [u.rstrip("/") for u in ([base_urls] if isinstance(base_urls, str) else base_urls)]
        if not urls:
            raise ValueError("SGLangClient needs at least one base URL")
        self._urls = urls

    def _pick(self, avoid: set[str], key: str | None = None) -> str:
        """The next engine round-robin, or the one ``key``'s session sticks to (rl_core.rollout
        .affinity: its first request's round-robin pick, while that engine is live)."""
        urls, now = self._urls, time.monotonic()
        if key is not None:
            return self._sticky.route(key, lambda u: u in urls and u not in avoid
                                      and self._down_until.get(u, 0.0) <= now,
                                      lambda: self._pick(avoid))
        for _ in range(len(urls)):
            url = urls[self._rr % len(urls)]
            self._rr += 1
            if url not in avoid and self._down_until.get(url, 0.0) <= now:
                return url
        fresh = [u for u in urls if u not in avoid] or urls
        url = fresh[self._rr % len(fresh)]
        self._rr += 1
        return url

    def _control_url(self, url: str | None) -> str:
        if url is not None:
            return url.rstrip("/")
        if len(self._urls) != 1:
            raise ValueError(f"this client holds {len(self._urls)} base URLs; pass url= to say "
                             "which server the control call is for")
        return self._urls[0]

    def route(self, key: str) -> str:
        """The engine a request keyed ``key`` goes to now (session affinity)."""
        return self._pick(set(), key)

    async def _request(self, method: str, path: str, *, json: Any = None, url: str | None = None,
                       retries: int | None = None, total_timeout_s: float | None = None,
                       rid: str | None = None, limited: bool = False, key: str | None = None,
                       stream: StreamedGenerate | None = None) -> tuple[httpx.Response, str]:
        """One logical request: bounded attempts, failover when ``url`` is not pinned (a
        ``key``: to its engines in affinity order; sent as the router's routing key; a
        ``stream``: read as server-sent events, its hooks fed as they come).
        Returns the response (status < 400) and the base URL that answered."""
        attempts = 1 + (self.max_retries if retries is None else retries)
        total = self.total_timeout_s if total_timeout_s is None else total_timeout_s
        failed, errors = set(), []  # engines that failed this round; why each attempt failed
        for attempt in range(attempts):
            if url is None and len(failed) >= len(self._urls):
                failed.clear()  # every engine failed once: start another round
            base = url if url is not None else self._pick(failed, key)
            t0 = time.monotonic()
            if rid is not None:
                self._inflight[rid] = base
            body = json if attempt == 0 else _retry_rids(json, attempt)
            try:
                headers = {ROUTING_KEY_HEADER: key} if key else None
                async with self._sem if limited else contextlib.nullcontext():
                    resp = await asyncio.wait_for(
                        stream.send(self._http, method, base + path, body, headers) if stream
                        else self._http.request(method, base + path, json=body,
                                                headers=headers), total)
            except (httpx.TransportError, TimeoutError) as e:
                what = "no answer within the total bound" if isinstance(e, TimeoutError) else e
                reason = f"{type(e).__name__}: {what}" if str(what) else type(e).__name__
                if isinstance(e, TimeoutError | httpx.TimeoutException) and rid is not None:
                    await self._abort_quietly(base, rid)
            else:
                if resp.status_code < 400:
                    self._down_until.pop(base, None)
                    log.debug("%s %s%s: %d in %.2fs", method, base, path, resp.status_code,
                              time.monotonic() - t0)
                    return resp, base
                if resp.status_code < 500:
                    raise RolloutRequestError(base + path, resp.status_code, _error_message(resp))
                reason = f"HTTP {resp.status_code}: {_error_message(resp)}"
            finally:
                if rid is not None and self._inflight.get(rid) == base:
                    del self._inflight[rid]
            elapsed = time.monotonic() - t0
            errors.append(f"{base}: {reason} after {elapsed:.2f}s")
            failed.add(base)
            if url is None and len(self._urls) > 1:
                self._down_until[base] = time.monotonic() + self.engine_cooldown_s
            if attempt + 1 < attempts:
                delay = random.uniform(0.5, 1) * min(self.backoff_max_s,  # exponential, jittered
                                                     self.backoff_base_s * 2**attempt)
                log.warning("%s %s%s failed (%s after %.2fs); retry %d/%d in %.2fs", method, base,
                            path, reason, elapsed, attempt + 1, attempts - 1, delay)
                await asyncio.sleep(delay)
        raise RolloutUnavailableError(
            f"{method} {path}: {attempts} attempt(s) failed: " + "; ".join(errors))

    async def _abort_quietly(self, base: str, rid: str) -> None:
        """Best effort: a timed-out request should not keep running on the engine."""
        try:
            await asyncio.wait_for(self._http.post(base + "/abort_request", json={"rid": rid}), 2.0)
        except (httpx.HTTPError, TimeoutError) as e:
            log.debug("abort of %s on %s failed: %s", rid, base, e)

    async def _control(self, method: str, path: str, *, json: Any = None, url: str | None = None,
                       retries: int | None = None, timeout_s: float | None = None) -> Any:
        """One call to one server (``url``); ``success: false`` raises like a 4xx."""
        base, t0 = self._control_url(url), time.monotonic()
        resp, _ = await self._request(method, path, json=json, url=base, retries=retries,
                                      total_timeout_s=timeout_s or self.control_timeout_s)
        try:  # SGLang answers some control calls with an empty body or plain text
            body = resp.json() if resp.content else None
        except ValueError:
            body = resp.text
        if isinstance(body, dict) and body.get("success") is False:
            raise RolloutRequestError(base + path, resp.status_code, str(body.get("message")))
        log.debug("%s %s%s: waited %.2fs", method, base, path, time.monotonic() - t0)
        return body

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                       return_logprob: bool = True, rid: str | None = None,
                       lora_path: str | None = None, return_routed_experts: bool = False,
                       image_data: Sequence[bytes] = (), routing_key: str | None = None,
                       top_logprobs_num: int = 0, on_token: TokenHook | None = None) -> Sample:
        """One sample for one prompt (one HTTP request, as slime sends them); ``lora_path``:
        the name of a loaded LoRA adapter to sample with (SGLang's field);
        ``return_routed_experts``: the sample carries its MoE routing (``routed_experts``);
        ``image_data``: the prompt's images (encoded bytes, sent as SGLang's base64 strings;
        the prompt's image pads already expanded: :func:`_images_payload`);
        ``top_logprobs_num``: SGLang's k alternatives per token (``meta["output_top_logprobs"]``);
        ``on_token``: streamed (SGLang's ``stream``), called per token as it arrives, the same
        sample returned (:class:`~rl_core.rollout.wire.StreamedGenerate`)."""
        if not input_ids:
            raise ValueError("generate: input_ids is empty")
        rid = rid or uuid.uuid4().hex
        payload = {"input_ids": [int(t) for t in input_ids], "rid": rid,
                   "sampling_params": dict(sampling_params), "return_logprob": return_logprob,
                   **({"lora_path": lora_path} if lora_path else {}),
                   **({"return_routed_experts": True} if return_routed_experts else {}),
                   **({"top_logprobs_num": top_logprobs_num} if top_logprobs_num else {}),
                   **({"stream": True} if on_token else {}),
                   **_images_payload([image_data], single=True)}
        stream = StreamedGenerate([on_token], single=True) if on_token else None
        resp, base = await self._request("POST", "/generate", json=payload, rid=rid, limited=True,
                                         key=routing_key, stream=stream)
        body = resp.json()  # a list from a server that answers n>1 style even for one sample
        return _sample(input_ids, body[0] if isinstance(body, list) else body, base, rid,
                       image_data)

    async def generate_batch(self, input_ids: Sequence[Sequence[int]],
                             sampling_params: dict[str, Any] | Sequence[dict[str, Any]], *,
                             return_logprob: bool = True, rid: Sequence[str] | None = None,
                             lora_path: str | None = None,
                             return_routed_experts: bool = False,
                             image_data: Sequence[Sequence[bytes]] | None = None,
                             routing_key: str | None = None,
                             top_logprobs_num: Sequence[int] | None = None,
                             on_token: Sequence[TokenHook | None] | None = None) -> list[Sample]:
        """One batched request: one sample per prompt, in order (retried as a whole);
        ``image_data``: each prompt's images (as :meth:`generate`'s); ``routing_key``: to that
        key's engine (session affinity); ``top_logprobs_num``: each prompt's k alternatives;
        ``on_token``: each prompt's hook (any: the batch is streamed, as :meth:`generate`)."""
        if not (n := len(input_ids)) or any(len(p) == 0 for p in input_ids):
            raise ValueError("generate_batch: empty batch or empty prompt")
        rids = list(rid) if rid is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != n:
            raise ValueError(f"generate_batch: {len(rids)} rids for {n} prompts")
        if not isinstance(sampling_params, dict):
            sampling_params = [dict(p) for p in sampling_params]
            if len(sampling_params) != n:
                raise ValueError(
                    f"generate_batch: {len(sampling_params)} sampling_params for {n} prompts")
        payload = {"input_ids": [[int(t) for t in p] for p in input_ids], "rid": rids,
                   "sampling_params": sampling_params, "return_logprob": return_logprob,
                   **({"lora_path": [lora_path] * n} if lora_path else {}),
                   **({"return_routed_experts": True} if return_routed_experts else {}),
                   **({"top_logprobs_num": list(top_logprobs_num)} if any(top_logprobs_num or ())
                      else {}),
                   **({"stream": True} if any(on_token or ()) else {}),
                   **_images_payload(image_data or [()] * n, single=False)}
        stream = StreamedGenerate(on_token, single=False, n=n) if any(on_token or ()) else None
        resp, base = await self._request("POST", "/generate", json=payload, limited=True,
                                         key=routing_key, stream=stream)
        if not isinstance(body := resp.json(), list) or len(body) != n:
            raise RolloutError(
                f"{base}/generate: expected a list of {n} results, got "
                f"{type(body).__name__} of length {len(body) if isinstance(body, list) else 1}")
        images = image_data or [()] * n
        return [_sample(p, b, base, r, i)
                for p, b, r, i in zip(input_ids, body, rids, images, strict=True)]

    async def score(self, input_ids: Sequence[Sequence[int]], start: int, *,
                    url: str | None = None, lora_path: str | None = None) -> list[list[float]]:
        """Prefill scoring (no generation), as miles does it: one batched ``/generate`` with
        ``max_new_tokens: 0`` and ``logprob_start_len: start``; per sequence the log-probs
        of its tokens ``start + 1`` onwards (SGLang's ``input_token_logprobs``, first entry
        null, dropped), unscaled ``log_softmax(logits)``. ``url``: that engine only."""
        if not input_ids or any(len(p) <= start + 1 for p in input_ids):
            raise ValueError(f"score: empty batch, or a sequence with nothing after {start}")
        n = len(input_ids)
        payload = {"input_ids": [[int(t) for t in p] for p in input_ids],
                   "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                   "logprob_start_len": int(start),
                   **({"lora_path": [lora_path] * n} if lora_path else {})}
        resp, base = await self._request("POST", "/generate", json=payload, url=url,
                                         limited=True)
        body = resp.json()
        if not isinstance(body, list) or len(body) != len(input_ids):
            raise RolloutError(f"{base}/generate: expected {len(input_ids)} scored sequences")
        out = []
        for seq, item in zip(input_ids, body, strict=True):
            entries = item["meta_info"]["input_token_logprobs"][1:]
            if len(entries) != len(seq) - start - 1:
                raise RolloutError(f"{base}/generate: {len(entries) + 1} prompt log-probs for "
                                   f"positions {start}..{len(seq) - 1}")
            out.append([float(e[0]) for e in entries])
        return out

    async def health_generate(self, *, url: str | None = None, timeout_s: float = 20.0) -> bool:
        """True when the server answers ``/health_generate`` with 200 within ``timeout_s``."""
        try:
            await self._control("GET", "/health_generate", url=url, retries=0, timeout_s=timeout_s)
        except RolloutError as e:
            log.debug("health_generate %s: %s", url or self._urls[0], e)
            return False
        return True

    async def _get_with_fallback(self, paths: Sequence[str], url: str | None) -> Any:
        """GET the first of ``paths`` the server has (404/405: try the next, older name)."""
        for path in paths[:-1]:
            try:
                return await self._control("GET", path, url=url)
            except RolloutRequestError as e:
                if e.status not in (404, 405):
                    raise
        return await self._control("GET", paths[-1], url=url)

    async def model_info(self, *, url: str | None = None) -> dict[str, Any]:
        """``/model_info`` (falls back to the older ``/get_model_info``)."""
        return await self._get_with_fallback(("/model_info", "/get_model_info"), url)

    async def server_info(self, *, url: str | None = None) -> dict[str, Any]:
        """``/server_info`` (falls back to the older ``/get_server_info``)."""
        return await self._get_with_fallback(("/server_info", "/get_server_info"), url)

    async def loads(self, *, url: str | None = None) -> Any:
        """``/v1/loads`` (falls back to the older ``/get_load``)."""
        return await self._get_with_fallback(("/v1/loads", "/get_load"), url)

    async def weight_version(self, *, url: str | None = None) -> str:
        """The weight version the server serves now (``/model_info``, else the old endpoint)."""
        info = await self.model_info(url=url)
        if isinstance(info, dict) and info.get("weight_version") is not None:
            return str(info["weight_version"])
        return str((await self._control("GET", "/get_weight_version", url=url))["weight_version"])

    async def weights_checksum(self, *, url: str | None = None,
                               lora_name: str | None = None) -> str | None:
        """The checksum of the served weights, or of LoRA adapter ``lora_name`` (the embedded
        engine's ``/weights_checksum``); ``None`` from a server without that endpoint (real
        SGLang answers 404)."""
        path = "/weights_checksum" + (f"?lora_name={quote(lora_name)}" if lora_name else "")
        try:
            body = await self._control("GET", path, url=url)
        except RolloutRequestError as e:
            if e.status == 404:
                return None
            raise
        return str(body["checksum"])

    async def served_weights(self, *, url: str | None = None,
                             lora_name: str | None = None) -> tuple[str, str | None]:
        """``(weight_version, checksum)`` in one call where the server has
        ``/weights_checksum`` (ours); else the version alone (real SGLang: checksum None)."""
        path = "/weights_checksum" + (f"?lora_name={quote(lora_name)}" if lora_name else "")
        try:
            body = await self._control("GET", path, url=url)
        except RolloutRequestError as e:
            if e.status != 404:
                raise
            return await self.weight_version(url=url), None
        return str(body["weight_version"]), str(body["checksum"])

    async def pause(self, mode: str = "abort", *, url: str | None = None) -> None:
        """``/pause_generation`` (old servers take no body: retried once without it)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place; got {mode!r}")
        try:
            await self._control("POST", "/pause_generation", json={"mode": mode}, url=url)
        except RolloutRequestError as e:
            if e.status not in (400, 422):
                raise
            await self._control("POST", "/pause_generation", url=url)

    async def resume(self, *, url: str | None = None) -> None:
        """``/continue_generation``."""
        await self._control("POST", "/continue_generation", json={}, url=url)

    async def flush_cache(self, *, url: str | None = None, wait_s: float = 60.0) -> None:
        """``/flush_cache``; SGLang answers 400 while requests run, so retry until ``wait_s``."""
        base, t0, pause = self._control_url(url), time.monotonic(), 0.05
        while True:
            try:
                await self._control("POST", "/flush_cache", url=base)
            except RolloutRequestError as e:
                if (waited := time.monotonic() - t0) >= wait_s or e.status != 400:
                    raise RolloutRequestError(
                        e.url, e.status, f"{e.message} (gave up after {waited:.1f}s)") from e
                await asyncio.sleep(min(pause, max(0.01, wait_s - waited)))
                pause = min(1.0, pause * 2)
                continue
            if (waited := time.monotonic() - t0) > 1.0:
                log.info("flush_cache %s: waited %.1fs for running requests", base, waited)
            return

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """``/abort_request`` on the engine serving ``rid``, or on every base URL."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort: pass rid= or abort_all=True (exactly one)")
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        known = self._inflight.get(rid) if rid is not None else None
        await asyncio.gather(*(self._control("POST", "/abort_request", json=body, url=u, retries=1)
                               for u in ([known] if known else self.base_urls)))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | str | None = None, *,
        url: str | None = None, flush_cache: bool | None = None, abort_all_requests: bool = False,
        timeout_s: float | None = None) -> dict[str, Any]:
        """``/update_weights_from_disk``: reload weights from ``model_path`` (safetensors)."""
        body = {"model_path": str(model_path), "flush_cache": self._flush(flush_cache),
                "abort_all_requests": abort_all_requests, **_version(weight_version)}
        return await self._control("POST", "/update_weights_from_disk", json=body, url=url,
                                   retries=1, timeout_s=timeout_s)

    async def update_weights_from_shared_memory(
        self, path: str, layout: list[dict[str, Any]], size: int,
        weight_version: int | str | None = None, *, url: str | None = None,
        timeout_s: float | None = None) -> dict[str, Any]:
        """``/update_weights_from_shared_memory`` (grpoflow's engines: ``weight_sync: shm``)."""
        body = {"path": path, "layout": layout, "size": int(size), **_version(weight_version)}
        return await self._control("POST", "/update_weights_from_shared_memory", json=body,
                                   url=url, retries=1, timeout_s=timeout_s)

    def _flush(self, flush_cache: bool | None) -> bool:
        return self.update_flush_cache if flush_cache is None else flush_cache

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, url: str | None = None,
                                timeout_s: float | None = None) -> dict[str, Any]:
        """``/load_lora_adapter``: hold the PEFT adapter at ``lora_path`` as ``lora_name``."""
        body = {"lora_name": lora_name, "lora_path": str(lora_path)}
        return await self._control("POST", "/load_lora_adapter", json=body, url=url, retries=1,
                                   timeout_s=timeout_s)

    async def unload_lora_adapter(self, lora_name: str, *, url: str | None = None,
                                  missing_ok: bool = False) -> dict[str, Any] | None:
        """``/unload_lora_adapter``; ``missing_ok``: an adapter not loaded is no error."""
        try:
            return await self._control("POST", "/unload_lora_adapter",
                                       json={"lora_name": lora_name}, url=url, retries=1)
        except RolloutRequestError as e:
            if missing_ok and e.status == 400:  # SGLang's wording differs from ours
                return None
            raise

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
        group_name: str = _GROUP, backend: str = "nccl", url: str | None = None,
        timeout_s: float | None = None) -> dict[str, Any]:
        """``/init_weights_update_group`` (a rendezvous: never retried)."""
        body = {"master_address": master_address, "master_port": int(master_port),
                "rank_offset": int(rank_offset), "world_size": int(world_size),
                "group_name": group_name, "backend": backend}
        return await self._control("POST", "/init_weights_update_group", json=body, url=url,
                                   retries=0, timeout_s=timeout_s)

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
        group_name: str = _GROUP, weight_version: int | str | None = None,
        flush_cache: bool | None = None, abort_all_requests: bool = False,
        load_format: str | None = None, url: str | None = None, timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_distributed``: receive one bucket broadcast (never retried)."""
        body = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(s) for s in shapes], "group_name": group_name,
                "flush_cache": self._flush(flush_cache), "abort_all_requests": abort_all_requests,
                "load_format": load_format, **_version(weight_version)}
        return await self._control("POST", "/update_weights_from_distributed", json=body, url=url,
                                   retries=0, timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str = _GROUP, *,
                                           url: str | None = None) -> dict[str, Any]:
        """``/destroy_weights_update_group``."""
        return await self._control("POST", "/destroy_weights_update_group",
                                   json={"group_name": group_name}, url=url, retries=0)

    async def update_weight_version(self, version: int | str, *, abort_all_requests: bool = False,
                                    url: str | None = None) -> dict[str, Any]:
        """``/update_weight_version``: relabel the served weights."""
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self._control("POST", "/update_weight_version", json=body, url=url)

    async def release_memory(self, tags: Sequence[str] | None = None, *,
                             url: str | None = None) -> None:
        """``/release_memory_occupation`` (``tags=None``: weights, KV cache and CUDA graphs)."""
        await self._control("POST", "/release_memory_occupation", json=_tags(tags), url=url)

    async def resume_memory(self, tags: Sequence[str] | None = None, *,
                            url: str | None = None) -> None:
        """``/resume_memory_occupation``."""
        await self._control("POST", "/resume_memory_occupation", json=_tags(tags), url=url)


class SyncSGLangClient:
    """An :class:`SGLangClient` for synchronous callers: the async client lives on a private
    event loop in a daemon thread; every coroutine method of :class:`SGLangClient` is a blocking
    call here, with the same signature (``client.generate_batch(...)`` returns the list).
    ``run(coro)`` runs any coroutine on that loop. Thread-safe; ``close()`` stops the loop."""

    def __init__(self, base_urls: str | Sequence[str], **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="sglang-client-loop", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> SGLangClient:
            return SGLangClient(base_urls, **kwargs)

        self.aio: SGLangClient = self.run(make())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for it (at most ``timeout_s``)."""
        if self._closed or threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SyncSGLangClient is closed" if self._closed else
                               "SyncSGLangClient.run called from its own event loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"rollout call did not finish within {timeout_s}s") from None
        except BaseException:
            fut.cancel()
            raise

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "aio":  # not set yet: no recursion
            raise AttributeError(name)
        attr = getattr(self.aio, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.run(attr(*args, **kwargs))

        call.__name__, call.__doc__ = name, attr.__doc__
        return call

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the HTTP connections and stop the loop thread (idempotent)."""
        if self._closed:
            return
        try:
            self.run(self.aio.aclose(), timeout_s=timeout_s)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> SyncSGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
