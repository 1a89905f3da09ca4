"""The embedded rollout engine: continuous batching over one Hugging Face causal LM, no HTTP.

One model copy serves every request. A scheduler thread owns all generation state and runs
the loop SGLang's scheduler runs, in miniature:

1. run pending control operations (abort, pause, weight updates, memory release) — this is
   the *safe point*: nothing is mid-forward, so weights and the KV cache may change;
2. admit waiting requests first-come-first-served while the KV budget
   (``max_total_tokens``, counted as prompt + ``max_new_tokens`` per request) and
   ``max_running_requests`` allow, and prefill them in one left-padded batch;
3. merge them into the running batch: the KV tensors of both are left-padded along the
   sequence axis to a common length, with a per-row attention mask and per-row positions;
4. run one decode step for the whole running batch, retire finished rows
   (``batch_select_indices``) and resolve their futures.

Requests join and leave between decode steps; when nothing can run the thread waits on a
condition with a bounded timeout. Sampling is :mod:`rl_core.rollout.sampler`'s, step for step
(same per-request Gumbel noise, same ``log_softmax(logits / T)`` before filtering), so a
request with a seed yields the tokens ``generate`` yields, whatever it is batched with.

``weight_version`` is a string, as in SGLang (``"default"`` until the first versioned
update); pass ``str(step)``. Prompt log-probs (``logprob_start_len >= 0``) are SGLang's:
unscaled ``log_softmax(logits)`` (temperature does not apply), first entry ``None``.

Never imports Prefect or MLflow; never unpickles received data; opens no socket except the
``torch.distributed`` group a trainer asks it to join.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from rl_core.models import eos_token_ids, torch_dtype
from rl_core.rollout.sampler import SamplingParams, _hit_stop, _sample_next
from rl_core.weight_sync import process_group as pgroup
from rl_core.weight_sync import weights_checksum

__all__ = [
    "EmbeddedEngine",
    "EngineRequestError",
    "EngineStateError",
    "GenerateOutput",
    "GenerateRequest",
    "PAUSE_MODES",
]

log = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# SGLang's messages: clients (AReaL, slime) branch on the first one.
ABORT_BEFORE_PREFILL = "Abort before prefill"
ABORTED = "Aborted"
# Prompt tokens one prefill batch may take (always at least one request), so a burst of
# long prompts does not stall the running batch for long.
MAX_PREFILL_TOKENS = 16384


class EngineRequestError(ValueError):
    """A request or update the engine refuses; the HTTP server answers it with 400."""


class EngineStateError(RuntimeError):
    """An operation the engine cannot perform in its current state (closed, no such group)."""


@dataclass
class GenerateRequest:
    """One sequence to generate (or, with ``max_new_tokens=0``, to score)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1


@dataclass
class GenerateOutput:
    """A finished request in SGLang's terms (``finish_reason`` has SGLang's JSON shapes)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None] | None
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float
    num_retractions: int = 0


@dataclass(eq=False)
class _Seq:
    req: GenerateRequest
    seed: int
    stop_ids: frozenset[int]
    future: cf.Future = field(default_factory=cf.Future)
    submitted: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    retractions: int = 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def reserve(self) -> int:
        """KV tokens this request may occupy: its prompt plus every token it may generate."""
        return len(self.req.input_ids) + self.req.params.max_new_tokens

    @property
    def needs_input_logprobs(self) -> bool:
        return self.req.logprob_start_len >= 0 and self.input_logprobs is None


def _abort_reason(message: str, status_code: int | None = None, err_type: str | None = None):
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def _left_pad_seq(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad a (B, H, T, D) KV tensor with ``n`` zero columns at the front of T."""
    return F.pad(t, (0, 0, n, 0)) if n else t


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return f"{version('grpoflow')}+embedded"
    except Exception:  # metadata is optional (a source checkout)
        return "0+embedded"


class EmbeddedEngine:
    """A continuous-batching generation engine in this process (see the module docstring).

    ``max_total_tokens`` defaults to ``max(65536, context_length)``; ``control_timeout_s``
    bounds how long a control call waits for the scheduler's next safe point, and
    ``weight_sync_timeout_s`` bounds each collective of a distributed weight update.
    ``on_step(n)`` is called on the scheduler thread after decode step ``n`` (tests and
    instrumentation use it to act at exact points of a run).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_running_requests: int = 256,
        max_total_tokens: int | None = None,
        context_length: int | None = None,
        device: str = "cpu",
        num_threads: int | None = None,
        trust_remote_code: bool = False,
        control_timeout_s: float = 60.0,
        weight_sync_timeout_s: float = 120.0,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = str(model_path)
        self.tokenizer_path = str(model_path)
        self.dtype = dtype
        self.device = torch.device(device)
        self.tokenizer = self._load_tokenizer(model_path, trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        cfg = self.model.config
        layers = DynamicCache(config=cfg).layers
        if not all(type(layer) is DynamicLayer for layer in layers):
            raise ValueError(
                f"{model_path}: sliding-window or hybrid KV caches are not supported by the "
                "embedded engine (it pads and merges full-attention caches only)"
            )
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(context_length or cfg.max_position_embeddings)
        self.max_running_requests = int(max_running_requests)
        self.max_total_tokens = int(max_total_tokens or max(65536, self.context_length))
        if self.max_running_requests < 1 or self.max_total_tokens < 2:
            raise ValueError("max_running_requests must be >= 1 and max_total_tokens >= 2")
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model, model_path)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self.sampling_defaults = self._generation_defaults(model_path)
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.control_timeout_s = control_timeout_s
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.on_step = on_step

        # Weight bookkeeping: state_dict names, tied aliases, and the tensors behind them.
        self._tensors: dict[str, torch.Tensor] = {}  # canonical name -> Parameter / buffer
        self._canonical: dict[str, str] = {}  # state_dict name -> canonical name
        seen: dict[int, str] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            canon = seen.setdefault(id(t), name)
            self._canonical[name] = canon
            self._tensors.setdefault(canon, t)
        self._shapes = {n: tuple(self._tensors[c].shape) for n, c in self._canonical.items()}
        self._offloaded: dict[str, torch.Tensor] | None = None

        # Scheduler state. Only the scheduler thread touches the running batch; the waiting
        # queue, the rid index and the control queue are shared under ``_cond``.
        self._cond = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._by_rid: dict[str, _Seq] = {}
        self._controls: list[tuple[Callable[[], Any], cf.Future]] = []
        self._running: list[_Seq] = []
        self._admitting: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (B, L) long: 1 where the cache holds a token
        self._next_pos: torch.Tensor | None = None  # (B,) position of the pending token
        self._pending: torch.Tensor | None = None  # (B,) sampled, not yet fed to the model
        self._paused = False
        self._kv_released = False
        self._groups: dict[str, tuple[Any, str]] = {}
        self._stop = False
        self.stats = {"decode_steps": 0, "prefill_batches": 0, "max_batch": 0, "tokens": 0}
        self.last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="grpoflow-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loading helpers

    @staticmethod
    def _load_tokenizer(model_path: str | Path, trust_remote_code: bool) -> Any:
        try:
            return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            log.warning(
                "%s: no usable tokenizer (%s); text and stop strings disabled", model_path, e
            )
            return None

    @staticmethod
    def _generation_defaults(model_path: str | Path) -> dict[str, Any]:
        """Sampling defaults the model's ``generation_config.json`` states explicitly."""
        path = Path(model_path) / "generation_config.json"
        if not path.is_file():
            return {}
        raw = json.loads(path.read_text())
        return {k: raw[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in raw}

    # ------------------------------------------------------------------------ requests

    def validate(self, req: GenerateRequest) -> None:
        """Raise :class:`EngineRequestError` (SGLang's messages) if ``req`` cannot run."""
        ids = req.input_ids
        if not ids:
            raise EngineRequestError("input_ids cannot be empty.")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise EngineRequestError(
                f"The input_ids contain token id {bad[0]!r} outside the vocabulary "
                f"[0, {self.vocab_size})."
            )
        n_in, n_new = len(ids), req.params.max_new_tokens
        if n_in >= self.context_length:
            raise EngineRequestError(
                f"The input ({n_in} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if n_in + n_new > self.context_length:
            raise EngineRequestError(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {n_in + n_new} "
                f"tokens: {n_in} tokens from the input messages and {n_new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )
        if n_in + n_new > self.max_total_tokens:
            raise EngineRequestError(
                f"The request needs {n_in + n_new} KV tokens ({n_in} input + {n_new} new) but "
                f"the engine's KV budget is max_total_tokens={self.max_total_tokens}."
            )
        if req.logprob_start_len < -1:
            raise EngineRequestError(
                f"logprob_start_len must be -1 or >= 0, got {req.logprob_start_len}."
            )
        if req.logprob_start_len > n_in:
            raise EngineRequestError(
                f"logprob_start_len={req.logprob_start_len} is higher than the number of input "
                f"tokens {n_in}. Please use a smaller logprob_start_len."
            )
        if req.params.stop and self.tokenizer is None:
            raise EngineRequestError("stop strings need a tokenizer; this model has none.")

    def submit(self, req: GenerateRequest) -> cf.Future:
        """Queue ``req``; the future resolves to a :class:`GenerateOutput`."""
        self.validate(req)
        p = req.params
        seq = _Seq(
            req=req,
            seed=p.seed if p.seed is not None else secrets.randbits(62),
            stop_ids=frozenset(p.stop_token_ids)
            | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids)),
        )
        with self._cond:
            if self._stop:
                raise EngineStateError("the engine is closed")
            if req.rid in self._by_rid:
                raise EngineRequestError(f"Duplicate request ID: {req.rid!r} is still running.")
            self._by_rid[req.rid] = seq
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq.future

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Generate for ``req`` from asyncio; cancelling the awaiting task aborts it."""
        fut = self.submit(req)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(EngineStateError):
                self._post(lambda: self._abort_where(lambda s: s is self._by_rid.get(req.rid)))
            raise

    def generate_sync(
        self, reqs: Sequence[GenerateRequest], timeout: float | None = 600.0
    ) -> list[GenerateOutput]:
        """Submit ``reqs`` together and wait for all of them (bounded by ``timeout``)."""
        futures = [self.submit(r) for r in reqs]
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(f.result(timeout=left))
        return out

    # ------------------------------------------------------------------------- control

    def _post(self, fn: Callable[[], Any]) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._cond:
            if self._stop:
                raise EngineStateError("the engine is closed")
            self._controls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def _call(self, fn: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        """Run ``fn`` on the scheduler thread at its next safe point; wait a bounded time."""
        if threading.current_thread() is self._thread:
            return fn()
        fut = self._post(fn)
        limit = self.control_timeout_s if timeout is None else timeout
        try:
            return fut.result(timeout=limit)
        except cf.TimeoutError:
            if fut.cancel():
                raise TimeoutError(
                    f"{what}: the engine did not reach a safe point within {limit:.0f} s"
                ) from None
            return fut.result()  # it started meanwhile; control operations are short

    def abort(self, rid: str | Sequence[str] | None = None, abort_all: bool = False) -> int:
        """Abort requests whose id starts with ``rid`` (SGLang's matching), or all of them.

        Waiting requests finish with ``"Abort before prefill"``; running ones keep their
        partial tokens and log-probs. Returns how many requests were aborted.
        """
        if abort_all:
            return self._call(lambda: self._abort_where(lambda s: True), "abort")
        rids = [rid] if isinstance(rid, str) else list(rid or [])
        rids = [r for r in rids if r]
        if not rids:
            return 0
        return self._call(
            lambda: self._abort_where(lambda s: any(s.rid.startswith(r) for r in rids)), "abort"
        )

    def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``in_place`` keeps running requests and their KV cache;
        ``retract`` moves them back to the waiting queue (recomputed on resume); ``abort``
        aborts every running and waiting request. New requests queue until :meth:`resume`."""
        if mode not in PAUSE_MODES:
            raise EngineRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")

        def do() -> None:
            self._paused = True  # first: callers woken by the aborts see a paused engine
            if mode == "abort":
                self._abort_where(lambda s: True)
            elif mode == "retract":
                self._retract_all()

        self._call(do, "pause")

    def resume(self) -> None:
        """Continue after :meth:`pause`."""

        def do() -> None:
            self._paused = False

        self._call(do, "resume")

    @property
    def paused(self) -> bool:
        return self._paused

    def flush_cache(self) -> bool:
        """Drop cached KV state; False (nothing done) while requests run or wait."""

        def do() -> bool:
            with self._cond:
                busy = bool(self._running or self._waiting)
            if busy:
                return False
            self._reset_batch()
            self._empty_device_cache()
            return True

        return self._call(do, "flush_cache")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the KV cache (``kv_cache``: running requests are retracted and recomputed on
        resume) and move the weights off the device (``weights``). On CPU the weights'
        tensors are kept in a host buffer and the model's parameters become empty, so the
        model cannot run until :meth:`resume_memory`. ``cuda_graph`` is accepted (no-op)."""
        wanted = self._tags(tags)

        def do() -> None:
            if "kv_cache" in wanted:
                self._retract_all()
                self._kv_released = True
            if "weights" in wanted and self._offloaded is None:
                backup = {}
                for canon, t in self._tensors.items():
                    backup[canon] = t.data if t.device.type == "cpu" else t.data.to("cpu")
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                self._offloaded = backup
            self._empty_device_cache()

        self._call(do, "release_memory")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`release_memory` for ``tags`` (all when None)."""
        wanted = self._tags(tags)

        def do() -> None:
            if "weights" in wanted and self._offloaded is not None:
                for canon, t in self._tensors.items():
                    t.data = self._offloaded[canon].to(self.device)
                self._offloaded = None
            if "kv_cache" in wanted:
                self._kv_released = False

        self._call(do, "resume_memory")

    def _empty_device_cache(self) -> None:
        # Dropped tensors are freed by reference counting; only a CUDA caching allocator
        # keeps the memory until asked (a full gc.collect() here costs ~0.5 s per call).
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def memory_released(self) -> dict[str, bool]:
        return {"weights": self._offloaded is not None, "kv_cache": self._kv_released}

    @staticmethod
    def _tags(tags: Sequence[str] | None) -> set[str]:
        wanted = set(tags) if tags else set(MEMORY_TAGS)
        unknown = wanted - set(MEMORY_TAGS)
        if unknown:
            raise EngineRequestError(f"unknown memory tags {sorted(unknown)}; known {MEMORY_TAGS}")
        return wanted

    # ------------------------------------------------------------------ weight updates

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: str | int | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> str:
        """Load every weight from a Hugging Face safetensors directory; returns the checksum.

        Names must be the model's state_dict names (tied aliases may be absent); nothing is
        changed if any name is unknown, missing or of the wrong shape.
        """
        named = _load_safetensors_dir(Path(model_path))
        self._check_names(named, complete=True, source=str(model_path))
        if abort_all_requests:
            self.abort(abort_all=True)
        self._call(lambda: self._apply(named, weight_version), "update_weights_from_disk")
        self.model_path = str(model_path)
        return self.checksum()

    def update_weights_from_tensors(
        self,
        named: Mapping[str, torch.Tensor],
        weight_version: str | int | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> str:
        """Load some or all weights from named tensors (a bucket); returns the checksum."""
        named = dict(named)
        self._check_names(named, complete=False, source="tensors")
        if abort_all_requests:
            self.abort(abort_all=True)
        self._call(lambda: self._apply(named, weight_version), "update_weights_from_tensors")
        return self.checksum()

    def update_weight_version(
        self, new_version: str | int, *, abort_all_requests: bool = True
    ) -> str:
        """Set ``weight_version`` without touching weights (SGLang aborts all by default)."""
        if abort_all_requests:
            self.abort(abort_all=True)

        def do() -> str:
            self.weight_version = str(new_version)
            return self.weight_version

        return self._call(do, "update_weight_version")

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset`` (one rank: TP = 1).

        Blocks until every rank has joined (bounded by ``weight_sync_timeout_s``).
        """
        if group_name in self._groups:
            raise EngineStateError(f"weight update group {group_name!r} already exists")
        if backend != "gloo" and self.device.type == "cpu":
            raise EngineRequestError(
                f"backend {backend!r} needs an accelerator; an engine on cpu joins weight "
                "update groups with backend 'gloo'"
            )
        pg = pgroup.init_custom_process_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.weight_sync_timeout_s,
        )
        self._groups[group_name] = (pg, backend)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        weight_version: str | int | None = None,
        *,
        load_format: str | None = None,
        abort_all_requests: bool = False,
    ) -> str:
        """Receive one broadcast per tensor from group rank 0, in ``names`` order, then load.

        All tensors are received before any check, so a trainer is never left blocked in a
        broadcast; a mismatch then fails the call with nothing loaded.
        """
        if group_name not in self._groups:
            raise EngineStateError(
                f"no weight update group {group_name!r}; call init_weights_update_group first"
            )
        if load_format not in (None, "direct"):
            raise EngineRequestError(
                f"load_format {load_format!r} is not supported for distributed updates by the "
                "embedded engine; send one broadcast per tensor (load_format null)"
            )
        pg, backend = self._groups[group_name]
        named = pgroup.receive_named_tensors(
            names,
            dtypes,
            shapes,
            pg,
            device=self.device if backend != "gloo" else "cpu",
            timeout_s=self.weight_sync_timeout_s,
        )
        self._check_names(named, complete=False, source=f"group {group_name!r}")
        if abort_all_requests:
            self.abort(abort_all=True)
        self._call(lambda: self._apply(named, weight_version), "update_weights_from_distributed")
        return self.checksum()

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        if group_name not in self._groups:
            raise EngineStateError(f"no weight update group {group_name!r}")
        pg, _ = self._groups.pop(group_name)
        pgroup.destroy_process_group(pg)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every state_dict name and its tensor (from the host buffer while offloaded)."""
        src = self._offloaded
        return {
            n: (src[c] if src is not None else self._tensors[c].data)
            for n, c in self._canonical.items()
        }

    def checksum(self) -> str:
        """:func:`rl_core.weight_sync.weights_checksum` of the served weights."""
        return weights_checksum(self.named_weights())

    def _check_names(self, named: Mapping[str, torch.Tensor], *, complete: bool, source: str):
        unknown = sorted(n for n in named if n not in self._canonical)
        shapes = [
            f"{n}: got {tuple(t.shape)}, model has {self._shapes[n]}"
            for n, t in named.items()
            if n in self._shapes and tuple(t.shape) != self._shapes[n]
        ]
        missing: list[str] = []
        if complete:
            covered = {self._canonical[n] for n in named if n in self._canonical}
            missing = sorted(set(self._tensors) - covered)
        if unknown or shapes or missing:
            parts = []
            if unknown:
                parts.append(f"unknown names {unknown[:10]}")
            if missing:
                parts.append(f"missing names {missing[:10]}")
            if shapes:
                parts.append(f"shape mismatches {shapes[:10]}")
            raise EngineRequestError(
                f"weights from {source} do not match the model ({'; '.join(parts)}); "
                "nothing was loaded"
            )

    def _apply(self, named: Mapping[str, torch.Tensor], version: str | int | None) -> None:
        """Copy ``named`` into the weights (at a safe point, on the scheduler thread)."""
        for name, t in named.items():
            canon = self._canonical[name]
            target = (
                self._offloaded[canon] if self._offloaded is not None else self._tensors[canon].data
            )
            target.copy_(t)
        if version is not None:
            self.weight_version = str(version)

    # ---------------------------------------------------------------------- reporting

    def load(self) -> dict[str, Any]:
        """Running/waiting requests and KV tokens used and reserved (SGLang's load names)."""
        with self._cond:
            running = list(self._running) + list(self._admitting)
            waiting = len(self._waiting)
        used = sum(len(s.req.input_ids) + len(s.output_ids) for s in running)
        reserved = sum(s.reserve for s in running)
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "num_reserved_tokens": reserved,
            "max_total_num_tokens": self.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "token_usage": round(reserved / self.max_total_tokens, 6),
            "paused": self._paused,
        }

    def model_info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    def server_info(self) -> dict[str, Any]:
        load = self.load()
        return {
            "engine": "grpoflow-embedded",
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path if self.tokenizer is not None else None,
            "skip_tokenizer_init": self.tokenizer is None,
            "dtype": self.dtype,
            "device": str(self.device),
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "max_total_tokens": self.max_total_tokens,
            "max_total_num_tokens": self.max_total_tokens,
            "max_req_input_len": self.context_length - 1,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "disaggregation_mode": "null",
            "enable_memory_saver": True,
            "weight_version": self.weight_version,
            "eos_token_ids": self.eos_token_ids,
            "internal_states": [
                {
                    "max_total_num_tokens": self.max_total_tokens,
                    "num_running_reqs": load["num_running_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"],
                    "decode_steps": self.stats["decode_steps"],
                }
            ],
            "version": _package_version(),
        }

    # ------------------------------------------------------------------------ lifecycle

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler; requests still queued or running fail with EngineStateError."""
        with self._cond:
            if self._stop:
                return
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout)
        with self._cond:
            leftover = list(self._by_rid.values())
            self._by_rid.clear()
            self._waiting.clear()
            controls, self._controls = self._controls, []
        for s in leftover:
            _set_exception(s.future, EngineStateError("the engine was closed"))
        for _, fut in controls:
            _set_exception(fut, EngineStateError("the engine was closed"))
        for name in list(self._groups):
            try:
                self.destroy_weights_update_group(name)
            except Exception:  # best effort at shutdown
                log.warning("could not destroy weight update group %r", name)

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------- scheduler loop

    def _runnable(self) -> bool:
        return not (self._paused or self._kv_released or self._offloaded is not None)

    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                with self._cond:
                    while not (
                        self._stop
                        or self._controls
                        or (self._runnable() and (self._running or self._waiting))
                    ):
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    controls, self._controls = self._controls, []
                for fn, fut in controls:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as e:  # handed to the caller
                            fut.set_exception(e)
                if not self._runnable():
                    continue
                try:
                    self._step()
                except Exception as e:  # the loop must survive a bad step
                    log.exception("engine step failed; aborting the running batch")
                    self._fail_batch(e)

    def _step(self) -> None:
        new = self._admit()
        if new:
            self._prefill(new)
        if self._running:
            self._decode()
            self.stats["decode_steps"] += 1
            if self.on_step is not None:
                self.on_step(self.stats["decode_steps"])
        self.last_progress = time.monotonic()

    def _admit(self) -> list[_Seq]:
        with self._cond:
            reserved = sum(s.reserve for s in self._running)
            new: list[_Seq] = []
            prefill_tokens = 0
            while self._waiting and len(self._running) + len(new) < self.max_running_requests:
                s = self._waiting[0]
                n = len(s.req.input_ids) + len(s.output_ids)
                if reserved + s.reserve > self.max_total_tokens:
                    break
                if new and (prefill_tokens + n > MAX_PREFILL_TOKENS or s.needs_input_logprobs):
                    break
                self._waiting.popleft()
                new.append(s)
                reserved += s.reserve
                prefill_tokens += n
                if s.needs_input_logprobs:
                    break  # prefilled alone: its logits are kept for every scored position
            self._admitting = new
        return new

    def _prefill(self, new: list[_Seq]) -> None:
        seqs = [s.req.input_ids + s.output_ids for s in new]
        width = max(len(q) for q in seqs)
        ids = torch.full((len(new), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, width - len(q) :] = torch.tensor(q, dtype=torch.long)
            mask[i, width - len(q) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Logits only where needed: the last position, or (a request scoring its prompt,
        # always prefilled alone, see _admit) every position from logprob_start_len on.
        keep = 1
        if new[0].needs_input_logprobs:
            keep = max(1, width - new[0].req.logprob_start_len)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
            logits_to_keep=keep,
        )
        self.stats["prefill_batches"] += 1
        if new[0].needs_input_logprobs:
            new[0].input_logprobs = self._prompt_logprobs(out.logits[0], ids[0], new[0])
        cache = out.past_key_values
        last = out.logits[:, -1, :].float().cpu()
        del out

        rows = [i for i, s in enumerate(new) if s.req.params.max_new_tokens > len(s.output_ids)]
        for i, s in enumerate(new):
            if i not in rows:  # max_new_tokens == 0: a scoring request, done after prefill
                self._finish(s, {"type": "length", "length": 0})
        keep: list[int] = []
        if rows:
            sel = [new[i] for i in rows]
            tokens, logps = self._sample(last[rows], sel)
            for j, s in enumerate(sel):
                if not self._accept(s, int(tokens[j]), float(logps[j])):
                    keep.append(rows[j])
        with self._cond:
            self._admitting = []
        if not keep:
            return
        idx = torch.tensor(keep, dtype=torch.long)
        if len(keep) < len(new):
            cache.batch_select_indices(idx.to(self.device))
        token_of = {r: int(tokens[j]) for j, r in enumerate(rows)}
        self._merge(
            [new[i] for i in keep],
            cache,
            mask[idx],
            positions[idx, -1] + 1,
            torch.tensor([token_of[i] for i in keep], dtype=torch.long),
        )

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, s: _Seq) -> list[float | None]:
        """SGLang's ``input_token_logprobs`` for prompt positions k..n-1 (first one None).

        ``ids`` is the (unpadded) prefilled row and ``logits`` covers its last
        ``logits.shape[0]`` positions, which start at position k.
        """
        n, k = len(s.req.input_ids), s.req.logprob_start_len
        if k >= n:
            return []
        if n - k == 1:
            return [None]
        first = ids.shape[0] - logits.shape[0]  # the position logits[0] belongs to (k)
        # Logits at position p score token p + 1.
        logp = torch.log_softmax(logits[k - first : n - 1 - first].float(), dim=-1).cpu()
        target = ids[k + 1 : n]
        values = logp.gather(-1, target[:, None]).squeeze(-1).tolist()
        return [None, *values]

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        params = [s.req.params for s in seqs]
        return _sample_next(
            logits,
            torch.tensor([float(p.temperature) for p in params]),
            torch.tensor([int(p.top_k) for p in params]),
            torch.tensor([float(p.top_p) for p in params]),
            torch.tensor([float(p.min_p) for p in params]),
            torch.tensor([s.seed for s in seqs], dtype=torch.long),
            torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long),
        )

    def _accept(self, s: _Seq, token: int, logp: float) -> bool:
        """Append a sampled token; finish ``s`` and return True if it ends the request."""
        s.output_ids.append(token)
        s.output_logprobs.append(logp)
        self.stats["tokens"] += 1
        p = s.req.params
        reason: dict[str, Any] | None = None
        if token in s.stop_ids:
            reason = {"type": "stop", "matched": token}
        elif p.stop and (m := _hit_stop(self.tokenizer, s.output_ids, p.stop)) is not None:
            reason = {"type": "stop", "matched": m}
        elif len(s.output_ids) >= p.max_new_tokens:
            reason = {"type": "length", "length": len(s.output_ids)}
        if reason is None:
            return False
        self._finish(s, reason)
        return True

    def _merge(
        self,
        seqs: list[_Seq],
        cache: DynamicCache,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        pending: torch.Tensor,
    ) -> None:
        if self._cache is None:
            self._cache, self._mask = cache, mask
            self._next_pos, self._pending, self._running = next_pos, pending, list(seqs)
        else:
            old_len, new_len = self._mask.shape[1], mask.shape[1]
            width = max(old_len, new_len)
            for a, b in zip(self._cache.layers, cache.layers, strict=True):
                a.keys = torch.cat(
                    [_left_pad_seq(a.keys, width - old_len), _left_pad_seq(b.keys, width - new_len)]
                )
                a.values = torch.cat(
                    [
                        _left_pad_seq(a.values, width - old_len),
                        _left_pad_seq(b.values, width - new_len),
                    ]
                )
            self._mask = torch.cat(
                [F.pad(self._mask, (width - old_len, 0)), F.pad(mask, (width - new_len, 0))]
            )
            self._next_pos = torch.cat([self._next_pos, next_pos])
            self._pending = torch.cat([self._pending, pending])
            self._running.extend(seqs)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._running))

    def _decode(self) -> None:
        assert self._mask is not None and self._next_pos is not None and self._pending is not None
        self._mask = torch.cat(
            [self._mask, torch.ones((self._mask.shape[0], 1), dtype=self._mask.dtype)], dim=1
        )
        out = self.model(
            input_ids=self._pending[:, None].to(self.device),
            attention_mask=self._mask.to(self.device),
            position_ids=self._next_pos[:, None].to(self.device),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        logits = out.logits[:, -1, :].float().cpu()
        del out
        self._next_pos = self._next_pos + 1
        tokens, logps = self._sample(logits, self._running)
        self._pending = tokens
        keep = [
            j
            for j, s in enumerate(self._running)
            if not self._accept(s, int(tokens[j]), float(logps[j]))
        ]
        if len(keep) < len(self._running):
            self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` of the running batch; trim columns no row needs any more."""
        if not keep:
            self._reset_batch()
            return
        assert self._cache is not None and self._mask is not None
        idx = torch.tensor(keep, dtype=torch.long)
        self._cache.batch_select_indices(idx.to(self.device))
        self._mask = self._mask[idx]
        self._next_pos = self._next_pos[idx]
        self._pending = self._pending[idx]
        self._running = [self._running[j] for j in keep]
        lead = int((self._mask.cumsum(-1) == 0).sum(-1).min())
        if lead:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, lead:]
                layer.values = layer.values[:, :, lead:]
            self._mask = self._mask[:, lead:]

    def _reset_batch(self) -> None:
        self._running = []
        self._cache = self._mask = self._next_pos = self._pending = None

    def _retract_all(self) -> None:
        """Move the running batch back to the front of the queue (recomputed when admitted)."""
        if not self._running:
            return
        for s in self._running:
            s.retractions += 1
        with self._cond:
            self._waiting.extendleft(reversed(self._running))
        self._reset_batch()

    def _abort_where(self, match: Callable[[_Seq], bool]) -> int:
        with self._cond:
            waiting = [s for s in self._waiting if match(s)]
            for s in waiting:
                self._waiting.remove(s)
        for s in waiting:
            self._finish(s, _abort_reason(ABORTED if s.output_ids else ABORT_BEFORE_PREFILL))
        hit = [j for j, s in enumerate(self._running) if match(s)]
        for j in hit:
            self._finish(self._running[j], _abort_reason(ABORTED))
        if hit:
            self._select([j for j in range(len(self._running)) if j not in set(hit)])
        return len(waiting) + len(hit)

    def _fail_batch(self, exc: Exception) -> None:
        reason = _abort_reason(f"engine error: {exc}", 500, "InternalServerError")
        for s in list(self._running) + list(self._admitting):
            if not s.future.done():
                self._finish(s, dict(reason))
        with self._cond:
            self._admitting = []
        self._reset_batch()

    def _finish(self, s: _Seq, reason: dict[str, Any]) -> None:
        with self._cond:
            if self._by_rid.get(s.rid) is s:
                del self._by_rid[s.rid]
        out = GenerateOutput(
            rid=s.rid,
            output_ids=list(s.output_ids),
            output_logprobs=list(s.output_logprobs),
            input_logprobs=s.input_logprobs if s.req.logprob_start_len >= 0 else None,
            finish_reason=reason,
            prompt_tokens=len(s.req.input_ids),
            completion_tokens=len(s.output_ids),
            cached_tokens=0,
            weight_version=self.weight_version,
            e2e_latency=time.perf_counter() - s.submitted,
            num_retractions=s.retractions,
        )
        with contextlib.suppress(cf.InvalidStateError):  # the caller cancelled its wait
            s.future.set_result(out)


def _set_exception(fut: cf.Future, exc: BaseException) -> None:
    with contextlib.suppress(cf.InvalidStateError):
        fut.set_exception(exc)


def _load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in a Hugging Face model directory."""
    from safetensors.torch import load_file

    if not path.is_dir():
        raise EngineRequestError(f"{path}: not a directory (expected a safetensors model dir)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineRequestError(
            f"{path}: no *.safetensors files (only safetensors checkpoints can be loaded)"
        )
    named: dict[str, torch.Tensor] = {}
    for f in files:
        named.update(load_file(str(f)))
    return named
