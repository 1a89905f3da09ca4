"""Engine fault injection for tests/test_chaos.py: SIGKILL (fault 1) and SIGSTOP (fault 2).

:class:`EngineChaos` is a background thread that, while a training flow runs in this
process, picks one of the flow's engine processes (children of this process running
``rl_core.engine.server``) and either SIGKILLs it (a crash: the pool restarts and re-syncs
it) or SIGSTOPs it (a hang: it accepts connections and never answers; the pool's health
monitor must replace it). Which fault, which engine and when come from a seeded
``random.Random``, or from a fixed per-step ``plan``. Only one engine is faulted at a time:
the next fault waits until every engine process is running again. Every fault is recorded
with its time and the step in progress (read from the run's ``metrics.jsonl``).

Never leaves a process behind: ``stop()`` resumes (SIGCONT) and SIGKILLs every process it
stopped that is still there. Every wait is bounded. Never imports Prefect.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

log = logging.getLogger(__name__)

ENGINE_MODULE = "rl_core.engine.server"


@dataclass
class Fault:
    """One injected engine fault."""

    kind: str  # "kill" | "hang"
    pid: int
    step: int  # the step in progress when it was injected
    at: float  # seconds since the injector started


def engine_processes(parent: int | None = None) -> list[psutil.Process]:
    """The embedded engine processes started (directly or not) by ``parent`` (default: us)."""
    out = []
    for p in psutil.Process(parent or os.getpid()).children(recursive=True):
        try:
            if ENGINE_MODULE in p.cmdline():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _running_requests(p: psutil.Process) -> int:
    """Requests the engine ``p`` is decoding now (its ``/v1/loads``; 0 if it cannot say)."""
    try:
        argv = p.cmdline()
        port = argv[argv.index("--port") + 1]
        body = httpx.get(f"http://127.0.0.1:{port}/v1/loads", timeout=1.0, trust_env=False).json()
        return int(sum(x.get("num_running_reqs", 0) for x in body["loads"]))
    except (psutil.Error, ValueError, IndexError, KeyError, TypeError, httpx.HTTPError):
        return 0


def _served_version(p: psutil.Process) -> str | None:
    """The weight version engine ``p`` serves (its ``/model_info``; None if it cannot say)."""
    try:
        argv = p.cmdline()
        port = argv[argv.index("--port") + 1]
        body = httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=1.0, trust_env=False)
        version = body.json().get("weight_version")
        return None if version is None else str(version)
    except (psutil.Error, ValueError, IndexError, KeyError, TypeError, AttributeError,
            httpx.HTTPError):
        return None


def steps_done(metrics: Path) -> int:
    """Steps logged so far in a run's ``metrics.jsonl`` (0 before the first)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x)["step"] for x in lines if x.strip()]
    return max(steps, default=0)


class EngineChaos:
    """Kills and hangs the flow's engines from a background thread; see the module doc.

    ``plan``: {step: kind} injects ``kind`` once during that step's rollout, into an engine
    that is generating (a fixed, deterministic schedule for the short test). Without a plan, faults come at random every
    ``gap_s`` (uniform range) seconds, ``p_hang`` of them hangs, until ``last_step`` starts.
    ``num_engines``: a fault waits until this many engine processes run (none recovering).
    """

    def __init__(
        self,
        metrics: Path,
        *,
        seed: int,
        num_engines: int,
        last_step: int,
        plan: Mapping[int, str] | None = None,
        gap_s: tuple[float, float] = (20.0, 60.0),
        p_hang: float = 0.5,
        settle_s: float = 3.0,
    ) -> None:
        self.metrics = metrics
        self.rng = random.Random(seed)
        self.num_engines = num_engines
        self.last_step = last_step
        self.plan = dict(plan or {})
        self.gap_s, self.p_hang, self.settle_s = gap_s, p_hang, settle_s
        self.faults: list[Fault] = []
        self._stopped: list[psutil.Process] = []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-chaos", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> EngineChaos:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self, kind: str) -> int:
        return sum(f.kind == kind for f in self.faults)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop injecting; resume and SIGKILL every process this injector stopped."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for p in self._stopped:
            try:
                if p.is_running():  # same pid *and* start time: never another process
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait(10)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            if self.plan:
                self._run_plan()
            else:
                self._run_random()
        except Exception:  # a broken injector must show in the test, not kill the thread
            log.exception("engine chaos: injector failed")
            self.faults.append(Fault("injector-error", -1, -1, self._now()))

    def _run_plan(self) -> None:
        for step, kind in sorted(self.plan.items()):
            # step `step` is in progress once step - 1 is logged; strike mid-rollout
            if not self._wait(lambda s=step: steps_done(self.metrics) >= s - 1):
                return
            self._inject(kind, busy=True)

    def _run_random(self) -> None:
        first = self.rng.sample(["kill", "hang"], 2)  # both kinds early, even in a short run
        while not self._halt.wait(self.rng.uniform(*self.gap_s)):
            if steps_done(self.metrics) >= self.last_step:
                return
            kind = first.pop() if first else "hang" if self.rng.random() < self.p_hang else "kill"
            self._inject(kind)

    def _wait(self, condition, timeout_s: float = 900.0, poll_s: float = 0.1) -> bool:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._halt.is_set():
                return False
            if condition():
                return True
            time.sleep(poll_s)
        log.error("engine chaos: gave up waiting after %.0fs", timeout_s)
        return False

    def _healthy_set(self, serving: bool = False) -> list[psutil.Process] | None:
        """Every engine process running for ``settle_s`` (``serving``: and answering, all with
        one weight version): the last fault is repaired. The random soak asks for ``serving``:
        a restarted engine is otherwise struck again while it loads or re-syncs, and three
        failed recoveries take it out of service for the rest of the run."""
        procs = [p for p in engine_processes() if _running(p)]
        if len(procs) < self.num_engines:
            return None
        if any(time.time() - p.create_time() < self.settle_s for p in procs):
            return None
        if serving:
            versions = {_served_version(p) for p in procs}
            if None in versions or len(versions) != 1:
                return None
        return procs

    def _inject(self, kind: str, *, busy: bool = False) -> None:
        """Fault one engine: at random, or (``busy``) one that is generating right now."""
        procs: list[psutil.Process] | None = None

        def ready() -> bool:
            nonlocal procs
            procs = self._healthy_set(serving=not busy)
            return procs is not None

        if not self._wait(ready, timeout_s=300.0) or procs is None:
            return
        victim = self.rng.choice(sorted(procs, key=lambda p: p.pid))
        if busy:
            generating: list[psutil.Process] = []

            def some_busy() -> bool:
                generating[:] = [p for p in procs or [] if _running_requests(p) > 0]
                return bool(generating)

            if self._wait(some_busy, timeout_s=120.0, poll_s=0.01):
                victim = generating[0]
        step = steps_done(self.metrics) + 1
        try:
            if kind == "kill":
                victim.send_signal(signal.SIGKILL)
            else:
                victim.send_signal(signal.SIGSTOP)
                self._stopped.append(victim)
        except psutil.NoSuchProcess:
            return
        self.faults.append(Fault(kind, victim.pid, step, self._now()))
        log.warning("engine chaos: %s engine pid %d during step %d at %.1fs",
                    kind, victim.pid, step, self._now())  # fmt: skip

    def _now(self) -> float:
        return time.monotonic() - self._t0
