"""The gateway's batcher: the one thread that calls ``plane.generate`` for every session, so
a wave of agent requests becomes one plane call. A request's top-k alternatives and its
per-token hook (a streamed turn) go to the plane only where it takes them (:func:`plane_takes`):
the HTTP plane returns alternatives, the in-process plane both."""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl_core.engine.routes_openai import OpenAIError
from rl_core.engine.sampling import SamplingParams
from rl_core.errors import RolloutRequestError
from rl_core.interfaces import RolloutPlane
from rl_core.types import Sample

__all__ = ["Batcher", "Done", "plane_takes", "request_error"]

Hook = Callable[[int, float, list[list[Any]] | None], None]


def plane_takes(plane: RolloutPlane, name: str) -> bool:
    """Whether ``plane.generate`` takes the keyword ``name`` (``top_logprobs``, ``on_token``)."""
    try:
        return name in inspect.signature(plane.generate).parameters
    except (TypeError, ValueError):
        return False


@dataclass(eq=False)
class _Job:
    prompt: list[int]
    params: SamplingParams
    top: int = 0  # top-k alternatives per token, for the client only
    hook: Hook | None = None  # a streamed turn: each token as it is sampled
    future: cf.Future = field(default_factory=cf.Future)
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class Done:
    """A finished generation and when it ran."""

    sample: Sample
    queued_s: float
    generate_s: float
    batch: int


def request_error(e: BaseException) -> bool:
    """The plane refused a request (bad ids, too long): that request's fault, not the batch's."""
    return isinstance(e, ValueError) or (isinstance(e, RolloutRequestError) and e.status < 500)


class Batcher:
    """The one thread that calls ``plane.generate``: everything queued (waiting ``wait_s`` for
    more, up to ``max_batch``) goes out as one batch; handlers wait on their futures."""

    def __init__(self, plane: RolloutPlane, wait_s: float, max_batch: int) -> None:
        self.plane, self.wait_s, self.max_batch = plane, wait_s, max_batch
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="grpoflow-gateway-batch",
                                        daemon=True)
        self.stats = {"batches": 0, "requests": 0, "max_batch": 0}

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, *, top: int = 0,
               hook: Hook | None = None) -> cf.Future:
        """Queue a generation; ``top``: alternatives per token (the plane must take
        ``top_logprobs``); ``hook``: called per token where the plane takes ``on_token``."""
        if self._closed.is_set():
            raise OpenAIError("the gateway is shutting down", 503, code="gateway_closed")
        job = _Job(prompt, params, top, hook)
        self._queue.put(job)
        return job.future

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        while True:  # whatever is still queued will never run
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(OpenAIError("the gateway shut down", 503))

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if job is None:
                break
            batch, end = [job], time.monotonic() + self.wait_s
            # A few ms for the rest of a wave of requests: agents answering the same batch
            # come back at nearly the same time, and one plane call serves them all.
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._closed.set()
                    break
                batch.append(nxt)
            batch = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)

    def _generate(self, batch: list[_Job]) -> list[Sample]:
        kw: dict[str, Any] = {}
        if any(j.top for j in batch):
            kw["top_logprobs"] = [j.top for j in batch]
        if any(j.hook for j in batch) and plane_takes(self.plane, "on_token"):
            kw["on_token"] = [j.hook for j in batch]
        return self.plane.generate([j.prompt for j in batch], [j.params for j in batch], **kw)

    def _run(self, batch: list[_Job]) -> None:
        t0 = time.monotonic()
        try:
            samples = self._generate(batch)
            if len(samples) != len(batch):
                raise RuntimeError(f"the plane answered {len(samples)} samples for "
                                   f"{len(batch)} prompts")
        except Exception as e:
            if len(batch) > 1 and request_error(e):
                # One bad request must not fail its batch-mates: each on its own.
                for j in batch:
                    self._run_alone(j)
                return
            for j in batch:
                j.future.set_exception(e)
            return
        seconds = time.monotonic() - t0
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        for j, s in zip(batch, samples, strict=True):
            j.future.set_result(Done(s, t0 - j.submitted, seconds, len(batch)))

    def _run_alone(self, job: _Job) -> None:
        t0 = time.monotonic()
        try:
            (s,) = self._generate([job])
        except Exception as e:
            job.future.set_exception(e)
            return
        job.future.set_result(Done(s, t0 - job.submitted, time.monotonic() - t0, 1))
