"""The one outbox for what a run sends to MLflow (metrics and tables: ``sender.Tracker``;
episode traces: ``traces``): a queue that one daemon thread sends, kept through outages, a
backoff of 1 s doubling to 30 s after a failure, one warning per outage and one line when
the server answers again, and a bounded flush. A subclass says what a unit is: how to take
the next one, send it, put it back after a failure and drop one the server refused.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Generic, TypeVar

from rl_core.secrets import redact
from tasks.tracking.handle import logger

__all__ = ["RETRY_DELAYS", "Outbox", "bound_mlflow_http", "refused_by_server"]

RETRY_DELAYS = (1.0, 30.0)  # the backoff after a failed send: 1 s doubling to 30 s
# MLflow's REST client takes ~4 min per call to a dead server; ours unless the environment
# sets them: 3 retries after 0, 2, 4 s, 60 s per connect/read (docs/tracking.md).
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}  # fmt: skip
_SENDER_THREADS: set[str] = set()  # the outboxes' thread names (urllib3's retry warnings muted)

T = TypeVar("T")


def bound_mlflow_http() -> dict[str, str]:
    """Bounded retries for MLflow's HTTP client (it reads these per request) unless the
    environment sets them; returns the values in force."""
    import os

    return {key: os.environ.setdefault(key, value) for key, value in MLFLOW_HTTP_DEFAULTS.items()}


def refused_by_server(exc: Exception) -> bool:
    """Whether the server answered and refused (a 4xx other than 408/429, or bad data):
    sending the same again would not help."""
    code = 0
    with contextlib.suppress(Exception):  # an MLflow RestException has the HTTP status
        code = int(exc.get_http_status_code())  # type: ignore[attr-defined]
    return isinstance(exc, ValueError | TypeError) or (400 <= code < 500 and code not in (408, 429))


def _not_from_a_sender(record: logging.LogRecord) -> bool:
    """urllib3 warns at every retry; an outbox once per outage."""
    return record.threadName not in _SENDER_THREADS


class Outbox(Generic[T]):
    """The queue's thread, backoff and outage bookkeeping. Subclasses implement the
    ``_queued``/``_take``/``_send``/``_put_back``/``_refuse`` hooks (the ``_locked`` ones run
    under ``self._changed``) and may override the messages."""

    thread_name = "grpoflow-outbox"

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.inflight: T | None = None  # the unit being sent
        self.failing_since: float | None = None  # wall time the current outage was noticed
        self.outages, self.outage_seconds = 0, 0.0
        self._changed = threading.Condition()  # the queue changed / something was sent
        self._retry_at = self._delay = 0.0  # monotonic time of the next attempt; backoff
        self._stop, self._thread = False, None
        self._log = logger()  # the run's logger reaches the Prefect UI from the thread too

    # ------------------------------------------------------------------ the hooks
    def _queued_locked(self) -> int:
        raise NotImplementedError

    def _take_locked(self) -> T:
        raise NotImplementedError

    def _send(self, item: T) -> None:
        raise NotImplementedError

    def _put_back_locked(self, item: T) -> None:
        raise NotImplementedError

    def _refuse_locked(self, item: T) -> None:
        """The server refused ``item``: keep it aside or count it (default: drop it)."""

    def _prepare(self, item: T) -> bool:
        """Work done on the thread before the first send; False skips the unit."""
        return True

    def _sent_locked(self, item: T) -> None:
        """``item`` reached the server."""

    def _on_refused(self, item: T, what: str) -> None:
        raise NotImplementedError

    def _on_outage(self, what: str, queued: int) -> None:
        raise NotImplementedError

    def _on_back(self, seconds: float, queued: int) -> None:
        raise NotImplementedError

    def _after_failure(self) -> None:
        """Outside the lock, after a failed send (say what was dropped meanwhile)."""

    # ------------------------------------------------------------------ the machinery
    def say(self, msg: str, level: int = logging.WARNING) -> None:
        self._log.log(level, redact(msg))

    def ensure_thread(self) -> None:
        _SENDER_THREADS.add(self.thread_name)
        logging.getLogger("urllib3.connectionpool").addFilter(_not_from_a_sender)
        with self._changed:
            if not self._stop and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._loop, name=self.thread_name,
                                                daemon=True)  # fmt: skip
                self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Try now (not after the backoff) and wait, at most ``timeout`` s, until everything
        queued is sent (failed sends meanwhile retried after 1 s, 2 s, ...); whether it was."""
        self.ensure_thread()
        with self._changed:
            self._retry_at = self._delay = 0.0
            self._changed.notify_all()
            return self._changed.wait_for(
                lambda: not (self._queued_locked() or self.inflight is not None), timeout)

    def stop(self) -> None:
        """Stop the thread (after the unit in flight, if any)."""
        with self._changed:
            self._stop = True
            self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._stop and (wait := self._retry_at - time.monotonic()
                                          if self._queued_locked() else 5.0) > 0:  # fmt: skip
                    self._changed.wait(wait)
                if self._stop:
                    return
                self.inflight = item = self._take_locked()
            if not self._prepare(item):
                with self._changed:
                    self.inflight = None
                    self._changed.notify_all()
                continue
            began = time.time()
            try:
                self._send(item)
            except Exception as exc:  # network, server restart, locked SQLite, refusal ...
                self._failed(item, exc, began)
            else:
                self._sent(item)

    def _failed(self, item: T, exc: Exception, began: float) -> None:
        what = f"{type(exc).__name__}: {redact(str(exc))[:300]}"
        refused, new_outage = refused_by_server(exc), False
        with self._changed:
            self.inflight = None
            if refused:  # the server answered: sending the same again would not help
                self._refuse_locked(item)
            else:
                self._put_back_locked(item)
                self._delay = min(max(2 * self._delay, RETRY_DELAYS[0]), RETRY_DELAYS[1])
                self._retry_at = time.monotonic() + self._delay
                if self.failing_since is None:
                    self.failing_since, new_outage = began, True
            queued = self._queued_locked()
            self._changed.notify_all()
        if refused:
            self._on_refused(item, what)
        elif new_outage:
            self._on_outage(what, queued)
        self._after_failure()

    def _sent(self, item: T) -> None:
        with self._changed:
            self.inflight, self._delay, self._retry_at = None, 0.0, 0.0
            self._sent_locked(item)
            began, self.failing_since = self.failing_since, None
            if began is not None:
                seconds = time.time() - began
                self.outages, self.outage_seconds = self.outages + 1, self.outage_seconds + seconds
            queued = self._queued_locked()
            self._changed.notify_all()
        if began is not None:
            self._on_back(seconds, queued)
