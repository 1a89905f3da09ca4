"""The gateway's batcher: the one thread that calls ``plane.generate`` for every session, so
a wave of agent requests becomes one plane call."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from dataclasses import dataclass, field

from rl_core.engine.routes_openai import OpenAIError
from rl_core.engine.sampling import SamplingParams
from rl_core.errors import RolloutRequestError
from rl_core.interfaces import RolloutPlane
from rl_core.types import Sample

__all__ = ["Batcher", "Done", "request_error"]


@dataclass(eq=False)
class _Job:
    prompt: list[int]
    params: SamplingParams
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

    def submit(self, prompt: list[int], params: SamplingParams) -> cf.Future:
        if self._closed.is_set():
            raise OpenAIError("the gateway is shutting down", 503, code="gateway_closed")
        job = _Job(prompt, params)
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

    def _run(self, batch: list[_Job]) -> None:
        t0 = time.monotonic()
        try:
            samples = self.plane.generate([j.prompt for j in batch], [j.params for j in batch])
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
            (s,) = self.plane.generate([job.prompt], [job.params])
        except Exception as e:
            job.future.set_exception(e)
            return
        job.future.set_result(Done(s, t0 - job.submitted, time.monotonic() - t0, 1))
