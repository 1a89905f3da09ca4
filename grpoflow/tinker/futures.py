"""Futures and the work behind them (docs/tinker-protocol.md, sections 6 and 7).

Every asynchronous submission answers ``{"request_id"}`` at once; its work runs later on
the one worker thread of its base model (:class:`Worker`: a FIFO queue; training and model
changes are single-threaded per base model), or, for sampling, on one of the base model's
``sample_threads`` sampling threads (a :class:`Worker` with several threads), so that several
tenants' sample requests reach the engine together and share its batches. A training model's
requests carry ``seq_id``: they run in ``seq_id`` order, a request waiting until every
predecessor has been handed to the worker (the SDK may post a chunked call's first chunk
last), and a repeated ``(model, seq_id)`` gets the first submission's ``request_id`` instead
of running twice (:class:`Scheduler`).

``retrieve_future`` long-polls (:meth:`FutureStore.wait`): it returns when the result is
there or after a bound well under the SDK's 45 s read timeout (then: ``try_again``). A result
is kept until retrieved, then for ``retrieved_ttl_s`` more (a retried poll gets it again); one
nobody retrieves is dropped after ``unretrieved_ttl_s``. A request id belongs to the caller
that submitted it (``owner``): to anyone else it is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl_core.tinker import TinkerError

__all__ = ["FutureStore", "QueueFull", "Result", "Scheduler", "Worker", "failure",
           "user_error"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """A finished request's answer: a JSON object, or protobuf bytes (ForwardBackwardOutput,
    SampleResponse)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None


def user_error(message: str) -> Result:
    """A failed request the user can fix (the SDK raises RequestFailedError, not retried)."""
    return Result(json={"error": message, "category": "user"})


def failure(exc: BaseException) -> Result:
    """A request that raised: category ``user`` for :class:`TinkerError` (and ValueError
    subclasses of it), ``server`` for anything else (logged with its traceback)."""
    if isinstance(exc, TinkerError):
        return user_error(str(exc) or type(exc).__name__)
    log.error("request failed", exc_info=exc)
    return Result(json={"error": f"{type(exc).__name__}: {exc}", "category": "server"})


class QueueFull(Exception):
    """A submission refused because its queue is at its bound (answered 429: the SDK retries
    the same request, ``seq_id`` included, after a backoff)."""


@dataclass
class _Entry:
    created: float
    owner: str | None = None
    result: Result | None = None
    done_at: float | None = None
    retrieved_at: float | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list)


class FutureStore:
    """Request ids and their results; resolved from worker threads, awaited on the event
    loop."""

    def __init__(self, *, retrieved_ttl_s: float = 600.0,
                 unretrieved_ttl_s: float = 6 * 3600.0) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.retrieved_ttl_s, self.unretrieved_ttl_s = retrieved_ttl_s, unretrieved_ttl_s
        self._last_sweep = time.monotonic()
        self._closing = False  # shutting down: long-polls answer at once

    def create(self, owner: str | None = None) -> str:
        """A new pending request id, retrievable by ``owner`` only (None: by nobody)."""
        rid = f"req-{uuid.uuid4().hex}"  # unguessable: a request id is its result's key
        with self._lock:
            self._entries[rid] = _Entry(created=time.monotonic(), owner=owner)
        self.sweep()
        return rid

    def resolve(self, rid: str, result: Result) -> None:
        """Store ``rid``'s result and wake its long-polls (from any thread)."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.result is not None:
                return
            entry.result, entry.done_at = result, time.monotonic()
            waiters, entry.waiters = entry.waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_wake, fut)

    def pending(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.result is None)

    def known(self, rid: str) -> bool:
        with self._lock:
            return rid in self._entries

    async def wait(self, rid: str, timeout: float, owner: str | None = None) -> Result | None:
        """``rid``'s result, waiting up to ``timeout`` seconds; None: not ready yet.
        Raises KeyError for an unknown (or expired) id, and, given ``owner``, for another
        owner's."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._entries[rid]
            if owner is not None and entry.owner != owner:
                raise KeyError(rid)
            if entry.result is None and self._closing:
                return None
            if entry.result is None:
                fut: asyncio.Future[None] = loop.create_future()
                entry.waiters.append((loop, fut))
            else:
                return self._retrieved(entry)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock, contextlib.suppress(ValueError):
                entry.waiters.remove((loop, fut))
        with self._lock:
            return self._retrieved(entry) if entry.result is not None else None

    def _retrieved(self, entry: _Entry) -> Result | None:
        if entry.retrieved_at is None:
            entry.retrieved_at = time.monotonic()
        return entry.result

    def wake_all(self) -> None:
        """End every long-poll now, and answer later ones at once (shutdown): each answers
        try_again unless its result is there."""
        with self._lock:
            self._closing = True
            waiters = [w for e in self._entries.values() for w in e.waiters]
            for e in self._entries.values():
                e.waiters = []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, fut)

    def sweep(self, force: bool = False) -> int:
        """Drop results retrieved more than ``retrieved_ttl_s`` ago and finished ones nobody
        retrieved for ``unretrieved_ttl_s``; the number dropped (at most once a second
        unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_sweep < 1.0:
            return 0
        self._last_sweep = now
        with self._lock:
            stale = [rid for rid, e in self._entries.items()
                     if (e.retrieved_at is not None and now - e.retrieved_at > self.retrieved_ttl_s)
                     or (e.done_at is not None and e.retrieved_at is None
                         and now - e.done_at > self.unretrieved_ttl_s)]
            for rid in stale:
                del self._entries[rid]
        return len(stale)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


Job = Callable[[], Result]


class Worker:
    """``threads`` threads running one base model's jobs, started in the order they were
    queued (one thread: run in that order). Each job gets a ticket; :meth:`wait_queued_before`
    waits for the jobs queued before a ticket to finish."""

    def __init__(self, name: str, store: FutureStore, threads: int = 1) -> None:
        self.name, self.store = name, store
        self._queue: queue.SimpleQueue[tuple[str, Job, int] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._tickets = 0
        self._open: set[int] = set()  # the tickets of jobs queued or running
        self._threads = [threading.Thread(target=self._run, name=f"tinker-{name}-{i}",
                                          daemon=True) for i in range(max(1, int(threads)))]
        for thread in self._threads:
            thread.start()

    def put(self, rid: str, job: Job) -> None:
        with self._cond:
            ticket, self._tickets = self._tickets, self._tickets + 1
            self._open.add(ticket)
        self._queue.put((rid, job, ticket))

    def depth(self) -> int:
        return self._queue.qsize()

    def mark(self) -> int:
        """The ticket the next job will get."""
        with self._cond:
            return self._tickets

    def wait_queued_before(self, ticket: int, timeout: float) -> bool:
        """Wait until every job queued before ``ticket`` has finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._open or min(self._open) >= ticket,
                                       timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            rid, job, ticket = item
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - every failure ends the future
                result = failure(exc)
            self.store.resolve(rid, result)
            with self._cond:
                self._open.discard(ticket)
                self._cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the queued jobs, then end the threads (waits up to ``timeout``)."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


@dataclass
class _Order:
    """A training model's ``seq_id`` bookkeeping."""

    next_seq: int
    worker: Worker
    held: dict[int, tuple[str, Job]] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id
    owner: str | None = None  # whose request ids these are


class Scheduler:
    """Hands jobs to the base models' workers: unordered (model creation, cleanup), in a
    training model's ``seq_id`` order (idempotent on ``(model_id, seq_id)``), or, sampling
    (``concurrent``), to the base model's ``sample_threads`` sampling threads."""

    def __init__(self, base_models: list[str], store: FutureStore,
                 sample_threads: int = 16) -> None:
        self.store = store
        self.workers = {name: Worker(name, store) for name in base_models}
        self.samplers = {name: Worker(f"{name}-sample", store, sample_threads)
                         for name in base_models}
        self._orders: dict[str, _Order] = {}
        self._keys: dict[tuple[str, Any], str] = {}  # idempotency key -> request_id
        self._lock = threading.Lock()

    def submit(self, base_model: str, job: Job, key: tuple[Any, ...] | None = None,
               owner: str | None = None, concurrent: bool = False) -> str:
        """Queue ``job`` on ``base_model``'s worker (``concurrent``: its sampling threads),
        its request id ``owner``'s; a ``key`` seen before (of the same owner) returns the
        first submission's request id without queuing anything."""
        with self._lock:
            if key is not None:
                key = (owner, *key)
            if key is not None and key in self._keys and self.store.known(self._keys[key]):
                return self._keys[key]
            rid = self.store.create(owner)
            if key is not None:
                if len(self._keys) > 10_000:  # forget the keys of expired requests
                    self._keys = {k: r for k, r in self._keys.items() if self.store.known(r)}
                self._keys[key] = rid
            (self.samplers if concurrent else self.workers)[base_model].put(rid, job)
            return rid

    def open_order(self, model_id: str, base_model: str, first_seq: int = 1,
                   owner: str | None = None) -> None:
        """Start ``model_id``'s sequence: its first ordered request has ``first_seq``; its
        request ids are ``owner``'s."""
        with self._lock:
            self._orders[model_id] = _Order(next_seq=first_seq, worker=self.workers[base_model],
                                            owner=owner)

    def submit_ordered(self, model_id: str, seq_id: int, job: Job,
                       limit: int | None = None) -> str:
        """Queue ``job`` as ``model_id``'s request ``seq_id``: held until every smaller
        ``seq_id`` has been queued. A ``seq_id`` already used returns its request id; one
        below the model's sequence that was never seen fails at once. With ``limit``, a new
        request raises :class:`QueueFull` (nothing recorded: the same ``seq_id`` can come
        again) while the worker's queue is at ``limit``, or the model's held requests are and
        this is not the one they wait for."""
        with self._lock:
            order = self._orders[model_id]
            if seq_id in order.seen:
                return order.seen[seq_id]
            if limit is not None and seq_id >= order.next_seq and (
                    order.worker.depth() >= limit or (len(order.held) >= limit
                                                      and seq_id != order.next_seq)):
                raise QueueFull(f"{order.worker.depth()} requests queued on {order.worker.name}"
                                f", {len(order.held)} of model {model_id} waiting for an "
                                f"earlier seq_id (the bound is {limit})")
            rid = self.store.create(order.owner)
            if len(order.seen) > 4096:  # a long run: forget the oldest (long finished) ones
                order.seen = {s: r for s, r in order.seen.items() if s >= order.next_seq - 1024}
            order.seen[seq_id] = rid
            if seq_id < order.next_seq:
                self.store.resolve(rid, user_error(
                    f"seq_id {seq_id} of model {model_id} comes after seq_id "
                    f"{order.next_seq - 1} already ran; requests must be sent in order"))
                return rid
            order.held[seq_id] = (rid, job)
            while order.next_seq in order.held:
                order.worker.put(*order.held.pop(order.next_seq))
                order.next_seq += 1
            return rid

    def forget(self, model_id: str) -> None:
        """Drop ``model_id``'s sequence (its session finished)."""
        with self._lock:
            self._orders.pop(model_id, None)

    def held(self, model_id: str) -> list[int]:
        """The seq ids of ``model_id`` waiting for a predecessor."""
        with self._lock:
            order = self._orders.get(model_id)
            return sorted(order.held) if order else []

    def queue_depth(self, base_model: str) -> int:
        """Jobs queued on ``base_model`` and not started (training and sampling)."""
        return self.workers[base_model].depth() + self.samplers[base_model].depth()

    def close(self, timeout: float = 10.0) -> None:
        """Wake the long-polls and stop the workers (each finishes its queue first)."""
        self.store.wake_all()
        deadline = time.monotonic() + timeout
        for worker in [*self.samplers.values(), *self.workers.values()]:
            worker.stop(max(0.1, deadline - time.monotonic()))
