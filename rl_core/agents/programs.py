"""Black-box agent programs on the gateway: ``program(client, task) -> reward`` played on its
own thread per attempt against a fresh session, bounded by ``agent.timeout_s``, retried, and
laid out as EpisodeRunner lays out its episodes (docs/agents.md, 'Black-box agents')."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.agents.env import EpisodeLimits
from rl_core.agents.gateway import AgentGateway, GatewaySession
from rl_core.agents.pacing import AdaptiveConcurrency, CircuitBreaker
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.types import Sample

__all__ = ["Program", "run_programs"]

log = logging.getLogger(__name__)

# program(client, task) -> the environment's reward (None: 0).
Program = Callable[[Any, Record], "float | None"]


@dataclass(eq=False)
class _Run:
    """One episode across its attempts."""

    group: int
    task: Record
    index: int
    attempt: int = 0
    sessions: list[GatewaySession] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reward: float = 0.0
    failed: bool = False
    started: float = 0.0


@dataclass(eq=False)
class _Attempt:
    run: _Run
    session: GatewaySession
    deadline: float


def _reward(value: object) -> float:
    if value is None:
        return 0.0
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    raise TypeError(f"the program returned {str(value)[:80]!r}; it must return the episode's "
                    "reward as a finite float, or None")


def _play(program: Program, session: GatewaySession, timeout_s: float, token: int,
          done: queue.SimpleQueue) -> None:
    """One attempt on its own thread: the outcome goes to ``done`` (if anyone still cares)."""
    import openai

    client = None
    try:
        client = openai.OpenAI(base_url=session.base_url, api_key="grpoflow", max_retries=0,
                               timeout=timeout_s)
        outcome: tuple[str, Any] = ("ok", _reward(program(client, session.task)))
    except BaseException as e:  # noqa: BLE001 (whatever the program does fails its attempt)
        outcome = ("error", f"{type(e).__name__}: {e}")
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
    done.put((token, outcome))


def run_programs(gateway: AgentGateway, program: Program, records: Sequence[Record], *, n: int,
                 params: SamplingParams, step: int, seed: int,
                 limits: EpisodeLimits | None = None, retries: int = 1,
                 concurrency: int | AdaptiveConcurrency = 64,
                 breaker: CircuitBreaker | None = None) -> list[Sample]:
    """``n`` episodes of ``program`` per task in EpisodeRunner.run's layout, at most
    ``concurrency`` at once (a number, or an :class:`AdaptiveConcurrency` cap that follows the
    engines' load); a failed or hung attempt is retried with a fresh session up to ``retries``
    times, then recorded as ``failed``. While ``breaker`` is open no attempt starts but one
    probe at a time once the others have finished. Returns within about
    ``(attempts / concurrency + 1) * timeout_s`` (plus the breaker's pause) whatever the
    programs do."""
    cap = concurrency if isinstance(concurrency, AdaptiveConcurrency) else None
    if n < 1 or (cap is None and concurrency < 1) or retries < 0:
        raise ValueError("run_programs: n and concurrency must be >= 1, retries >= 0")
    breaker = breaker or CircuitBreaker(enabled=False)
    lim = limits or EpisodeLimits()
    runs = [_Run(g, rec, j) for g, rec in enumerate(records) for j in range(n)]
    todo: deque[_Run] = deque(runs)
    running: dict[int, _Attempt] = {}
    done: queue.SimpleQueue = queue.SimpleQueue()
    tokens = itertools.count()

    def start(run: _Run) -> None:
        session = gateway.open_session(run.task, index=run.index, group=run.group,
                                       attempt=run.attempt, step=step, seed=seed, params=params,
                                       limits=lim)
        run.sessions.append(session)
        run.started = run.started or session.opened
        token = next(tokens)
        running[token] = _Attempt(run, session, session.deadline)
        threading.Thread(target=_play, args=(program, session, lim.timeout_s, token, done),
                         name=f"grpoflow-agent-{run.task.id}-{run.index}", daemon=True).start()

    def finish(a: _Attempt, kind: str, value: Any) -> None:
        run = a.run
        a.session.close("the program returned" if kind == "ok" else f"attempt {kind}")
        breaker.record(kind != "ok", f"{kind}: {str(value)[:200]}")
        if kind == "ok":
            run.reward = value
            return
        message = f"attempt {run.attempt + 1}: {kind}: {value}"
        run.errors.append(message)
        log.warning("episode %s:%s %s", run.task.id, run.index, message)
        if run.attempt < retries:
            run.attempt += 1
            todo.append(run)
        else:
            run.failed = True

    try:
        while todo or running:
            limit = cap.update(len(running)) if cap is not None else concurrency
            while todo and len(running) < limit:
                if breaker.open:  # hold new attempts; one probe once the others are done
                    if not running and breaker.admit(len(todo)):
                        start(todo.popleft())
                    break
                start(todo.popleft())
            first = min(a.deadline for a in running.values())
            try:
                token, (kind, value) = done.get(timeout=min(1.0, max(0.0, first -
                                                                      time.monotonic())))
            except queue.Empty:
                pass
            else:
                if (a := running.pop(token, None)) is not None:  # else: abandoned already
                    finish(a, kind, value)
            now = time.monotonic()
            for token, a in list(running.items()):
                if now > a.deadline:  # hung: abandon the thread, close its door
                    del running[token]
                    finish(a, "timeout", f"the program ran past agent.timeout_s="
                           f"{lim.timeout_s:g}s; its thread was abandoned and its session "
                           "closed")
        return [_episode_sample(run) for run in runs]
    finally:
        gateway.discard([s for run in runs for s in run.sessions])


def _episode_sample(run: _Run) -> Sample:
    """The last attempt's session, with every attempt's trace and errors."""
    last = run.sessions[-1]
    trace = [t for s in run.sessions for t in s.trace]
    return last.sample(failed=run.failed, errors=run.errors, env_reward=run.reward,
                       attempts=run.attempt + 1, trace=trace, started=run.started)
