"""The rollout plane over SGLang's HTTP API: the plane the GRPO loop uses by default.

:class:`HttpPlane` is an :class:`~rl_core.rollout.pool.EnginePool` of engine processes (the
embedded engine on CPU, real SGLang on GPUs), optionally behind ``sglang-router``, as one
:class:`~rl_core.interfaces.RolloutPlane`. Samples are built from the engines' token ids; one
made by any weight version other than the plane's fails the rollout. :meth:`paused` and
:meth:`verify` are its half of :func:`rl_core.weight_sync.sync_weights`. Never waits unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.client import RolloutError
from rl_core.rollout.pool import EnginePool
from rl_core.rollout.wire import TokenHook
from rl_core.types import Sample
from rl_core.weight_sync import WeightSyncError, served_version

__all__ = ["HttpPlane", "sampling_payload"]

log = logging.getLogger(__name__)


def sampling_payload(params: SamplingParams) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``params`` (the seed as ``sampling_seed``)."""
    out: dict[str, Any] = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "min_p": params.min_p, "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = int(params.seed)
    return out


class HttpPlane:
    """N engines behind SGLang's HTTP API as one rollout plane; owns ``pool``.
    ``before_generate`` runs before a generation while restarted engines await weights;
    ``deterministic``: one request per engine per generation (docs/rollout.md, "Deterministic
    rollouts"); ``routed_experts``: requests ask for MoE routing (routing replay)."""

    def __init__(self, pool: EnginePool, *, request_batch_size: int = 16, timeout_s: float = 600.0,
                 weight_sync_timeout_s: float = 600.0, verify_checksum: bool = True,
                 deterministic: bool = False, routed_experts: bool = False) -> None:
        if request_batch_size < 1:
            raise ValueError(f"request_batch_size must be >= 1, got {request_batch_size}")
        self.pool = pool
        self.request_batch_size = request_batch_size
        self.deterministic = deterministic
        self.routed_experts = routed_experts
        self.timeout_s = timeout_s
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.verify_checksum = verify_checksum
        self.before_generate: Callable[[], None] | None = None
        self.lora_name: str | None = None  # set by a LoRA weight sync: requests carry it
        self.pause_mode = "abort"  # rollout.pause_mode: what an update does to requests in flight
        self._version = 0  # the base model, until the first sync
        self._warned_no_checksum = False
        self.scale_target, self.scale_errors = len(pool.engines), 0  # scale_to()
        self._scaler: threading.Thread | None = None
        self._update = threading.Condition()  # updating(): "ok", "updating" or "failed"
        self._update_state = "ok"

    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._version = int(version)
        self.pool.weight_version = str(version)  # what restarted engines are re-synced to

    @property
    def urls(self) -> list[str]:
        """Where generation requests go: the router, else the engines."""
        return [self.pool.url] if self.pool.url else self.pool.engine_urls

    @property
    def client(self) -> Any:
        if self.pool.client is None:
            raise RuntimeError("the rollout plane is not started")
        return self.pool.client

    def start(self) -> HttpPlane:
        t0 = time.monotonic()
        self.pool.start()
        log.info("rollout plane: %s up in %.1fs", ", ".join(self.urls), time.monotonic() - t0)
        return self

    def close(self) -> None:
        self.pool.stop()
        if self._scaler is not None:  # an engine starting now is stopped once it is up
            self._scaler.join(self.pool.startup_timeout_s + 30.0)

    def scale_to(self, engines: int) -> None:
        """Bring the engines in service to ``engines`` in the background, one at a time: a new
        engine joins once it serves the current weights (from the staged copy, probed), the
        newest leaves after its requests finish. Generation and training go on meanwhile;
        calling again retargets. Errors are logged and counted (``scale_errors``)."""
        if engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {engines}")
        self.scale_target = engines
        if self._scaler is None or not self._scaler.is_alive():
            self._scaler = threading.Thread(target=self._scale, name="engine-scaler", daemon=True)
            self._scaler.start()

    def _scale(self) -> None:
        pool = self.pool
        while not pool._stop.is_set() and len(pool.engines) != self.scale_target:
            try:
                if len(pool.engines) < self.scale_target:
                    pool.add_engine()
                else:
                    pool.remove_engine()
            except Exception:
                self.scale_errors += 1
                log.exception("rollout plane: scaling to %d engine(s) failed", self.scale_target)
                return

    def health(self) -> dict[str, Any]:
        p = self.pool
        return {"engines": len(p.engines), "in_service": p.in_service_urls(),
                "scale_target": self.scale_target, "scale_errors": self.scale_errors,
                "awaiting_weights": p.awaiting_urls(),
                "restarts": sum(e.restarts for e in p.engines),
                "weight_version": self._version, "memory_released": sorted(p.released)}

    def loads(self) -> list[dict[str, float]]:
        """Each engine in service's queue and KV usage (its ``/v1/loads``, SGLang's): what
        adaptive agent concurrency reads (``rl_core.agents.pacing``). Bounded by the pool's
        health timeout; an engine that does not answer is left out."""
        client, out = self.client, []
        timeout = self.pool.health_timeout_s
        for url in self.pool.in_service_urls():
            try:
                body = client.run(client.aio.loads(url=url), timeout_s=timeout)
            except Exception as e:  # noqa: BLE001 - a load probe never fails the caller
                log.debug("loads of %s: %s", url, e)
                continue
            rows = body.get("loads", []) if isinstance(body, dict) else body or []
            out += [{"waiting": float(r.get("num_waiting_reqs", 0)),
                     "running": float(r.get("num_running_reqs", r.get("num_reqs", 0))),
                     "token_usage": float(r.get("token_usage", 0.0))} for r in rows]
        return out

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Engines free weights and KV cache (``tags``) while a colocated trainer runs."""
        self.pool.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.pool.resume_memory(tags)

    @property
    def memory_released(self) -> set[str]:
        return set(self.pool.released)

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
        *, partial: bool = False, images: Sequence[tuple[bytes, ...]] | None = None,
        routing_keys: Sequence[str] | None = None, top_logprobs: Sequence[int] | None = None,
        on_token: Sequence[TokenHook | None] | None = None,
    ) -> list[Sample]:
        """One sample per prompt, in order, in concurrent requests of ``request_batch_size``
        (one sample each through the router: sglang-router 0.3 refuses per-sample parameters).
        ``partial``: a stream segment; an update may abort it (tokens kept), and each sample
        is tagged with the version the engine served it with. ``routing_keys`` (session
        affinity): each prompt goes to its key's engine (``rl_core.rollout.affinity``; through
        the router, as its routing-key header), one request per engine's share.
        ``top_logprobs``: each prompt's k alternatives per token (SGLang's ``top_logprobs_num``,
        in ``meta["output_top_logprobs"]``: ``[[logprob, token_id, text], ...]`` per token);
        they never change what is sampled. ``on_token``: each prompt's hook, called with every
        token as its request streams it (SGLang's ``stream``: token id, log-prob, alternatives
        or None), on the client's thread; the samples are those of the unstreamed call."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if not prompts:
            return []
        if self.pool.released:  # never sample from engines without weights
            log.warning("engines had released %s: taking it back before sampling",
                        sorted(self.pool.released))
            self.pool.resume_memory()
        with self._update:
            if not self._update.wait_for(lambda: self._update_state != "updating",
                                         self.weight_sync_timeout_s):
                raise RolloutError(f"a weight update held generation for "
                                   f"{self.weight_sync_timeout_s:.0f}s (rollout.weight_sync_timeout_s)")
            if self._update_state == "failed":
                raise WeightSyncError("the last weight update was not verified; nothing is "
                                      "sampled from its weights until an update succeeds")
        if self.before_generate is not None and self.pool.awaiting_urls():
            self.before_generate()
        client = self.client
        size = 1 if self.pool.url else self.request_batch_size
        if self.deterministic and not self.pool.url:
            # one request per engine of the pool (a restarting one's goes to another: the
            # batches, and so the last bits, stay those of the run without the restart)
            size = -(-len(prompts) // len(self.pool.engines))
        pics = list(images) if images is not None else [()] * len(prompts)
        keys = list(routing_keys) if routing_keys is not None else [None] * len(prompts)
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} routing keys for {len(prompts)} prompts")
        groups = [list(range(len(prompts)))]
        if routing_keys is not None and not self.pool.url:  # each engine's share together
            by_engine: dict[str, list[int]] = {}
            for i, key in enumerate(keys):
                by_engine.setdefault(client.route(key), []).append(i)
            groups = list(by_engine.values())
            size = len(prompts) if self.deterministic else size
        chunks = [g[i : i + size] for g in groups for i in range(0, len(g), size)]
        kw = {"lora_path": self.lora_name, "return_routed_experts": self.routed_experts}

        tops = list(top_logprobs) if top_logprobs is not None else [0] * len(prompts)
        hooks = list(on_token) if on_token is not None else [None] * len(prompts)
        if not len(tops) == len(hooks) == len(prompts):
            raise ValueError(f"{len(tops)} top_logprobs and {len(hooks)} token hooks for "
                             f"{len(prompts)} prompts")

        async def one(idx: list[int]) -> list[Sample]:
            p, im, key = [prompts[i] for i in idx], [pics[i] for i in idx], keys[idx[0]]
            sp = [sampling_payload(params[i]) for i in idx]
            if len(p) == 1:
                return [await client.aio.generate(p[0], sp[0], **kw, image_data=im[0],
                                                  routing_key=key, top_logprobs_num=tops[idx[0]],
                                                  on_token=hooks[idx[0]])]
            return await client.aio.generate_batch(p, sp, **kw, image_data=im, routing_key=key,
                                                   top_logprobs_num=[tops[i] for i in idx],
                                                   on_token=[hooks[i] for i in idx])

        async def run_all() -> list[list[Sample]]:
            return list(await asyncio.gather(*(one(chunk) for chunk in chunks)))

        placed: dict[int, Sample] = {}
        for idx, out in zip(chunks, client.run(run_all(), timeout_s=self.timeout_s), strict=True):
            placed.update(zip(idx, out, strict=True))
        samples = [placed[i] for i in range(len(prompts))]
        for s in samples:
            self._check(s, partial)
        return samples

    def score(self, prompt: Sequence[int], completions: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each completion's per-token log-probs after ``prompt`` under the served weights
        (prefill only: a teacher scoring a student's samples). One request per call."""
        client, start = self.client, len(prompt) - 1
        seqs = [[*prompt, *c] for c in completions]
        return client.run(client.aio.score(seqs, start), timeout_s=self.timeout_s)

    def _check(self, s: Sample, partial: bool = False) -> None:
        where = s.meta.get("base_url", "an engine")
        served = s.meta.get("weight_version")
        if partial:  # interrupted by an update, or served after one: the engine's label says
            s.weight_version = served_version(served)
            return
        if s.aborted:
            raise RolloutError(f"{where}: sample {s.meta.get('id')} was aborted "
                               f"({s.finish_reason.get('message')}); the rollout is retried")
        # Version 0 is the base model, which engines report under their own initial label
        # (any non-number); an engine labelled with a version after a failed first sync
        # serves unverified weights.
        stale = (str(served) != str(self._version) if self._version
                 else served_version(served) != 0)
        if served is not None and stale:
            raise WeightSyncError(f"{where} answered with weight_version {served}, expected "
                                  f"{self._version}: an engine serves stale weights")
        s.weight_version = self._version

    # ------------------------------------------------------------------ weights

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold new generation for a weight update; it goes on when the update succeeded (a
        failed one keeps it held until one succeeds: never sample unverified weights)."""
        with self._update:
            self._update_state = "updating"
        state = "failed"
        try:
            yield
            state = "ok"
        finally:
            with self._update:
                self._update_state = state
                self._update.notify_all()

    def probe(self, prompt: Sequence[int], completions: Sequence[Sequence[int]],
              urls: Sequence[str] | None = None) -> dict[str, list[list[float]]]:
        """Each engine to update (or of ``urls``) scores ``completions`` after ``prompt``
        (prefill, served adapter included): engine -> per-token log-probs (the sync's
        behavioural check)."""
        client, start = self.client, len(prompt) - 1
        seqs = [[*prompt, *c] for c in completions]
        urls = list(urls) if urls is not None else self.pool.update_targets()
        names = {e.url: _name(e) for e in self.pool.engines}

        async def each() -> list[list[list[float]]]:
            return list(await asyncio.gather(*(
                client.aio.score(seqs, start, url=u, lora_path=self.lora_name) for u in urls)))

        scored = client.run(each(), timeout_s=self.weight_sync_timeout_s)
        return {names.get(u, u): logps for u, logps in zip(urls, scored, strict=True)}

    def rebuild(self, engines: Sequence[str]) -> None:
        """Restart the named engines (:meth:`probe`'s names) and load the current weights."""
        for e in self.pool.engines:
            if _name(e) in engines:
                log.warning("engine %d (%s): rebuilt after failing the weight probe twice",
                            e.index, e.url)
                self.pool.restart(e.index, timeout_s=self.weight_sync_timeout_s)

    @contextlib.contextmanager
    def paused(self) -> Iterator[list[str]]:
        """Pause (``pause_mode``: abort, retract or hold what is in flight) → flush (``abort``
        only: SGLang refuses a flush while requests are held) every engine; resume on exit."""
        self.client.aio.update_flush_cache = self.pause_mode == "abort"
        with self.pool.paused(timeout_s=self.weight_sync_timeout_s, mode=self.pause_mode) as urls:
            yield urls

    def verify(self, version: int, checksum: str | None) -> None:
        """Every engine to update serves ``version`` and, when it can tell, ``checksum`` (one
        call per engine, all at once)."""
        client, urls = self.client, self.pool.update_targets()

        async def each() -> list[tuple[str, str | None]]:
            return list(await asyncio.gather(*(client.aio.served_weights(
                url=u, lora_name=self.lora_name) for u in urls)))

        for url, (served, got) in zip(urls, client.run(each(), timeout_s=self.weight_sync_timeout_s),
                                      strict=True):
            if served != str(version):
                raise WeightSyncError(f"{url} serves weight_version {served}, expected {version}")
            if not self.verify_checksum or checksum is None:
                continue
            if got is None:
                if not self._warned_no_checksum:
                    log.warning("%s has no /weights_checksum: verified by version only", url)
                    self._warned_no_checksum = True
            elif got != checksum:
                ours, theirs = _algorithm(checksum), _algorithm(got)
                if ours != theirs:
                    raise WeightSyncError(
                        f"weight sync to version {version}: {url} checksums its weights with "
                        f"{theirs}, the trainer with {ours}: the engine runs another grpoflow "
                        "version; install the same one on both planes")
                raise WeightSyncError(
                    f"weight sync to version {version}: {url} serves checksum {got[:21]} but the "
                    f"trainer wrote {checksum[:21]}; refusing to sample from weights that are "
                    "not the trainer's")


def _name(engine: Any) -> str:  # noqa: ANN401 - an EngineHandle
    """How the probe's errors and metrics name an engine (and :meth:`HttpPlane.rebuild` finds it)."""
    return f"engine {engine.index} ({engine.url})"


def _algorithm(checksum: str) -> str:
    """The algorithm a weights checksum names (``xxh3-128:...``; bare hex was SHA-256)."""
    algo, sep, _ = checksum.partition(":")
    return algo if sep else "sha256"
