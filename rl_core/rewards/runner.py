"""Bounded execution of reward functions over (completion, reference answer) pairs.

`RewardRunner` scores batches with a reward function (`rl_core.rewards.forms`: a builtin or
``package.module:function``, per sample or batched, sync or async), custom functions in
sandboxed worker processes, so a broken, slow or hanging function costs one sample's reward
(a batched one's: its batch), never the step; failing every sample of
``max_failed_steps`` steps raises `RewardFunctionError` (docs/agents.md, 'Reward functions';
docs/reliability.md). Never imports prefect, mlflow or torch; never raises for a bad sample;
never leaves a stuck process behind; never blocks much longer than ``timeout_s`` per sample.
"""


from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import TYPE_CHECKING, Any, Literal

from rl_core.rewards.forms import (
    BUILTIN_REWARDS,
    PER_SAMPLE,
    Item,
    RewardFn,
    call_one,
    call_whole,
    describe,
    load_reward_fn,
    reward_form,
    split_spec,
)
from rl_core.rewards.results import (
    FailedStepStreak,
    Outcome,
    RewardFunctionError,
    RewardResult,
    ScoreBook,
)
from rl_core.rewards.sandbox import apply_memory_limit

if TYPE_CHECKING:  # the config module imports no rewards code; only the type is needed
    from rl_core.config import RewardConfig

__all__ = ["BUILTIN_REWARDS", "DEFAULT_MAX_FAILED_STEPS", "DEFAULT_MEMORY_LIMIT_MB", "FailedStepStreak", "RewardFn",
           "RewardFunctionError", "RewardResult", "RewardRunner", "load_reward_fn", "reward_form"]

_KILL_WAIT_S, _ORPHAN_POLL_S = 5.0, 1.0

# Defaults shared with rl_core.config.RewardConfig (a test keeps them equal).
DEFAULT_MEMORY_LIMIT_MB, DEFAULT_MAX_FAILED_STEPS = 4096, 3


# Runs in the fresh interpreter. sys.path must be in place before rl_core can be imported.
_WORKER_BOOT = (
    "import json, sys\ncfg = json.loads(sys.argv[1])\n"
    "sys.path[:] = cfg['sys_path'] + [p for p in sys.path if p not in cfg['sys_path']]\n"
    "from rl_core.rewards.runner import _worker_main\n_worker_main(cfg)\n")


def _watch_parent(parent_pid: int) -> None:
    # A worker stuck in user code never sees EOF; without this it outlives a SIGKILLed trainer.
    while True:
        time.sleep(_ORPHAN_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(cfg: dict[str, Any]) -> None:
    conn = Connection(cfg["fd"])
    threading.Thread(target=_watch_parent, args=(cfg["parent_pid"],), daemon=True,
                     name="reward-orphan-watch").start()
    try:
        if cfg.get("memory_limit_mb"):
            apply_memory_limit(int(cfg["memory_limit_mb"]))
        fn = load_reward_fn(cfg["spec"], cfg.get("args"))
        form = reward_form(fn)
    except BaseException as e:  # whatever the import did (sys.exit too), the parent must know
        conn.send(("load_error", str(e) if isinstance(e, ValueError) else describe(e)))
        return
    conn.send(("ready", form))
    _serve(conn, fn, form, float(cfg.get("timeout_s", 5.0)))


def _serve(conn: Connection, fn: RewardFn, form: tuple[str, bool] = PER_SAMPLE,
           timeout_s: float = 5.0) -> None:
    """Score batches of items (:data:`Item`) until EOF or a None batch. A sync single-sample
    function sends one result message per sample as soon as it is ready: the parent times
    each sample from the previous result, which is what bounds a hang per sample. A batched or
    async one scores the batch at once (:func:`call_whole`) and sends every result then."""
    with contextlib.suppress(EOFError, OSError):  # parent gone or gave up on us: nothing to do
        while (batch := conn.recv()) is not None:
            if form == PER_SAMPLE:
                for index, completion, answer, *_ in batch:
                    conn.send((index, *call_one(fn, completion, answer)))
                continue
            for item, outcome in zip(batch, call_whole(fn, form, batch, timeout_s), strict=True):
                conn.send((item[0], *outcome))


@dataclass(eq=False)
class _Slot:
    """One worker process and the samples it still owes the current `score` call."""
    proc: subprocess.Popen[bytes] | None = None
    conn: Connection | None = None
    state: str = "dead"  # dead -> starting -> ready <-> busy; any -> dead on kill
    queue: deque[int] = field(default_factory=deque)
    deadline: float = 0.0
    form: tuple[str, bool] = PER_SAMPLE  # the function's (reward_form), once ready


def _kill_slot(slot: _Slot) -> int | None:
    proc, conn = slot.proc, slot.conn
    slot.proc, slot.conn, slot.state = None, None, "dead"
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.close()
    if proc is None:
        return None
    if proc.poll() is None:
        # The worker leads its own process group; killing the group also ends anything the
        # user function started. Safe from pid reuse: the worker is not reaped yet (poll()
        # also sees one reaped behind the handle's back).
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_KILL_WAIT_S)
    return proc.returncode


def _has_data(conn: Connection) -> bool:
    try:
        return conn.poll(0)
    except (OSError, EOFError):
        return True  # let the reader discover the broken connection


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


class RewardRunner(ScoreBook):
    """Score completions against reference answers, every call bounded by a timeout.

    ``isolate``: None = custom specs in workers, builtins inline; True/False = always/never.
    ``memory_limit_mb``: RLIMIT_AS per worker (``"auto"``: the default when isolated; a number
    needs isolation). Workers start here (bad spec: ValueError; no start: RuntimeError) and live
    across calls until `close()`, ``with`` or garbage collection. `score` calls are serialised;
    `close()` during another thread's `score` is unsupported. docs/agents.md, 'Reward functions'."""

    def __init__(self, spec: str = "gsm8k", timeout_s: float = 5.0, format_weight: float = 0.0,
                 max_workers: int = 1, isolate: bool | None = None,
                 memory_limit_mb: int | None | Literal["auto"] = "auto",
                 start_timeout_s: float = 60.0, max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
                 pass_threshold: float = 1.0, args: Mapping[str, Any] | None = None) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(format_weight, int | float) and math.isfinite(format_weight)):
            raise ValueError(f"format_weight must be a finite number, got {format_weight!r}")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        if not (isinstance(start_timeout_s, int | float) and start_timeout_s > 0):
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s!r}")
        if memory_limit_mb not in (None, "auto") and not _is_int(memory_limit_mb, 1):
            raise ValueError(f"memory_limit_mb must be a positive integer, got {memory_limit_mb!r}")
        if not _is_int(max_failed_steps, 0):
            raise ValueError(f"max_failed_steps must be an integer >= 0 (0: never fail), got "
                             f"{max_failed_steps!r}")
        builtin = isinstance(spec, str) and spec.strip() in BUILTIN_REWARDS
        isolated = (not builtin) if isolate is None else bool(isolate)
        if memory_limit_mb == "auto":
            memory_limit_mb = DEFAULT_MEMORY_LIMIT_MB if isolated else None
        if memory_limit_mb is not None and not isolated:
            raise ValueError(
                "memory_limit_mb can only be enforced in a worker subprocess; "
                "it cannot be combined with in-process scoring (isolate=False or a builtin spec "
                "with isolate=None). Fix: pass isolate=True or drop memory_limit_mb.")
        self.spec, self.max_workers, self.isolated = spec, max_workers, isolated
        self.args = dict(args or {})
        self.timeout_s, self.format_weight = float(timeout_s), float(format_weight)
        self.memory_limit_mb, self.start_timeout_s = memory_limit_mb, float(start_timeout_s)
        self.max_failed_steps, self.pass_threshold = max_failed_steps, float(pass_threshold)
        # Fault budget: the streak, and the error that ends every later call.
        self._streak = FailedStepStreak()
        self._failed_streak = 0
        self._fatal: RewardFunctionError | None = None
        self._builtin, self._closed, self._lock = builtin, False, threading.Lock()
        self._stats = dict.fromkeys(("calls", "samples", "errors", "timeouts", "worker_restarts",
                                     "leaked_threads", "all_failed_calls"), 0)
        self._fn = None if isolated else load_reward_fn(spec, self.args)
        self.form = PER_SAMPLE if isolated else reward_form(self._fn)
        slots = self._slots = [_Slot() for _ in range(max_workers if isolated else 0)]
        # The callback must not hold self, or the runner would never be collected.
        self._finalizer = weakref.finalize(self, lambda: [_kill_slot(slot) for slot in slots])
        if not isolated:
            return
        if not builtin:
            split_spec(spec)  # a malformed spec should not cost a process start
        try:
            self._start_all()
        except BaseException:
            self._finalizer()
            raise

    @classmethod
    def from_config(cls, reward: RewardConfig) -> RewardRunner:
        """The runner a training run uses: every knob from the ``reward`` config section (the
        memory limit only for custom functions: the builtins run in-process)."""
        builtin = reward.fn.strip() in BUILTIN_REWARDS
        return cls(reward.fn, timeout_s=reward.timeout_s, format_weight=reward.format_weight,
                   memory_limit_mb=None if builtin else reward.memory_limit_mb,
                   max_failed_steps=reward.max_failed_steps, pass_threshold=reward.pass_threshold)

    def score(self, completions: Sequence[str], answers: Sequence[Any], *,
              step: int | None = None, budget: bool = True,
              record_ids: Sequence[str] | None = None, prompts: Sequence[Any] | None = None,
              columns: Sequence[Mapping[str, Any]] | None = None) -> RewardResult:
        """Score each completion against its reference answer; never raises for a bad sample.
        ``step``/``budget``: the fault budget; ``record_ids``: for scorers that read the
        question (a judge); ``prompts``/``columns``: each sample's prompt and dataset row, for
        a batched function. Raises ValueError for misaligned lists, RuntimeError after
        `close()`, `RewardFunctionError` once the budget is spent (and on every later call)."""
        n = len(completions)
        if len(answers) != n or (prompts is not None and len(prompts) != n) or (
                columns is not None and len(columns) != n):
            raise ValueError(f"got {len(completions)} completions but {len(answers)} answers "
                             f"(prompts, columns: {'-' if prompts is None else len(prompts)}, "
                             f"{'-' if columns is None else len(columns)}); they must be "
                             "aligned one to one")
        items: list[Item] = [(i, completions[i], answers[i], None if prompts is None
                              else prompts[i], {} if columns is None else columns[i])
                             for i in range(n)]
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardRunner.score called after close()")
            if self._fatal is not None:
                raise self._fatal
            outcomes = self._run_isolated(items) if self.isolated else self._run_inline(items)
            result = self._assemble(completions, outcomes)
            for key, n in (("calls", 1), ("samples", len(completions)),
                           ("errors", result.num_errors), ("timeouts", result.num_timeouts)):
                self._stats[key] += n
            if budget:
                self._count_failed_call(result, object() if step is None else step)
            return result

    def stats(self) -> dict[str, int]:
        """Cumulative counters since construction (calls, samples, errors, timeouts, ...)."""
        return dict(self._stats)

    @property
    def failed_streak(self) -> int:
        """Consecutive steps, up to the last budgeted `score` call, that failed every sample."""
        return self._failed_streak

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live worker processes (empty when scoring inline)."""
        return [slot.proc.pid for slot in self._slots if slot.proc is not None]

    def close(self) -> None:
        """Kill the worker processes. Idempotent; `score` raises afterwards."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _fatal_error(self, steps: int, last: str) -> RewardFunctionError:
        return RewardFunctionError(str(self.spec), steps, last)

    def _timeout_note(self) -> str:
        return f"timed out after {self.timeout_s:g} s"

    def _run_inline(self, items: Sequence[Item]) -> list[Outcome]:
        fn, form, whole = self._fn, self.form, self.form != PER_SAMPLE
        if self._builtin:
            return (call_whole(fn, form, items, self.timeout_s) if whole
                    else [call_one(fn, it[1], it[2]) for it in items])
        if whole:
            return self._in_thread(lambda: call_whole(fn, form, items, self.timeout_s),
                                   self.timeout_s * max(len(items), 1), len(items))
        return [self._in_thread(lambda it=it: [call_one(fn, it[1], it[2])], self.timeout_s, 1)[0]
                for it in items]

    def _in_thread(self, call: Callable[[], list[Outcome]], timeout_s: float,
                   n: int) -> list[Outcome]:
        box: list[list[Outcome]] = []
        thread = threading.Thread(target=lambda: box.append(call()), daemon=True,
                                  name="reward-fn-inline")
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self._stats["leaked_threads"] += 1
            return [("timeout", None)] * n
        return box[0] if box else [("error", "reward thread ended without a result")] * n

    def _spawn(self, slot: _Slot) -> None:
        if self._closed:
            raise OSError("runner is closed")
        if not sys.executable:
            raise OSError("sys.executable is unknown; cannot start a Python worker")
        parent_sock, child_sock = socket.socketpair()
        try:
            cfg = {"fd": child_sock.fileno(), "spec": self.spec, "args": self.args,
                   "timeout_s": self.timeout_s,
                   "sys_path": [p for p in sys.path if isinstance(p, str)],
                   "memory_limit_mb": self.memory_limit_mb, "parent_pid": os.getpid()}
            proc = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT, json.dumps(cfg)],
                                    pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        slot.proc, slot.conn, slot.state = proc, Connection(parent_sock.detach()), "starting"
        slot.deadline = time.monotonic() + self.start_timeout_s

    def _start_all(self) -> None:
        for slot in self._slots:
            try:
                self._spawn(slot)
            except OSError as e:
                raise RuntimeError(
                    f"reward spec {self.spec!r}: could not start a worker process: {e}") from e
        deadline = time.monotonic() + self.start_timeout_s
        for slot in self._slots:  # they all start at once: one shared deadline bounds the wait
            if not slot.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(
                    f"reward spec {self.spec!r}: worker did not finish starting within "
                    f"{self.start_timeout_s:g} s (slow or hanging import?). Fix: check the "
                    "module's import-time code or raise start_timeout_s.")
            try:
                kind, payload = slot.conn.recv()
            except (EOFError, OSError):
                code = _kill_slot(slot)
                hint = (f" (memory_limit_mb={self.memory_limit_mb} may be too small)"
                        if self.memory_limit_mb else "")
                raise RuntimeError(f"reward spec {self.spec!r}: worker exited during start-up "
                                   f"(exit code {code}){hint}") from None
            if kind == "load_error":
                raise ValueError(payload)
            slot.state, slot.form = "ready", tuple(payload)
            self.form = slot.form

    def _fail_queue(self, slot: _Slot, outcomes: list[Outcome | None], message: str) -> None:
        """Kill the worker (if any) and fail every sample it still owed with ``message``."""
        _kill_slot(slot)
        for index in slot.queue:
            outcomes[index] = ("error", message)
        slot.queue.clear()

    def _restart(self, slot: _Slot, outcomes: list[Outcome | None], count: bool = True) -> None:
        _kill_slot(slot)
        self._stats["worker_restarts"] += count
        try:
            self._spawn(slot)
        except OSError as e:
            self._fail_queue(slot, outcomes, f"could not start worker process: {e}")

    def _dispatch(self, slot: _Slot, items: Sequence[Item],
                  outcomes: list[Outcome | None]) -> None:
        slot.state = "busy"
        try:
            slot.conn.send([items[i] for i in slot.queue])
        except (OSError, ValueError):  # died just now: charge the first sample like any death
            self._on_death(slot, outcomes)
            return
        # a batched or async function answers for the whole batch at once
        whole = slot.form != PER_SAMPLE
        slot.deadline = time.monotonic() + self.timeout_s * (len(slot.queue) if whole else 1)

    def _on_death(self, slot: _Slot, outcomes: list[Outcome | None],
                  timed_out: bool = False) -> None:
        """The worker died, or ran past its deadline (``timed_out``). A busy one costs the sample
        it was scoring and is replaced, even with nothing left to do (the next batch finds a
        warm worker); a starting one fails every sample it owed."""
        busy, code = slot.state == "busy", _kill_slot(slot)
        if not busy:
            self._fail_queue(slot, outcomes, (
                f"worker did not start within {self.start_timeout_s:g} s" if timed_out
                else f"worker exited during start-up (exit code {code})"))
            return
        hint = (f" (out of memory? memory_limit_mb={self.memory_limit_mb})"
                if self.memory_limit_mb else "")
        whole = slot.form != PER_SAMPLE  # the batch was one call: it all failed
        while slot.queue:
            outcomes[slot.queue.popleft()] = ("timeout", None) if timed_out else (
                "error", f"worker process died (exit code {code}){hint} while scoring this sample")
            if not whole:
                break
        self._restart(slot, outcomes)

    def _drain(self, slot: _Slot, items: Sequence[Item], outcomes: list[Outcome | None]) -> None:
        while (conn := slot.conn) is not None:
            try:
                if not conn.poll(0):
                    return
                message = conn.recv()
            except (EOFError, OSError):
                self._on_death(slot, outcomes)
                return
            if slot.state == "starting":
                kind, payload = message
                if kind == "ready":
                    slot.state, slot.form = "ready", tuple(payload)
                    if slot.queue:
                        self._dispatch(slot, items, outcomes)
                else:
                    self._fail_queue(slot, outcomes, f"worker could not load reward: {payload}")
            elif slot.state == "busy":
                index, kind, value = message
                if slot.queue and slot.queue[0] == index:
                    slot.queue.popleft()
                    outcomes[index] = (kind, value)
                    slot.deadline = time.monotonic() + self.timeout_s
                    if not slot.queue:
                        slot.state = "ready"

    def _run_isolated(self, items: Sequence[Item]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(items)
        working: list[_Slot] = []
        n, k = len(items), len(self._slots)
        for i, slot in enumerate(self._slots):  # slot i scores a contiguous chunk
            if not (chunk := range(i * n // k, (i + 1) * n // k)):
                continue
            slot.queue = deque(chunk)
            working.append(slot)
            # An idle worker never writes, so readable data means EOF: its socket closes before
            # the process can be reaped (a dying thread group lingers), hence both checks.
            # Replace a dead one rather than blame the first sample of this batch.
            if slot.state == "ready" and (slot.proc.poll() is not None or _has_data(slot.conn)):
                self._restart(slot, outcomes)
            elif slot.state == "dead":
                self._restart(slot, outcomes, count=False)
            if slot.state == "ready":
                self._dispatch(slot, items, outcomes)
        while pending := [slot for slot in working if slot.queue]:
            timeout = max(0.0, min(slot.deadline for slot in pending) - time.monotonic())
            ready = wait_for_connections([slot.conn for slot in pending], timeout)
            for slot in pending:
                if slot.conn in ready:
                    self._drain(slot, items, outcomes)
            now = time.monotonic()
            for slot in pending:
                # Only expire a slot with nothing unread: a result that arrived while we
                # were busy elsewhere (e.g. restarting another worker) still counts.
                if (slot.queue and slot.conn is not None and now >= slot.deadline
                        and not _has_data(slot.conn)):
                    self._on_death(slot, outcomes, timed_out=True)
        assert all(outcome is not None for outcome in outcomes)
        return outcomes  # type: ignore[return-value]
