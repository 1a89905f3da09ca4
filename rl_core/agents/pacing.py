"""How fast episodes go: a circuit breaker over environment calls and an adaptive cap on
episodes in flight (docs/agents.md, 'Failures are not rewards').

:class:`CircuitBreaker` opens when the share of failed calls among the last ``window`` crosses
``failure_rate``; while it is open the runner holds its calls, waits ``cooldown_s`` (doubling,
bounded by ``max_pause_s`` in all, then :class:`EnvironmentUnavailableError`) and lets one
probe call through; a probe that succeeds closes it. :class:`AdaptiveConcurrency` is an AIMD
cap on episodes in flight: halved when an engine queues requests beyond ``max_waiting`` or its
KV cache is fuller than ``kv_high`` (the engines' own ``/v1/loads``), grown by one while the
engines keep up. Both are plain objects with an injectable clock; neither imports Prefect,
MLflow or the engines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["AdaptiveConcurrency", "CircuitBreaker", "EnvironmentUnavailableError",
           "plane_loads"]

log = logging.getLogger(__name__)


class EnvironmentUnavailableError(RuntimeError):
    """The breaker stayed open past ``agent.breaker.max_pause_s``: the environment (or agent
    program) is down, not the policy's fault; the step fails (and Prefect retries it)."""

    def __init__(self, paused_s: float, rate: float, last_error: str) -> None:
        self.paused_s, self.rate, self.last_error = paused_s, rate, last_error
        super().__init__(
            f"the environment failed {rate:.0%} of its recent calls and did not recover within "
            f"agent.breaker.max_pause_s ({paused_s:.0f}s paused); last error: {last_error}. "
            "Check the environment's service (or the agent program), then resume the run; "
            "raise agent.breaker.max_pause_s to wait longer, or set agent.breaker.enabled: false")

    def __reduce__(self):  # picklable across process boundaries (Prefect results, Ray)
        return (type(self), (self.paused_s, self.rate, self.last_error))


class CircuitBreaker:
    """Closed -> open (failure rate over the window) -> probing -> closed (see the module
    docstring). ``clock``/``wait`` are injectable: tests step time without sleeping."""

    def __init__(self, *, failure_rate: float = 0.5, window: int = 20, min_calls: int = 10,
                 cooldown_s: float = 5.0, max_pause_s: float = 300.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], Any] | None = None) -> None:
        if not 0.0 < failure_rate <= 1.0 or window < 1 or not 1 <= min_calls <= window:
            raise ValueError("agent.breaker: failure_rate in (0, 1], window >= 1 and "
                             "1 <= min_calls <= window")
        self.failure_rate, self.min_calls, self.enabled = failure_rate, min_calls, enabled
        self.cooldown_s, self.max_pause_s = cooldown_s, max_pause_s
        self._calls: deque[bool] = deque(maxlen=window)  # True: failed
        self._clock = clock
        self._wait = wait or threading.Event().wait
        self.open, self.opened, self.paused_s = False, 0, 0.0
        self.last_error = ""

    @property
    def rate(self) -> float:
        return sum(self._calls) / len(self._calls) if self._calls else 0.0

    def record(self, failed: bool, error: str = "") -> None:
        """One call's outcome; opens the breaker when the window's failure rate crosses."""
        if not self.enabled:
            return
        self._calls.append(failed)
        if failed:
            self.last_error = error or self.last_error
        if self.open:
            if not failed:  # a probe went through: the environment is back
                self.open = False
                self._calls.clear()
                log.warning("agent breaker: closed (a probe call succeeded after %.1fs paused)",
                            self.paused_s)
            return
        if len(self._calls) >= self.min_calls and self.rate >= self.failure_rate:
            self.open, self.opened = True, self.opened + 1
            self._pause_started, self._cooldown = self._clock(), self.cooldown_s
            log.warning("agent breaker: open (%.0f%% of the last %d environment calls failed; "
                        "last: %s); holding calls, probing every %.1fs", self.rate * 100,
                        len(self._calls), self.last_error, self.cooldown_s)

    def admit(self, pending: int) -> int:
        """How many of ``pending`` calls may go now: all while closed; while open, wait the
        cool-down (doubling) then let one probe through. Raises
        :class:`EnvironmentUnavailableError` past ``max_pause_s``."""
        if not self.open or pending == 0:
            return pending
        waited = self._clock() - self._pause_started
        if waited + self._cooldown > self.max_pause_s:
            # A retry of the step (Prefect's) starts a new pause, probing first.
            self._pause_started, self._cooldown = self._clock(), self.cooldown_s
            raise EnvironmentUnavailableError(waited, self.rate, self.last_error)
        start = self._clock()
        self._wait(self._cooldown)
        self.paused_s += self._clock() - start
        self._cooldown = min(self._cooldown * 2, max(self.max_pause_s / 4, self.cooldown_s))
        return 1

    def metrics(self) -> dict[str, float]:
        return {"agent/breaker_open": float(self.open), "agent/breaker_opened": float(self.opened),
                "agent/breaker_paused_s": self.paused_s}


class AdaptiveConcurrency:
    """An AIMD cap on episodes in flight from the engines' load (see the module docstring).
    ``loads()`` returns one dict per engine (``waiting``, ``running``, ``token_usage``) or None
    when they cannot tell; it is read at most every ``interval_s``."""

    def __init__(self, loads: Callable[[], Sequence[dict[str, float]] | None], *,
                 start: int = 64, lo: int = 1, hi: int = 64, max_waiting: int = 0,
                 kv_high: float = 0.9, interval_s: float = 1.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= lo <= hi:
            raise ValueError("agent.concurrency: 1 <= min_episodes <= max_episodes")
        self._loads, self.lo, self.hi, self.enabled = loads, lo, hi, enabled
        self.cap = max(lo, min(hi, start)) if enabled else hi
        self.max_waiting, self.kv_high, self.interval_s = max_waiting, kv_high, interval_s
        self._clock, self._last = clock, float("-inf")
        self.shrunk = self.grown = 0

    def update(self, in_flight: int) -> int:
        """The cap now (re-read from the engines' load at most every ``interval_s``)."""
        now = self._clock()
        if not self.enabled or now - self._last < self.interval_s:
            return self.cap
        self._last = now
        try:
            loads = self._loads()
        except Exception as e:  # noqa: BLE001 - a load probe never fails the rollout
            log.debug("agent concurrency: engine loads unavailable (%s)", e)
            return self.cap
        if not loads:
            return self.cap
        waiting = max(float(x.get("waiting", 0)) for x in loads)
        usage = max(float(x.get("token_usage", 0.0)) for x in loads)
        if waiting > self.max_waiting or usage > self.kv_high:
            new = max(self.lo, self.cap // 2)
            if new < self.cap:
                self.shrunk += 1
                log.info("agent concurrency: %d -> %d episodes (engine queue %d, KV %.0f%%)",
                         self.cap, new, waiting, usage * 100)
            self.cap = new
        elif in_flight >= self.cap and self.cap < self.hi:  # saturated and keeping up: grow
            self.cap += 1
            self.grown += 1
        return self.cap

    def metrics(self) -> dict[str, float]:
        return {"agent/concurrency_cap": float(self.cap),
                "agent/concurrency_shrunk": float(self.shrunk)}


def plane_loads(plane: Any) -> Callable[[], list[dict[str, float]] | None]:  # noqa: ANN401
    """The rollout plane's per-engine load (``plane.loads()``), or a callable returning None
    for a plane that cannot tell."""
    loads = getattr(plane, "loads", None)
    return loads if callable(loads) else (lambda: None)
