"""The service's operations, without HTTP: sessions, training models, checkpoints and
sampling, each submission turned into a job for its base model's worker, or for sampling its
sampling threads, which run several tenants' samples at once (:mod:`.futures`).

A submission that cannot be accepted raises :class:`ApiError` (its HTTP status and message;
never 402 or 409, which the SDK retries for minutes; 429 for a full queue, which it retries
with the same ``seq_id``). Once a training request holds its ``seq_id`` it is always accepted,
and a problem fails its future instead (category ``user``), so the model's later requests are
not left waiting for it.

The tracker (optional) hears of every training client: :class:`~.backend.MetricsTracker`'s
``log_metrics``, and when it has them the :class:`~.backend.LineageTracker` calls (the run's
start with its parameters, each call's timings, each saved checkpoint, the run's end), all
from the base model's worker thread, in the order the work ran; a failing tracker is logged
and never fails a request.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grpoflow.tinker.backend import Backend, MetricsTracker
from grpoflow.tinker.errors import ApiError
from grpoflow.tinker.futures import FutureStore, QueueFull, Result, Scheduler
from grpoflow.tinker.proto import FwdBwdRequest, clean_metrics, encode_forward_backward_output
from grpoflow.tinker.sampling import SamplingOps
from grpoflow.tinker.schemas import (
    CreateModelBody,
    LoadWeightsBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
)
from grpoflow.tinker.state import (
    CheckpointStore,
    Registry,
    Sampler,
    TrainingModel,
    check_name,
    now_iso,
)
from rl_core.tinker import LOSSES, AdamParams, TinkerError

__all__ = ["ApiError", "TinkerService"]

log = logging.getLogger(__name__)

def _model_info(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


class TinkerService(SamplingOps):
    """Everything behind the HTTP routes (:mod:`.app`); ``owner`` is the caller's identity
    (from the API key): sessions, models, samplers and runs are visible to their owner only."""

    def __init__(self, backend: Backend, root: Path, *, tracker: MetricsTracker | None = None,
                 max_queued: int = 256, session_ttl_s: float = 1800.0,
                 sample_threads: int = 16) -> None:
        self.backend, self.tracker, self.max_queued = backend, tracker, max_queued
        self.cleanup_wait_s = 600.0  # a finished session's cleanup waits for its samples
        self.session_ttl_s = session_ttl_s
        self.reap_every_s = min(60.0, max(0.05, session_ttl_s / 4))
        self.base_models = list(backend.base_model_names())
        self.tokenizers = {name: str(backend.tokenizer_dir(name)) for name in self.base_models}
        self.model_info = {name: _model_info(d) for name, d in self.tokenizers.items()}
        self.store = CheckpointStore(Path(root))
        self.registry = Registry()
        self.futures = FutureStore()
        self.scheduler = Scheduler(self.base_models, self.futures, sample_threads)
        self._closed = threading.Event()
        threading.Thread(target=self._reap, name="tinker-reaper", daemon=True).start()

    # ------------------------------------------------------------------ service
    def capabilities(self) -> dict[str, Any]:
        models = []
        for name in self.base_models:
            entry: dict[str, Any] = {"model_name": name, "trainable": True, "sampleable": True}
            if isinstance(ctx := self.model_info[name].get("max_position_embeddings"), int):
                entry["max_context_length"] = ctx
            models.append(entry)
        return {"supported_models": models}

    def _base(self, name: str | None) -> str:
        if name not in self.scheduler.workers:
            raise ApiError(400, f"unknown base model {name!r}: this server serves "
                           f"{', '.join(self.base_models) or 'no models'}")
        return name

    def _session(self, session_id: str, owner: str) -> Any:  # noqa: ANN401
        try:
            return self.registry.session(session_id, owner)
        except KeyError as exc:
            raise ApiError(404, str(exc.args[0])) from None
        except TinkerError as exc:
            raise ApiError(400, str(exc)) from None

    def _model(self, model_id: str, owner: str) -> TrainingModel:
        try:
            return self.registry.model(model_id, owner)
        except KeyError as exc:
            raise ApiError(404, f"{exc.args[0]} (create it with create_lora_training_client; "
                           "models do not outlive the server process)") from None

    def heartbeat(self, session_id: str, owner: str) -> dict[str, Any]:
        with self.registry.lock:
            session = self.registry.sessions.get(session_id)
            if session is None or session.owner != owner:
                raise ApiError(404, f"unknown session {session_id!r}")
            if session.finished:
                raise ApiError(410, f"session {session_id} is finished")
        self._session(session_id, owner)
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, owner: str | None) -> None:
        """Mark the session finished (``owner`` None: expired). Its models and samplers are
        forgotten; after the work already queued, its models leave the backend (when it has
        ``delete_model``) and its ephemeral sampler weights are deleted."""
        with self.registry.lock:
            session = self.registry.sessions.get(session_id)
            if session is None or owner not in (None, session.owner):
                raise ApiError(404, f"unknown session {session_id!r}")
            if session.finished:
                return
            session.finished = True
            models = [m for i in session.model_ids if (m := self.registry.models.pop(i, None))]
            samplers = [x for i in session.sampler_ids
                        if (x := self.registry.samplers.pop(i, None)) and x.ephemeral]
        delete = getattr(self.backend, "delete_model", None)
        for base in self.base_models:
            mine = [m.id for m in models if m.base_model == base]
            dirs = [x.adapter_dir for x in samplers if x.base_model == base and x.adapter_dir]
            if not (mine or dirs):
                continue

            mark = self.scheduler.samplers[base].mark()

            def cleanup(mine: list[str] = mine, dirs: list[Path] = dirs,
                        base: str = base, mark: int = mark) -> Result:
                # the samples queued before run first (they may read the ephemeral weights)
                self.scheduler.samplers[base].wait_queued_before(mark, self.cleanup_wait_s)
                for model_id in mine:  # after the work queued before: the run's last metrics
                    self._lineage("end_run", model_id, "FINISHED")
                for model_id in mine if callable(delete) else ():
                    delete(model_id)
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
                return Result(json={})

            self.scheduler.submit(base, cleanup)
        for model in models:
            self.scheduler.forget(model.id)

    def _reap(self) -> None:
        """Every ``reap_every_s``: finish the sessions silent for ``session_ttl_s`` (no
        heartbeat: the client is gone) and drop expired results."""
        while not self._closed.wait(self.reap_every_s):
            now = time.monotonic()
            with self.registry.lock:
                stale = [s.id for s in self.registry.sessions.values()
                         if not s.finished and now - s.last_seen > self.session_ttl_s]
            try:
                for session_id in stale:
                    log.info("session %s expired (no heartbeat for %.0f s)", session_id,
                             self.session_ttl_s)
                    self.finish_session(session_id, None)
                self.futures.sweep(force=True)
            except Exception:  # noqa: BLE001 - the reaper carries on
                log.exception("reaping sessions failed")

    # ------------------------------------------------------------------ models
    def _job(self, fn: Callable[[], Result], model: TrainingModel | None = None,
             creates: bool = False) -> Callable[[], Result]:
        """``fn`` as a job: it fails at once if ``model``'s creation failed; a failure of a
        creating job is remembered on ``model``."""
        def run() -> Result:
            if model is not None and model.error is not None and not creates:
                raise TinkerError(f"model {model.id} could not be created: {model.error}")
            try:
                return fn()
            except Exception as exc:
                if creates and model is not None:
                    model.error = str(exc) or type(exc).__name__
                raise
        return run

    def _run_meta(self, model: TrainingModel, lora: Mapping[str, Any],
                  user_metadata: Mapping[str, Any] | None) -> dict[str, Any]:
        return {"training_run_id": model.id, "base_model": model.base_model,
                "model_owner": model.owner, "is_lora": True, "lora_rank": model.rank,
                "lora_config": dict(lora), "session_id": model.session_id,
                "created": now_iso(),
                "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()}}

    def _lineage(self, method: str, *args: Any) -> None:  # noqa: ANN401
        """``tracker.<method>(*args)`` if the tracker has it; its failure is only logged."""
        if (fn := getattr(self.tracker, method, None)) is None:
            return
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - tracking never fails a request
            log.warning("tracker %s failed", method, exc_info=True)

    def _start_run(self, model: TrainingModel, flags: Mapping[str, Any], seed: int | None,
                   user_metadata: Mapping[str, Any] | None, source: str | None = None) -> None:
        """The tracker's run for a new training client: its parameters (never a key: the
        tenant is its name) and the tags linking it to the service's ids."""
        params = {"base_model": model.base_model, "lora_rank": model.rank, "seed": seed,
                  **{k: bool(v) for k, v in flags.items() if k.startswith("train_")},
                  "tenant": model.owner}
        tags = {"tinker.training_run_id": model.id, "tinker.session_id": model.session_id,
                "tinker.tenant": model.owner, "tinker.checkpoints": f"tinker://{model.id}"}
        if (session := self.registry.sessions.get(model.session_id)) is not None:
            if session.tags:
                tags["tinker.session_tags"] = ",".join(map(str, session.tags))
            tags |= {f"tinker.session_metadata.{k}": str(v)
                     for k, v in session.user_metadata.items()}
        tags |= {f"tinker.user_metadata.{k}": str(v) for k, v in (user_metadata or {}).items()}
        if source is not None:
            params["resumed_from"] = tags["tinker.resumed_from"] = source
        self._lineage("start_run", model.id, params, tags)

    def create_model(self, body: CreateModelBody, owner: str) -> dict[str, Any]:
        session = self._session(body.session_id, owner)
        base = self._base(body.base_model)
        if (body.optimizer_config or {}).get("type", "adamw") != "adamw":
            raise ApiError(400, "only the adamw optimizer is supported by this server")
        lora = body.lora_config
        if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise ApiError(400, "at least one of train_mlp, train_attn, train_unembed")
        model_id = f"{session.id}:train:{body.model_seq_id}"
        model = TrainingModel(id=model_id, session_id=session.id, owner=owner,
                              base_model=base, rank=lora.rank)

        def create() -> Result:
            self.backend.create_model(model_id, base, lora.rank, seed=lora.seed,
                                      train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                                      train_unembed=lora.train_unembed)
            self.store.write_run(self._run_meta(model, lora.model_dump(), body.user_metadata))
            self._start_run(model, lora.model_dump(), lora.seed, body.user_metadata)
            return Result(json={"model_id": model_id, "type": "create_model"})

        return self._add_model(model, create)

    def _add_model(self, model: TrainingModel, create: Callable[[], Result]) -> dict[str, Any]:
        """Register ``model`` and queue its creation; a model id seen before (a retried
        POST) answers the first creation's request id."""
        with self.registry.lock:
            if (old := self.registry.models.get(model.id)) is not None:
                return {"request_id": old.request_id, "model_id": old.id}
            self.scheduler.open_order(model.id, model.base_model, owner=model.owner)
            model.request_id = self.scheduler.submit(
                model.base_model, self._job(create, model, creates=True), owner=model.owner)
            self.registry.add_model(model)
        return {"request_id": model.request_id, "model_id": model.id}

    def get_info(self, model_id: str, owner: str) -> dict[str, Any]:
        model = self._model(model_id, owner)
        base = model.base_model
        return {"type": "get_info", "model_id": model.id,
                "model_data": {"arch": self.model_info[base].get("model_type"),
                               "model_name": base, "tokenizer_id": self.tokenizers[base]},
                "optimizer_config": {"type": "adamw"}, "is_lora": True,
                "lora_rank": model.rank, "model_name": base}

    def readable_checkpoint(self, path: str, owner: str) -> tuple[str, str, str, dict[str, Any]]:
        """A checkpoint the caller may read: (run, kind, name, its run's description)."""
        try:
            run, kind, name = self.store.parse(path)
        except TinkerError as exc:
            raise ApiError(400, str(exc)) from None
        meta = self.store.read_run(run)
        if meta is None or meta.get("model_owner") != owner or not self.store.exists(
                run, kind, name):
            raise ApiError(404, f"no checkpoint {path} (list them: RestClient().list_checkpoints"
                           f"({run!r}))")
        return run, kind, name, meta

    def load_weights(self, body: LoadWeightsBody, owner: str) -> dict[str, Any]:
        run, kind, name, meta = self.readable_checkpoint(body.path, owner)
        if kind != "weights":
            raise ApiError(400, f"{body.path} holds sampler weights; load a save_state "
                           "checkpoint (tinker://<run>/weights/<name>)")
        src = self.store.dir(run, kind, name)
        if body.session_id is None:  # the deprecated in-place load_state
            if body.model_id is None or body.seq_id is None:
                raise ApiError(400, "load_weights needs session_id and model_seq_id, or "
                               "model_id and seq_id")
            model = self._model(body.model_id, owner)

            def load() -> Result:
                if meta["base_model"] != model.base_model:
                    raise TinkerError(f"{body.path} was trained on {meta['base_model']}, "
                                      f"model {model.id} is {model.base_model}")
                self.backend.load_state(model.id, src, with_optimizer=body.optimizer)
                return Result(json={"path": body.path, "model_id": model.id,
                                    "type": "load_weights"})

            return {"request_id": self._ordered(model, body.seq_id, load), "model_id": model.id}
        session = self._session(body.session_id, owner)
        if body.model_seq_id is None:
            raise ApiError(400, "load_weights with session_id needs model_seq_id")
        base = self._base(meta["base_model"])
        if body.base_model is not None and body.base_model != base:
            raise ApiError(400, f"{body.path} was trained on {base}, not {body.base_model}")
        lora = {"rank": int(meta["lora_rank"]), **meta.get("lora_config", {})}
        model_id = f"{session.id}:train:{body.model_seq_id}"
        model = TrainingModel(id=model_id, session_id=session.id, owner=owner,
                              base_model=base, rank=int(lora["rank"]))

        def create() -> Result:
            saved = dict(self.backend.saved_config(src))  # the adapter as it was created
            if saved.get("base_model", base) != base:
                raise TinkerError(f"{body.path} holds an adapter of {saved['base_model']}, "
                                  f"its run says {base}")
            model.rank = int(saved.get("rank", model.rank))
            flags = {k: bool(saved.get(k, lora.get(k, True)))
                     for k in ("train_mlp", "train_attn", "train_unembed")}
            self.backend.create_model(model_id, base, model.rank, seed=saved.get("seed"),
                                      **flags)
            try:
                self.backend.load_state(model_id, src, with_optimizer=body.optimizer)
            except Exception:
                if callable(delete := getattr(self.backend, "delete_model", None)):
                    delete(model_id)
                raise
            self.store.write_run(self._run_meta(model, {"rank": model.rank, **flags},
                                                body.user_metadata or meta.get("user_metadata")))
            self._start_run(model, flags, saved.get("seed"),
                            body.user_metadata or meta.get("user_metadata"), source=body.path)
            return Result(json={"path": body.path, "model_id": model_id, "type": "load_weights"})

        return self._add_model(model, create)

    # ------------------------------------------------------------------ training
    def _track(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log_metrics(run_id, step, metrics)
        except Exception:  # noqa: BLE001 - tracking never fails a request
            log.warning("tracker failed for %s step %d", run_id, step, exc_info=True)

    def _ordered(self, model: TrainingModel, seq_id: int, fn: Callable[[], Result]) -> str:
        """Queue ``fn`` as ``model``'s request ``seq_id``; 429 while its queue is full."""
        try:
            return self.scheduler.submit_ordered(model.id, seq_id, self._job(fn, model),
                                                 limit=self.max_queued)
        except QueueFull as exc:
            raise ApiError(429, f"the queue is full ({exc}); retry shortly") from None

    def _timed(self, model: TrainingModel, op: str, step: int, started: float, submitted: float,
               **more: float) -> None:
        """A call's timings (and ``more``) for the tracker: seconds it ran and waited."""
        self._lineage("log_call", model.id, op, step, {
            "seconds": time.monotonic() - started, "queue_seconds": started - submitted, **more})

    def forward_backward(self, req: FwdBwdRequest, owner: str) -> dict[str, Any]:
        model = self._model(req.model_id, owner)
        submitted = time.monotonic()

        def run() -> Result:
            started = time.monotonic()
            if req.data_error:
                raise TinkerError(req.data_error)
            if req.loss_fn not in LOSSES:
                raise TinkerError(f"loss_fn {req.loss_fn!r} is not supported by this server; "
                                  f"use one of {', '.join(LOSSES)} (forward_backward_custom "
                                  "works too: it is computed client-side)")
            if texts := [k for k, v in req.config.items() if isinstance(v, str)]:
                raise TinkerError(f"loss_fn_config {texts} are strings; only numbers are used")
            config = {k: float(v) for k, v in req.config.items()} or None
            logprobs, metrics = self.backend.forward_backward(
                model.id, req.data, req.loss_fn, config, req.forward_only)
            if len(logprobs) != len(req.data):
                raise RuntimeError(f"the backend returned {len(logprobs)} log-prob arrays for "
                                   f"{len(req.data)} datums")
            metrics = clean_metrics(metrics)
            if not req.forward_only:
                self._track(model.id, model.optim_steps, metrics)
            self._timed(model, "forward" if req.forward_only else "forward_backward",
                        model.optim_steps, started, submitted, datums=len(req.data))
            return Result(proto=encode_forward_backward_output(logprobs, metrics))

        return {"request_id": self._ordered(model, req.seq_id, run), "model_id": model.id}

    def optim_step(self, body: OptimStepBody, owner: str) -> dict[str, Any]:
        model = self._model(body.model_id, owner)
        given = body.adam_params or body.optimizer_params or body.optim_params
        submitted = time.monotonic()

        def run() -> Result:
            started = time.monotonic()
            if given is None:
                raise TinkerError("optim_step needs adam_params")
            if given.type not in (None, "adamw", "adam"):
                raise TinkerError(f"optimizer {given.type!r} is not supported (adamw only)")
            params = AdamParams(**given.model_dump(exclude={"type"}))
            metrics = {k: float(v) for k, v in (self.backend.optim_step(model.id, params)
                                                or {}).items()}
            model.optim_steps += 1
            self._track(model.id, model.optim_steps, metrics)
            self._timed(model, "optim_step", model.optim_steps, started, submitted,
                        learning_rate=params.learning_rate, weight_decay=params.weight_decay,
                        grad_clip_norm=params.grad_clip_norm)
            return Result(json={"metrics": metrics})

        return {"request_id": self._ordered(model, body.seq_id, run), "model_id": model.id}

    def save_weights(self, body: SaveWeightsBody, owner: str) -> dict[str, Any]:
        model = self._model(body.model_id, owner)

        def run() -> Result:
            name = check_name(body.path or f"ckpt-{uuid.uuid4().hex[:8]}")
            if self.store.exists(model.id, "weights", name) and not body.overwrite:
                raise TinkerError(f"checkpoint {self.store.path(model.id, 'weights', name)} "
                                  "exists; save it under another name, or pass overwrite=True")
            meta = self._checkpoint(
                model.id, "weights", name,
                lambda tmp: self.backend.save_state(model.id, tmp, with_optimizer=True),
                overwrite=body.overwrite, ttl_seconds=body.ttl_seconds,
                user_metadata=body.user_metadata)
            return Result(json={"path": meta["tinker_path"], "type": "save_weights"})

        return {"request_id": self._ordered(model, body.seq_id, run), "model_id": model.id}

    def _checkpoint(self, model_id: str, kind: str, name: str, write: Callable[[Path], None],
                    **commit: Any) -> dict[str, Any]:
        """Write a checkpoint into staging, commit it under ``root/<run>/<kind>/<name>`` (the
        staging directory removed whatever happens) and record it in the lineage."""
        tmp = self.store.staging(model_id, kind, name)
        try:
            write(tmp)
            meta = self.store.commit(tmp, model_id, kind, name, **commit)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._lineage("log_checkpoint", model_id, kind, name, self.store.dir(model_id, kind, name),
                      meta["tinker_path"])
        return meta

    def save_weights_for_sampler(self, body: SaveWeightsForSamplerBody,
                                 owner: str) -> dict[str, Any]:
        """Named (``path``): a ``sampler_weights`` checkpoint. Unnamed (with
        ``sampling_session_seq_id``): ephemeral weights and a sampling session on them."""
        model = self._model(body.model_id, owner)

        def named() -> Result:
            name = check_name(str(body.path))
            meta = self._checkpoint(
                model.id, "sampler_weights", name,
                lambda tmp: self.backend.save_sampler_weights(model.id, tmp), overwrite=True,
                ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata)
            return Result(json={"path": meta["tinker_path"], "type": "save_weights_for_sampler"})

        def ephemeral() -> Result:
            if body.sampling_session_seq_id is None:
                raise TinkerError("save_weights_for_sampler needs a path (a name) or "
                                  "sampling_session_seq_id")
            sampler_id = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
            out = self.store.ephemeral_dir(sampler_id)
            self.backend.save_sampler_weights(model.id, out)
            self.registry.add_sampler(Sampler(id=sampler_id, session_id=model.session_id,
                                              owner=owner, base_model=model.base_model,
                                              adapter_dir=out, ephemeral=True))
            return Result(json={"sampling_session_id": sampler_id,
                                "type": "save_weights_for_sampler"})

        job = named if body.path is not None else ephemeral
        return {"request_id": self._ordered(model, body.seq_id, job), "model_id": model.id}

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (after their queues) and wake every long-poll; the tracker's runs
        of the training clients still live end KILLED, and the tracker closes."""
        self._closed.set()
        self.scheduler.close(timeout)
        with self.registry.lock:
            live = list(self.registry.models)
        for model_id in live:
            self._lineage("end_run", model_id, "KILLED")
        self._lineage("close")
