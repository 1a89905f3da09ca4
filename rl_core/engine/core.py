"""The embedded rollout engine: continuous batching over one Hugging Face causal LM, no HTTP.

One model copy serves every request. A scheduler (a thread, or with ``background=False`` the
thread that waits on it) owns all generation state; each turn it runs pending control calls at
its *safe point*, admits waiting requests within the KV budget, and decodes one step for the
batch. A seeded request yields the same tokens whatever its batch. ``weight_version`` is a
string, as in SGLang. Details: docs/rollout.md, "The embedded engine". Never unpickles received
data; opens no socket but the ``torch.distributed`` group a trainer asks it to join.
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
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rl_core.engine import faults
from rl_core.engine.control import EngineControl, EngineRequestError, EngineStateError
from rl_core.engine.kv import make_kv_batch
from rl_core.engine.lora import WAIT, Adapters
from rl_core.engine.requests import (
    GenerateOutput,
    GenerateRequest,
    abort_reason,
    add_run,
    check_request,
)
from rl_core.engine.routing import RoutingCapture
from rl_core.engine.sampling import hit_stop, prompt_logprobs, sample_next
from rl_core.engine.vision import RequestImages
from rl_core.engine.weights import ServedWeights
from rl_core.models import eos_token_ids, load_policy_model, torch_dtype
from rl_core.models.moe import prefer_fast_experts
from rl_core.models.vlm import BANNED_LOGIT, VisionProcessor, is_vision_model, placeholder_ids

__all__ = ["PAUSE_MODES", "EmbeddedEngine", "EngineRequestError", "EngineStateError",
           "GenerateOutput", "GenerateRequest"]

log = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's messages: clients (AReaL, slime) branch on the first one.
ABORT_BEFORE_PREFILL = "Abort before prefill"
ABORTED = "Aborted"
# Prompt tokens one prefill batch may take (always at least one request), so a burst of
# long prompts does not stall the running batch for long.
MAX_PREFILL_TOKENS = 16384


@dataclass(eq=False)
class _Seq:
    req: GenerateRequest
    eos: InitVar[frozenset[int]]
    future: cf.Future = field(default_factory=cf.Future)
    submitted: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    retractions: int = 0
    recomputed: int = 0  # KV tokens recomputed after retractions
    spans: list[list[Any]] = field(default_factory=list)  # each token's weight version, run-length
    output_top: list[list[list[Any]]] = field(default_factory=list)  # top_logprobs_num > 0
    cached: int = 0  # prompt tokens found in the prefix cache (SGLang's cached_tokens)

    def __post_init__(self, eos: frozenset[int]) -> None:
        p, self.rid = self.req.params, self.req.rid
        self.seed = secrets.randbits(62) if p.seed is None else p.seed
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos)
        # KV tokens this request may occupy: its prompt plus every token it may generate.
        self.reserve = len(self.req.input_ids) + self.req.params.max_new_tokens

    @property
    def needs_input_logprobs(self) -> bool:
        return self.req.logprob_start_len >= 0 and self.input_logprobs is None


class EmbeddedEngine(EngineControl):
    """A continuous-batching generation engine in this process (see the module docstring).
    ``max_total_tokens`` defaults to ``max(65536, context_length)``; the timeouts bound a
    control call's wait for a safe point and each weight-update collective; ``on_step(n)``
    runs on the scheduler after decode step ``n`` (for tests); ``kv_layout``: auto/slots/padded;
    ``max_loras_per_batch``: LoRA adapters one batch serves (1: merged; N: unmerged, lora.py)."""

    def __init__(self, model_path: str | Path, *, dtype: str = "float32",
                 max_running_requests: int = 256, max_total_tokens: int | None = None,
                 context_length: int | None = None, device: str = "cpu",
                 num_threads: int | None = None, trust_remote_code: bool = False,
                 control_timeout_s: float = 60.0, weight_sync_timeout_s: float = 120.0,
                 on_step: Callable[[int], None] | None = None, kv_layout: str = "auto",
                 model: torch.nn.Module | None = None, background: bool = True,
                 prefix_cache_tokens: int = 0, max_loras_per_batch: int = 1) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = self.tokenizer_path = str(model_path)
        self.dtype, self.device = dtype, torch.device(device)
        try:
            tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            log.warning("%s: no usable tokenizer (%s); text and stop strings disabled",
                        model_path, e)
            tok = None
        self.tokenizer = tok
        self.model = model if model is not None else load_policy_model(
            model_path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        prefer_fast_experts(self.model)
        # A vision-language model: its image processor checks and expands request images.
        self.images = RequestImages(VisionProcessor(model_path, self.model.config)
                                    if is_vision_model(self.model) else None, self.model_path)
        # ... and never samples the placeholders (models/vlm.py: the trainer masks them too)
        self._banned = (torch.tensor(placeholder_ids(self.model.config))
                        if self.images.processor is not None else None)
        cfg = self.model.config.get_text_config()
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(context_length or cfg.max_position_embeddings)
        self.max_running_requests = int(max_running_requests)
        self.max_total_tokens = int(max_total_tokens or max(65536, self.context_length))
        if self.max_running_requests < 1 or self.max_total_tokens < 2:
            raise ValueError("max_running_requests must be >= 1 and max_total_tokens >= 2")
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model, model_path)
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        gen = Path(model_path) / "generation_config.json"  # the sampling defaults it states
        raw = json.loads(gen.read_text()) if gen.is_file() else {}
        self.sampling_defaults = {k: raw[k] for k in ("temperature", "top_p", "top_k", "min_p")
                                  if k in raw}
        self.weight_version, self.control_timeout_s = INITIAL_WEIGHT_VERSION, control_timeout_s
        self.weight_sync_timeout_s, self.on_step = weight_sync_timeout_s, on_step
        self._weights = ServedWeights(self.model)
        self._routing = RoutingCapture(self.model)
        # Scheduler state. Only the scheduler thread touches the running batch; the waiting
        # queue, the rid index and the control queue are shared under ``_cond``.
        self._cond = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._by_rid: dict[str, _Seq] = {}
        self._controls: list[tuple[Callable[[], Any], cf.Future]] = []
        self._running: list[_Seq] = []
        self._admitting: list[_Seq] = []
        # The running batch's KV cache, row i = _running[i].
        self._kv = make_kv_batch(kv_layout, self.model, self.device, self.pad_token_id,
                                 self.max_running_requests, self.model_path, prefix_cache_tokens)
        self._lora = Adapters(self._weights.named, self._kv, self.model, max_loras_per_batch)
        self.kv_layout = self._kv.layout
        self._pending: torch.Tensor | None = None  # (B,) sampled, not yet fed to the model
        self._paused = self._kv_released = self._stop = False
        self._groups: dict[str, tuple[Any, str]] = {}
        self.stats = {"decode_steps": 0, "prefill_batches": 0, "prefill_shared_rows": 0,
                      "max_batch": 0, "tokens": 0}
        self.last_progress = time.monotonic()
        # background: the scheduler thread; else whichever thread drives it now (_drive)
        self._driver = threading.RLock()
        self._thread: threading.Thread | None = None
        self.background = background
        if background:
            self._thread = threading.Thread(target=self._loop, name="grpoflow-engine",
                                            daemon=True)
            self._thread.start()

    def validate(self, req: GenerateRequest) -> None:
        """Raise :class:`EngineRequestError` (SGLang's messages) if ``req`` cannot run."""
        check_request(req, self.vocab_size, self.context_length, self.max_total_tokens)
        if req.params.stop and self.tokenizer is None:
            raise EngineRequestError("stop strings need a tokenizer; this model has none.")
        if req.lora is not None:
            self._lora.get(req.lora)  # AdapterError (a ValueError, 400) if not loaded
        if req.return_routed_experts and not self._routing.enabled:
            raise EngineRequestError("return_routed_experts needs a mixture-of-experts model; "
                                     f"{self.model_path} has no expert routers")

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters (queried and hit prompt tokens, entries) and size."""
        cache = self._kv.prefix
        return {**cache.stats, "prefix_cache_tokens": cache.tokens,
                "prefix_cache_entries": len(cache), "prefix_cache_max_tokens": cache.max_tokens}

    @property
    def lora_names(self) -> list[str]:
        """The loaded LoRA adapters' names (what the OpenAI routes take as ``model``)."""
        return list(self._lora.loaded)

    def submit(self, req: GenerateRequest) -> cf.Future:
        """Queue ``req``; the future resolves to a :class:`GenerateOutput`."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: Sequence[GenerateRequest]) -> list[cf.Future]:
        """Queue every request of ``reqs`` or none: all are validated, and their ids checked
        against each other and the running requests, before the first is queued."""
        for req in reqs:
            self.validate(req)
        seqs = [_Seq(req, frozenset(self.eos_token_ids)) for req in reqs]
        rids = [req.rid for req in reqs]
        if len(set(rids)) != len(rids):
            dup = next(r for i, r in enumerate(rids) if r in rids[:i])
            raise EngineRequestError(f"Duplicate request ID: {dup!r} appears twice in the batch.")
        with self._cond:
            if self._stop:
                raise EngineStateError("the engine is closed")
            if (running := next((r for r in rids if r in self._by_rid), None)) is not None:
                raise EngineRequestError(f"Duplicate request ID: {running!r} is still running.")
            for seq in seqs:
                self._by_rid[seq.rid] = seq
                self._waiting.append(seq)
            self._cond.notify_all()
        return [seq.future for seq in seqs]

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Generate for ``req`` from asyncio; cancelling the awaiting task aborts it."""
        try:
            return await asyncio.wrap_future(self.submit(req))
        except asyncio.CancelledError:
            with contextlib.suppress(EngineStateError):
                self._post(lambda: self._abort_where(lambda s: s is self._by_rid.get(req.rid)))
            raise

    def generate_sync(self, reqs: Sequence[GenerateRequest],
                      timeout: float | None = 600.0) -> list[GenerateOutput]:
        """Submit ``reqs`` together (all or none) and wait for all of them, within ``timeout``."""
        futures = self.submit_all(reqs)
        end = None if timeout is None else time.monotonic() + timeout
        if not self.background:
            self._drive(lambda: all(f.done() for f in futures), end, "generate")
        return [f.result(None if end is None else max(0.0, end - time.monotonic()))
                for f in futures]

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
        if not self.background:
            self._drive(fut.done, time.monotonic() + limit, what)
        try:
            return fut.result(timeout=limit)
        except cf.TimeoutError:
            if fut.cancel():
                raise TimeoutError(
                    f"{what}: the engine did not reach a safe point within {limit:.0f} s") from None
            return fut.result()  # it started meanwhile; control operations are short

    def abort(self, rid: str | Sequence[str] | None = None, abort_all: bool = False) -> int:
        """Abort requests whose id starts with ``rid`` (SGLang's matching), or all of them;
        how many. Waiting requests finish with ``"Abort before prefill"``; running ones keep
        their partial tokens and log-probs."""
        rids = tuple(r for r in ([rid] if isinstance(rid, str) else list(rid or [])) if r)
        if not (rids or abort_all):
            return 0
        match = (lambda s: True) if abort_all else (lambda s: s.rid.startswith(rids))
        return self._call(lambda: self._abort_where(match), "abort")

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
            if kind := getattr(self, "_pending_fault", None):  # a test's (engine/faults.py)
                self._pending_fault = None
                faults.corrupt(kind, self.model)  # after the load and its checksum
            self._paused = False

        self._call(do, "resume")

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, Any]:
        """Running/waiting requests and KV tokens used and reserved (SGLang's load names)."""
        with self._cond:
            running = list(self._running) + list(self._admitting)
            waiting = len(self._waiting)
        reserved = sum(s.reserve for s in running)
        return {"num_running_reqs": len(running), "num_waiting_reqs": waiting,
                "num_used_tokens": sum(len(s.req.input_ids) + len(s.output_ids) for s in running),
                "num_reserved_tokens": reserved, "max_total_num_tokens": self.max_total_tokens,
                "max_running_requests": self.max_running_requests, "paused": self._paused,
                "token_usage": round(reserved / self.max_total_tokens, 6)}

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler; requests still queued or running fail with EngineStateError."""
        with self._cond:
            if self._stop:
                return
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self.background:
            self._thread.join(timeout=timeout)
        with self._cond:
            leftover, self._by_rid = list(self._by_rid.values()), {}
            self._waiting.clear()
            controls, self._controls = self._controls, []
        for fut in [s.future for s in leftover] + [fut for _, fut in controls]:
            with contextlib.suppress(cf.InvalidStateError):
                fut.set_exception(EngineStateError("the engine was closed"))
        for name in list(self._groups):
            try:
                self.destroy_weights_update_group(name)
            except Exception:  # best effort at shutdown
                log.warning("could not destroy weight update group %r", name)

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _runnable(self) -> bool:
        return not (self._paused or self._kv_released or self._weights.offloaded is not None)

    def _loop(self) -> None:
        with torch.no_grad():
            while self._turn(block=True):
                pass

    def _turn(self, block: bool) -> bool:
        """One scheduler iteration: the pending controls (the safe point), then one step if
        anything may run. False once closed, or (``block`` False) when there is nothing to do."""
        with self._cond:
            while not (self._stop or self._controls or (
                    self._runnable() and (self._running or self._waiting))):
                if not block:
                    return False
                self._cond.wait(timeout=1.0)
            if self._stop:
                return False
            controls, self._controls = self._controls, []
        for fn, fut in controls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
        if self._runnable():
            try:
                self._step()
            except Exception as e:  # the loop must survive a bad step
                log.exception("engine step failed; aborting the running batch")
                self._fail_batch(e)
        return True

    def _drive(self, done: Callable[[], bool], deadline: float | None, what: str) -> None:
        """``background=False``: run the scheduler on this thread until ``done()``. While
        another thread drives, wait for it (it runs this thread's controls too); while
        nothing can run (paused), wait for a control from elsewhere; all within ``deadline``."""
        while not done():
            if deadline is not None and time.monotonic() > deadline:
                return  # the caller's bounded wait on its future reports the timeout
            if self._driver.acquire(timeout=0.01):
                try:
                    self._thread = threading.current_thread()
                    with torch.no_grad():
                        while not done() and self._turn(block=False):
                            pass
                finally:
                    self._thread = None
                    self._driver.release()
            if not done():
                with self._cond:
                    self._cond.wait(timeout=0.01)

    def _step(self) -> None:
        if new := self._admit():
            self._prefill(new)
        if self._running:
            self._decode()
            self.stats["decode_steps"] += 1
            if self.on_step is not None:
                self.on_step(self.stats["decode_steps"])
        self.last_progress = time.monotonic()

    def _admit(self) -> list[_Seq]:
        with self._cond:
            new: list[_Seq] = []
            reserved, prefill_tokens = sum(s.reserve for s in self._running), 0
            batch = {s.req.lora for s in self._running}  # the adapters it serves (None: base)
            while self._waiting and len(self._running) + len(new) < self.max_running_requests:
                s = self._waiting[0]
                if (why := self._lora.admit(s.req.lora, batch)) == WAIT:
                    break
                if why is not None:  # its adapter was unloaded since it was queued
                    self._finish(self._waiting.popleft(), abort_reason(why, 400))
                    continue
                n = len(s.req.input_ids) + len(s.output_ids)
                if reserved + s.reserve > self.max_total_tokens:
                    break
                if new and (prefill_tokens + n > MAX_PREFILL_TOKENS or s.needs_input_logprobs):
                    break
                new.append(self._waiting.popleft())
                batch.add(s.req.lora)
                reserved, prefill_tokens = reserved + s.reserve, prefill_tokens + n
                if s.needs_input_logprobs:
                    break  # prefilled alone: its logits are kept for every scored position
            self._admitting = new
        return new

    def _prefill(self, new: list[_Seq]) -> None:
        seqs, loras = [s.req.input_ids + s.output_ids for s in new], [s.req.lora for s in new]
        # Logits only where needed: the last position, or (a request scoring its prompt,
        # always prefilled alone, see _admit) every position from logprob_start_len on.
        keep_logits = 0
        if new[0].needs_input_logprobs:
            keep_logits = max(1, len(seqs[0]) - new[0].req.logprob_start_len)
        hits = None  # cached prefixes; never for a request scoring its prompt or its routing
        if self._kv.prefix.enabled and not keep_logits and not any(
                s.req.return_routed_experts for s in new):
            hits = [self._kv.prefix.lookup(q) if self._lora.shares_kv(lora) else None
                    for q, lora in zip(seqs, loras, strict=True)]
            for s, hit in zip(new, hits, strict=True):
                s.cached = hit.length if hit is not None else 0
        last, prompt_logits = self._kv.prefill(seqs, [s.reserve for s in new], keep_logits,
                                               [s.req.images for s in new], hits, loras)
        last, prompt_logits = self._masked(last), self._masked(prompt_logits)
        self._routing.prefill(new, self._kv.token_rows([len(q) for q in seqs]))
        self.stats["prefill_batches"] += 1
        self.stats["prefill_shared_rows"] += self._kv.shared  # identical prompts computed once
        if prompt_logits is not None:
            ids = torch.tensor(seqs[0], dtype=torch.long)
            new[0].input_logprobs = prompt_logprobs(prompt_logits, ids, len(new[0].req.input_ids),
                                                    new[0].req.logprob_start_len)
        rows = [i for i, s in enumerate(new) if s.req.params.max_new_tokens > len(s.output_ids)]
        for i, s in enumerate(new):
            if i not in rows:  # max_new_tokens == 0: a scoring request, done after prefill
                self._finish(s, {"type": "length", "length": 0})
        keep: list[int] = []
        token_of: dict[int, int] = {}  # row -> its first sampled token
        if rows:
            tokens, logps = self._sample(last[rows].float().cpu(), [new[i] for i in rows])
            for i, token, logp in zip(rows, tokens.tolist(), logps.tolist(), strict=True):
                token_of[i] = token
                if not self._accept(new[i], token, logp):
                    keep.append(i)
        with self._cond:
            self._admitting = []
        self._kv.admit(keep)
        if not keep:
            return
        pending = torch.tensor([token_of[i] for i in keep], dtype=torch.long)
        self._pending = pending if self._pending is None else torch.cat([self._pending, pending])
        self._running.extend(new[i] for i in keep)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._running))

    def _masked(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """``logits`` with a vision model's placeholder tokens at BANNED_LOGIT."""
        if logits is None or self._banned is None:
            return logits
        return logits.index_fill(-1, self._banned.to(logits.device), BANNED_LOGIT)

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        ps = [s.req.params for s in seqs]
        temp, top_p, min_p = (torch.tensor([float(getattr(p, k)) for p in ps])
                              for k in ("temperature", "top_p", "min_p"))
        top_n = max(s.req.top_logprobs_num for s in seqs)
        tokens, logps, *top = sample_next(
            logits, temp, torch.tensor([int(p.top_k) for p in ps]), top_p, min_p,
            torch.tensor([s.seed for s in seqs], dtype=torch.long),
            torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long), top_n)
        if top:  # each row's k best, from the log-softmax its sampled token's log-prob is from
            for s, vals, ids in zip(seqs, top[0].tolist(), top[1].tolist(), strict=True):
                if (k := s.req.top_logprobs_num) > 0:
                    s.output_top.append([[v, i] for v, i in zip(vals[:k], ids[:k], strict=True)])
        return tokens, logps

    def _accept(self, s: _Seq, token: int, logp: float) -> bool:
        """Append a sampled token; finish ``s`` and return True if it ends the request."""
        s.output_ids.append(token)
        s.output_logprobs.append(logp)
        add_run(s.spans, self.weight_version)
        if (hook := s.req.on_token) is not None:  # a streamed request: each token as sampled
            hook(token, logp, s.output_top[-1] if s.req.top_logprobs_num else None)
        self.stats["tokens"] += 1
        p, n = s.req.params, len(s.output_ids)
        if token in s.stop_ids:
            self._finish(s, {"type": "stop", "matched": token})
        elif p.stop and (m := hit_stop(self.tokenizer, s.output_ids, p.stop)) is not None:
            self._finish(s, {"type": "stop", "matched": m})
        elif n >= p.max_new_tokens:
            self._finish(s, {"type": "length", "length": n})
        else:
            return False
        return True

    def _decode(self) -> None:
        assert self._pending is not None
        tokens, logps = self._sample(self._masked(self._kv.step(self._pending)).float().cpu(),
                                     self._running)
        self._routing.decode(self._running)
        self._pending = tokens
        steps = zip(self._running, tokens.tolist(), logps.tolist(), strict=True)
        keep = [j for j, (s, token, logp) in enumerate(steps) if not self._accept(s, token, logp)]
        if len(keep) < len(self._running):
            if self._kv.prefix.enabled:  # finished rows' KV, for prompts that extend them
                done = set(range(len(self._running))) - set(keep)
                self._kv.remember([(j, self._running[j].req.input_ids
                                    + self._running[j].output_ids[:-1]) for j in sorted(done)])
            self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` of the running batch (the KV batch may reorder them)."""
        if not keep:
            return self._reset_batch()
        assert self._pending is not None
        order = self._kv.select(keep)
        self._running = [self._running[j] for j in order]
        self._pending = self._pending[torch.tensor(order, dtype=torch.long)]

    def _reset_batch(self, *, free: bool = False) -> None:
        """Empty the running batch; ``free`` also drops the KV buffers kept for reuse."""
        self._running, self._pending = [], None
        (self._kv.free if free else self._kv.clear)()

    def _retract_all(self) -> None:
        """Move the running batch back to the front of the queue (recomputed when admitted)."""
        if not self._running:
            return
        for s in self._running:
            s.retractions += 1
            s.recomputed += len(s.req.input_ids) + len(s.output_ids)
        with self._cond:
            self._waiting.extendleft(reversed(self._running))
        self._reset_batch(free=True)

    def _abort_where(self, match: Callable[[_Seq], bool]) -> int:
        with self._cond:
            waiting = [s for s in self._waiting if match(s)]
            for s in waiting:
                self._waiting.remove(s)
        for s in waiting:
            self._finish(s, abort_reason(ABORTED if s.output_ids else ABORT_BEFORE_PREFILL))
        hit = [j for j, s in enumerate(self._running) if match(s)]
        for j in hit:
            self._finish(self._running[j], abort_reason(ABORTED))
        if hit:
            self._select([j for j in range(len(self._running)) if j not in set(hit)])
        return len(waiting) + len(hit)

    def _fail_batch(self, exc: Exception) -> None:
        reason = abort_reason(f"engine error: {exc}", 500, "InternalServerError")
        for s in list(self._running) + list(self._admitting):
            if not s.future.done():
                self._finish(s, dict(reason))
        with self._cond:
            self._admitting = []
        self._reset_batch(free=True)

    def _finish(self, s: _Seq, reason: dict[str, Any]) -> None:
        with self._cond:
            if self._by_rid.get(s.rid) is s:
                del self._by_rid[s.rid]
        out = GenerateOutput(
            rid=s.rid, output_ids=list(s.output_ids), output_logprobs=list(s.output_logprobs),
            input_logprobs=s.input_logprobs if s.req.logprob_start_len >= 0 else None,
            finish_reason=reason, prompt_tokens=len(s.req.input_ids), cached_tokens=s.cached,
            completion_tokens=len(s.output_ids), weight_version=self.weight_version,
            e2e_latency=time.perf_counter() - s.submitted, num_retractions=s.retractions,
            weight_version_spans=[list(r) for r in s.spans], recomputed_tokens=s.recomputed,
            routed_experts=self._routing.result(s, len(s.req.input_ids) + len(s.output_ids)),
            output_top_logprobs=list(s.output_top) if s.req.top_logprobs_num else None)
        with contextlib.suppress(cf.InvalidStateError):  # the caller cancelled its wait
            s.future.set_result(out)
