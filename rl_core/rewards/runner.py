"""Bounded execution of reward functions over a batch of (completion, reference answer) pairs.

What this module is for: resolving a reward spec (a builtin name or ``package.module:function``)
to a callable (`load_reward_fn`) and scoring rollout batches with it (`RewardRunner`) so that a
broken, slow or hanging user function costs one sample's reward, never the training step.

What it must never do: import prefect, mlflow or torch (reward workers are fresh interpreters
that pay every import again after each timeout); raise because of a bad *sample* (exceptions,
hangs, NaN, wrong return types all score 0 and are counted); leave a stuck thread or process
behind when a user function hangs and isolation is on; or block the caller for much more than
``timeout_s`` per sample.

Isolation model:

* Builtin specs (``"gsm8k"``, ``"format"``) are our own code: they run in-process, with
  exceptions still guarded.
* Custom specs run in worker subprocesses. Each worker is a fresh ``python -c`` interpreter
  (started with ``subprocess`` and talking over a ``multiprocessing.connection`` socket pair)
  rather than a ``multiprocessing`` "spawn" child: spawn re-imports the parent's ``__main__``
  — for the ``grpoflow`` CLI that is the whole trainer with torch — in every worker and again
  after every timeout. A fresh interpreter imports only ``rl_core.rewards`` and the user
  module. The parent's ``sys.path`` is handed to the worker, so anything importable here is
  importable there. Workers run in their own session, so a timeout kills the worker *and*
  anything it started (``killpg``), and terminal Ctrl-C reaches only the trainer.
* ``isolate=False`` with a custom spec runs the function on a throwaway daemon thread joined
  with ``timeout_s``. A timeout is counted and the caller moves on, but Python cannot kill a
  thread: the hung call keeps running (and holding whatever it holds) until it returns.
* Memory: every worker runs under ``RLIMIT_AS`` (``memory_limit_mb``; by default
  `DEFAULT_MEMORY_LIMIT_MB` for workers), so a function that allocates without bound gets a
  MemoryError (or its worker dies and is replaced) instead of taking the machine down; either
  way that sample scores 0 and is counted as an error.

Fault budget: a function that fails *every* sample of ``max_failed_steps`` consecutive
training steps is broken, not unlucky; `score` then raises `RewardFunctionError` naming the
function and its last error, and keeps raising on every later call (a retried step fails at
once instead of scoring zeros again). Calls are grouped into steps by their ``step`` argument
(dynamic sampling scores one step in several calls); without it each call is one step.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import TYPE_CHECKING, Any, Literal

from rl_core.rewards.math import format_reward, gsm8k_reward

if TYPE_CHECKING:  # the config module imports no rewards code; only the type is needed
    from rl_core.config import RewardConfig

__all__ = [
    "BUILTIN_REWARDS",
    "DEFAULT_MAX_FAILED_STEPS",
    "DEFAULT_MEMORY_LIMIT_MB",
    "RewardFn",
    "RewardFunctionError",
    "RewardResult",
    "RewardRunner",
    "load_reward_fn",
]

RewardFn = Callable[[str, str], float]

# Outcome of one call: ("ok", score) | ("error", message) | ("timeout", None).
_Outcome = tuple[str, Any]

_MAX_ERROR_MESSAGES = 5
_MAX_MESSAGE_CHARS = 200
_KILL_WAIT_S = 5.0
_ORPHAN_POLL_S = 1.0

# Defaults shared with rl_core.config.RewardConfig (a test keeps them equal).
DEFAULT_MEMORY_LIMIT_MB = 4096
DEFAULT_MAX_FAILED_STEPS = 3


class RewardFunctionError(RuntimeError):
    """A reward function failed every sample of ``steps`` consecutive steps: the run must stop.

    ``spec`` names the function, ``last_error`` is the last failure it reported (one of the
    messages of `RewardResult.errors`).
    """

    def __init__(self, spec: str, steps: int, last_error: str) -> None:
        self.spec, self.steps, self.last_error = spec, steps, last_error
        super().__init__(
            f"reward function {spec!r} failed every sample of {steps} consecutive steps "
            f"(reward.max_failed_steps={steps}); last error: {last_error}. Fix the function "
            f"(try it by hand: from rl_core.rewards import load_reward_fn; "
            f"load_reward_fn({spec!r})(completion, answer)), raise reward.timeout_s or "
            "reward.memory_limit_mb if it timed out or ran out of memory, or set "
            "reward.max_failed_steps=0 to score such steps 0 and carry on."
        )

    def __reduce__(self):  # picklable across process boundaries (Prefect results, Ray)
        return (type(self), (self.spec, self.steps, self.last_error))


def _format_only(completion: str, answer: str) -> float:
    return format_reward(completion)


BUILTIN_REWARDS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward, "format": _format_only}


def _builtin_names() -> str:
    return ", ".join(repr(name) for name in BUILTIN_REWARDS)


def _split_spec(spec: object) -> tuple[str, str]:
    """Validate the shape of a non-builtin spec; return (module, attribute path)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"reward spec {spec!r} is empty or not a string. Fix: use a builtin "
            f"({_builtin_names()}) or a 'package.module:function' path."
        )
    module_name, sep, attr_path = spec.strip().partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(
            f"unknown reward spec {spec!r}: it is not a builtin ({_builtin_names()}) and not of "
            "the form 'package.module:function'. Fix: use a builtin name, or point at a "
            "function, e.g. 'my_rewards.math:score'."
        )
    return module_name, attr_path


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``spec`` to a reward function ``fn(completion, answer) -> float``.

    ``spec`` is a builtin name (``"gsm8k"``, ``"format"``) or ``package.module:function``
    (``function`` may be a dotted attribute path, e.g. ``mod:Scorer.score``). The module is
    imported in *this* process — `RewardRunner` calls this inside its worker for custom specs.

    Raises ValueError naming the spec and what is wrong — malformed spec, module not found,
    module failing to import, attribute missing (listing the module's public callables),
    not callable, or not callable with two positional arguments — with a hint how to fix it.
    """
    if isinstance(spec, str) and spec.strip() in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec.strip()]
    module_name, attr_path = _split_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"reward spec {spec!r}: module {module_name!r} not found ({e}). Fix: check the "
                "spelling, install the package, or put its directory on PYTHONPATH."
            ) from e
        raise ValueError(
            f"reward spec {spec!r}: module {module_name!r} was found but importing it failed "
            f"because a module it needs is missing ({e}). Fix: install that dependency."
        ) from e
    except Exception as e:
        raise ValueError(
            f"reward spec {spec!r}: importing module {module_name!r} raised "
            f"{type(e).__name__}: {e}. Fix: debug with python -c 'import {module_name}'."
        ) from e
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(
                name
                for name, value in vars(module).items()
                if callable(value) and not name.startswith("_")
            )
            raise ValueError(
                f"reward spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}. "
                f"Fix: check the name after ':'; public callables there: "
                f"{', '.join(public[:10]) or 'none'}."
            ) from None
    if not callable(obj):
        raise ValueError(
            f"reward spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable. "
            "Fix: point at a function fn(completion: str, answer: str) -> float."
        )
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        # Some C callables carry no signature; the call itself will tell.
        return obj
    try:
        signature.bind("", "")
    except TypeError as e:
        raise ValueError(
            f"reward spec {spec!r}: {attr_path}{signature} cannot be called as "
            f"fn(completion, answer) ({e}). Fix: accept two positional arguments."
        ) from None
    return obj


def _short(message: str) -> str:
    message = " ".join(message.split())
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return message[: _MAX_MESSAGE_CHARS - 3] + "..."


def _describe(exc: BaseException) -> str:
    return _short(f"{type(exc).__name__}: {exc}")


def _as_score(value: object) -> _Outcome:
    if value is None or isinstance(value, str | bytes):
        return "error", _short(f"returned {type(value).__name__} {value!r}, expected a float")
    try:
        score = float(value)  # type: ignore[arg-type]
    except Exception as e:
        return "error", _short(f"returned {type(value).__name__}, expected a float ({e})")
    if not math.isfinite(score):
        return "error", f"returned non-finite score {score}"
    return "ok", score


def _call_one(fn: RewardFn, completion: str, answer: str) -> _Outcome:
    try:
        value = fn(completion, answer)
    except (Exception, SystemExit) as e:
        # SystemExit too: a user function calling sys.exit() is a bad sample, not a shutdown.
        return "error", _describe(e)
    return _as_score(value)


@dataclass
class RewardResult:
    """Per-batch outcome of `RewardRunner.score`, aligned with the input lists.

    ``scores[i]`` is ``fn(completion, answer) + format_weight * format_reward(completion)``,
    or 0.0 when the call failed (error or timeout; the format bonus is not given then either).
    ``correct[i]`` is the builtin GSM8K correctness, independent of the custom function.
    ``errors`` holds the first few failure messages (timeouts included), each prefixed with
    the sample index; ``last_error`` is the last one, whatever the count. ``failed_streak``
    is how many consecutive steps, this call's included, failed every sample (0 once a sample
    of this call's step scored).
    """

    scores: list[float]
    correct: list[bool]
    num_errors: int = 0
    num_timeouts: int = 0
    errors: list[str] = field(default_factory=list)
    failed_streak: int = 0
    last_error: str | None = None

    @property
    def num_failed(self) -> int:
        """Samples that scored 0 because the function failed (errors and timeouts)."""
        return self.num_errors + self.num_timeouts

    @property
    def all_failed(self) -> bool:
        """True when the batch is not empty and no sample was scored by the function."""
        return bool(self.scores) and self.num_failed == len(self.scores)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.scores) if self.scores else 0.0

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat float metrics for the training step's logger."""
        return {
            f"{prefix}mean": self.mean,
            f"{prefix}std": statistics.pstdev(self.scores) if self.scores else 0.0,
            f"{prefix}accuracy": self.accuracy,
            f"{prefix}num_errors": float(self.num_errors),
            f"{prefix}num_timeouts": float(self.num_timeouts),
            f"{prefix}failed_streak": float(self.failed_streak),
        }


# --------------------------------------------------------------------------- worker side

# Runs in the fresh interpreter. sys.path must be in place before rl_core can be imported.
_WORKER_BOOT = (
    "import json, sys\n"
    "cfg = json.loads(sys.argv[1])\n"
    "sys.path[:] = cfg['sys_path'] + [p for p in sys.path if p not in cfg['sys_path']]\n"
    "from rl_core.rewards.runner import _worker_main\n"
    "_worker_main(cfg)\n"
)


def _watch_parent(parent_pid: int) -> None:
    # A worker stuck in user code never sees EOF on its socket; without this it would
    # outlive a trainer that was SIGKILLed.
    while True:
        time.sleep(_ORPHAN_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _apply_memory_limit(limit_mb: int) -> None:
    import resource

    limit = limit_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _worker_main(cfg: dict[str, Any]) -> None:
    conn = Connection(cfg["fd"])
    threading.Thread(
        target=_watch_parent, args=(cfg["parent_pid"],), daemon=True, name="reward-orphan-watch"
    ).start()
    try:
        if cfg.get("memory_limit_mb"):
            _apply_memory_limit(int(cfg["memory_limit_mb"]))
        fn = load_reward_fn(cfg["spec"])
    except BaseException as e:
        # Whatever the import did (including sys.exit), the parent must get a message.
        conn.send(("load_error", str(e) if isinstance(e, ValueError) else _describe(e)))
        return
    conn.send(("ready", None))
    _serve(conn, fn)


def _serve(conn: Connection, fn: RewardFn) -> None:
    """Score batches of (index, completion, answer) until EOF or a None batch.

    One result message per sample, sent as soon as it is ready: the parent measures each
    sample's time from the previous result, which is what bounds a hang per sample.
    """
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for index, completion, answer in batch:
            kind, value = _call_one(fn, completion, answer)
            try:
                conn.send((index, kind, value))
            except OSError:
                return  # parent gone or gave up on us; nothing left to report to


# --------------------------------------------------------------------------- parent side


class _Slot:
    """One worker process and the samples it still owes the current `score` call."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        # dead -> starting -> ready <-> busy; any -> dead on kill.
        self.state = "dead"
        self.queue: deque[int] = deque()
        self.deadline = 0.0


def _kill_slot(slot: _Slot) -> int | None:
    proc, conn = slot.proc, slot.conn
    slot.proc, slot.conn, slot.state = None, None, "dead"
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.close()
    if proc is None:
        return None
    if proc.returncode is None:
        # The worker leads its own process group; killing the group also ends anything the
        # user function started. Safe from pid reuse: the worker is not reaped yet.
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_KILL_WAIT_S)
    return proc.returncode


def _shutdown_slots(slots: list[_Slot]) -> None:
    for slot in slots:
        slot.queue.clear()
        _kill_slot(slot)


def _has_data(conn: Connection) -> bool:
    try:
        return conn.poll(0)
    except (OSError, EOFError):
        return True  # let the reader discover the broken connection


def _chunks(n: int, k: int) -> list[range]:
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


class RewardRunner:
    """Score completions against reference answers with every call bounded by a timeout.

    ``spec``: builtin name or ``package.module:function`` (see `load_reward_fn`).
    ``timeout_s``: per-sample limit. ``format_weight``: weight of the builtin `format_reward`
    added to every successful sample. ``max_workers``: number of worker processes; a batch is
    split into that many contiguous chunks (only used when isolated; inline scoring is
    sequential). ``isolate``: None = custom specs in subprocesses, builtins inline; True =
    always subprocesses; False = always in-process (custom functions then run on a daemon
    thread per call: timeouts are counted but a hung thread leaks — see module docstring).
    ``memory_limit_mb``: RLIMIT_AS (virtual address space, not RSS — libraries that reserve
    large mappings need headroom) for each worker; a function exceeding it gets MemoryError
    or the worker dies, both scored as errors. ``"auto"`` (the default):
    `DEFAULT_MEMORY_LIMIT_MB` when isolated, none inline; None: no limit. A number is only
    valid when isolated.
    ``start_timeout_s``: how long a worker may take to start and import the user module.
    ``max_failed_steps``: `score` raises `RewardFunctionError` once this many consecutive
    steps failed every sample (0: never; see `score`).

    Workers start in the constructor, so a bad custom spec raises ValueError there (RuntimeError
    when the worker cannot start at all), and stay alive across `score` calls. After a timeout
    the worker is killed and a fresh one started for the remaining samples. Release with
    `close()` or ``with RewardRunner(...) as runner:``; a `weakref.finalize` kills leftover
    workers when the runner is garbage-collected or at interpreter exit. Concurrent `score`
    calls are serialised by a lock; calling `close()` while another thread is in `score` is
    not supported (that call's remaining samples would be scored as errors).
    """

    def __init__(
        self,
        spec: str = "gsm8k",
        timeout_s: float = 5.0,
        format_weight: float = 0.0,
        max_workers: int = 1,
        isolate: bool | None = None,
        memory_limit_mb: int | None | Literal["auto"] = "auto",
        start_timeout_s: float = 60.0,
        max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
    ) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(format_weight, int | float) and math.isfinite(format_weight)):
            raise ValueError(f"format_weight must be a finite number, got {format_weight!r}")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        if not (isinstance(start_timeout_s, int | float) and start_timeout_s > 0):
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s!r}")
        if memory_limit_mb not in (None, "auto") and (
            not isinstance(memory_limit_mb, int)
            or isinstance(memory_limit_mb, bool)
            or memory_limit_mb <= 0
        ):
            raise ValueError(f"memory_limit_mb must be a positive integer, got {memory_limit_mb!r}")
        if (
            not isinstance(max_failed_steps, int)
            or isinstance(max_failed_steps, bool)
            or max_failed_steps < 0
        ):
            raise ValueError(
                f"max_failed_steps must be an integer >= 0 (0: never fail), got "
                f"{max_failed_steps!r}"
            )
        builtin = isinstance(spec, str) and spec.strip() in BUILTIN_REWARDS
        isolated = (not builtin) if isolate is None else bool(isolate)
        if memory_limit_mb == "auto":
            memory_limit_mb = DEFAULT_MEMORY_LIMIT_MB if isolated else None
        if memory_limit_mb is not None and not isolated:
            raise ValueError(
                "memory_limit_mb can only be enforced in a worker subprocess; "
                "it cannot be combined with in-process scoring (isolate=False or a builtin spec "
                "with isolate=None). Fix: pass isolate=True or drop memory_limit_mb."
            )
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self.format_weight = float(format_weight)
        self.max_workers = max_workers
        self.memory_limit_mb = memory_limit_mb
        self.start_timeout_s = float(start_timeout_s)
        self.max_failed_steps = max_failed_steps
        self.isolated = isolated
        self._failed_streak = 0
        # Fault budget state: the current step, whether it scored samples and whether the
        # function scored any of them, and the failed steps in a row before it.
        self._step: object = None
        self._step_seen = self._step_scored = False
        self._done_streak = 0
        self._fatal: RewardFunctionError | None = None
        self._builtin = builtin
        self._closed = False
        self._lock = threading.Lock()
        self._stats = {
            "calls": 0,
            "samples": 0,
            "errors": 0,
            "timeouts": 0,
            "worker_restarts": 0,
            "leaked_threads": 0,
            "all_failed_calls": 0,
        }
        self._slots: list[_Slot] = []
        self._fn: RewardFn | None = None
        if not isolated:
            self._fn = load_reward_fn(spec)
            self._finalizer: weakref.finalize | None = None
            return
        if not builtin:
            _split_spec(spec)  # a malformed spec should not cost a process start
        self._slots = [_Slot() for _ in range(max_workers)]
        self._finalizer = weakref.finalize(self, _shutdown_slots, self._slots)
        try:
            self._start_all()
        except BaseException:
            self._finalizer()
            raise

    @classmethod
    def from_config(cls, reward: RewardConfig) -> RewardRunner:
        """The runner a training run uses: every knob from the ``reward`` config section.

        The memory limit applies to custom functions (worker processes); the builtins run
        in-process and need none.
        """
        builtin = reward.fn.strip() in BUILTIN_REWARDS
        return cls(
            reward.fn,
            timeout_s=reward.timeout_s,
            format_weight=reward.format_weight,
            memory_limit_mb=None if builtin else reward.memory_limit_mb,
            max_failed_steps=reward.max_failed_steps,
        )

    # ------------------------------------------------------------------ public

    def score(
        self, completions: Sequence[str], answers: Sequence[str], *, step: int | None = None
    ) -> RewardResult:
        """Score each completion against its reference answer; never raises for a bad sample.

        ``step``: the training step the samples belong to. Calls with the same ``step``
        (dynamic sampling's extra rounds, a retried task) count as one step for the fault
        budget; without it every call is a step of its own.

        Raises ValueError if the two lists differ in length, RuntimeError after `close()`, and
        `RewardFunctionError` once ``max_failed_steps`` consecutive steps failed every sample
        (and on every call after that one).
        """
        if len(completions) != len(answers):
            raise ValueError(
                f"got {len(completions)} completions but {len(answers)} answers; "
                "they must be aligned one to one"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardRunner.score called after close()")
            if self._fatal is not None:
                raise self._fatal
            if self.isolated:
                outcomes = self._run_isolated(completions, answers)
            else:
                outcomes = [
                    self._run_inline(c, a) for c, a in zip(completions, answers, strict=True)
                ]
            result = self._assemble(completions, answers, outcomes)
            self._stats["calls"] += 1
            self._stats["samples"] += len(completions)
            self._stats["errors"] += result.num_errors
            self._stats["timeouts"] += result.num_timeouts
            self._count_failed_call(result, object() if step is None else step)
            return result

    def _count_failed_call(self, result: RewardResult, step: object) -> None:
        """Track consecutive steps whose every sample failed; raise at ``max_failed_steps``.

        A step counts as failed as soon as it has scored samples and none of them was
        scored by the function; a later call of the same step that scores one clears it.
        """
        if step != self._step:  # a new step begins
            failed_before = self._step_seen and not self._step_scored
            self._done_streak = self._done_streak + 1 if failed_before else 0
            self._step, self._step_seen, self._step_scored = step, False, False
        if result.scores:  # an empty call proves nothing
            self._step_seen = True
            if result.all_failed:
                self._stats["all_failed_calls"] += 1
            else:
                self._step_scored = True
                self._done_streak = 0
        current = 1 if self._step_seen and not self._step_scored else 0
        self._failed_streak = result.failed_streak = self._done_streak + current
        if self.max_failed_steps and self._failed_streak >= self.max_failed_steps:
            last = result.last_error or "no message"
            self._fatal = RewardFunctionError(str(self.spec), self._failed_streak, last)
            raise self._fatal

    def stats(self) -> dict[str, int]:
        """Cumulative counters since construction (calls, samples, errors, timeouts, ...)."""
        return dict(self._stats)

    @property
    def failed_streak(self) -> int:
        """Consecutive `score` calls, up to the last one, that failed every sample."""
        return self._failed_streak

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live worker processes (empty when scoring inline)."""
        return [slot.proc.pid for slot in self._slots if slot.proc is not None]

    def close(self) -> None:
        """Kill the worker processes. Idempotent; `score` raises afterwards."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring

    def _assemble(
        self, completions: Sequence[str], answers: Sequence[str], outcomes: list[_Outcome]
    ) -> RewardResult:
        result = RewardResult(scores=[], correct=[])
        for i, (completion, answer, (kind, value)) in enumerate(
            zip(completions, answers, outcomes, strict=True)
        ):
            result.correct.append(self._is_correct(completion, answer))
            if kind == "ok":
                total = value + self.format_weight * self._format_score(completion)
                if math.isfinite(total):
                    result.scores.append(total)
                    continue
                kind, value = "error", f"score {value} + format bonus is not finite"
            result.scores.append(0.0)
            if kind == "timeout":
                result.num_timeouts += 1
                message = f"timed out after {self.timeout_s:g} s"
            else:
                result.num_errors += 1
                message = str(value)
            result.last_error = _short(f"sample {i}: {message}")
            if len(result.errors) < _MAX_ERROR_MESSAGES:
                result.errors.append(result.last_error)
        return result

    def _is_correct(self, completion: str, answer: str) -> bool:
        try:
            return gsm8k_reward(completion, answer) == 1.0
        except Exception:
            return False  # non-str inputs; the reward call reports them as errors

    def _format_score(self, completion: str) -> float:
        if not self.format_weight:
            return 0.0
        try:
            return format_reward(completion)
        except Exception:
            return 0.0

    def _run_inline(self, completion: str, answer: str) -> _Outcome:
        assert self._fn is not None
        if self._builtin:
            return _call_one(self._fn, completion, answer)
        box: list[_Outcome] = []
        fn = self._fn
        thread = threading.Thread(
            target=lambda: box.append(_call_one(fn, completion, answer)),
            daemon=True,
            name="reward-fn-inline",
        )
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._stats["leaked_threads"] += 1
            return "timeout", None
        return box[0] if box else ("error", "reward thread ended without a result")

    # ------------------------------------------------------------------ workers

    def _spawn(self, slot: _Slot) -> None:
        if self._closed:
            raise OSError("runner is closed")
        if not sys.executable:
            raise OSError("sys.executable is unknown; cannot start a Python worker")
        parent_sock, child_sock = socket.socketpair()
        try:
            cfg = {
                "fd": child_sock.fileno(),
                "spec": self.spec,
                "sys_path": [p for p in sys.path if isinstance(p, str)],
                "memory_limit_mb": self.memory_limit_mb,
                "parent_pid": os.getpid(),
            }
            proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOT, json.dumps(cfg)],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        slot.proc = proc
        slot.conn = Connection(parent_sock.detach())
        slot.state = "starting"
        slot.deadline = time.monotonic() + self.start_timeout_s

    def _start_all(self) -> None:
        for slot in self._slots:
            try:
                self._spawn(slot)
            except OSError as e:
                raise RuntimeError(
                    f"reward spec {self.spec!r}: could not start a worker process: {e}"
                ) from e
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(self._slots)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"reward spec {self.spec!r}: worker did not finish starting within "
                    f"{self.start_timeout_s:g} s (slow or hanging import?). Fix: check the "
                    "module's import-time code or raise start_timeout_s."
                )
            ready = wait_for_connections([slot.conn for slot in pending], remaining)
            for slot in [s for s in pending if s.conn in ready]:
                assert slot.conn is not None
                try:
                    kind, payload = slot.conn.recv()
                except (EOFError, OSError):
                    code = _kill_slot(slot)
                    hint = (
                        f" (memory_limit_mb={self.memory_limit_mb} may be too small)"
                        if self.memory_limit_mb
                        else ""
                    )
                    raise RuntimeError(
                        f"reward spec {self.spec!r}: worker exited during start-up "
                        f"(exit code {code}){hint}"
                    ) from None
                if kind == "load_error":
                    raise ValueError(payload)
                slot.state = "ready"
                pending.remove(slot)

    @staticmethod
    def _died_idle(slot: _Slot) -> bool:
        # An idle worker never writes, so readable data means EOF: its socket closes before
        # the process can be reaped (a dying thread group lingers), hence both checks.
        assert slot.proc is not None and slot.conn is not None
        return slot.proc.poll() is not None or _has_data(slot.conn)

    def _spawn_or_fail(self, slot: _Slot, outcomes: list[_Outcome | None]) -> None:
        try:
            self._spawn(slot)
        except OSError as e:
            self._fail_queue(slot, outcomes, f"could not start worker process: {e}")

    def _fail_queue(self, slot: _Slot, outcomes: list[_Outcome | None], message: str) -> None:
        for index in slot.queue:
            outcomes[index] = ("error", message)
        slot.queue.clear()

    def _restart(self, slot: _Slot, outcomes: list[_Outcome | None]) -> None:
        _kill_slot(slot)
        self._stats["worker_restarts"] += 1
        self._spawn_or_fail(slot, outcomes)

    def _dispatch(
        self,
        slot: _Slot,
        completions: Sequence[str],
        answers: Sequence[str],
        outcomes: list[_Outcome | None],
    ) -> None:
        assert slot.conn is not None
        batch = [(i, completions[i], answers[i]) for i in slot.queue]
        try:
            slot.conn.send(batch)
        except (OSError, ValueError):
            slot.state = "busy"  # died just now: charge the first sample like any death
            self._on_death(slot, outcomes)
            return
        slot.state = "busy"
        slot.deadline = time.monotonic() + self.timeout_s

    def _on_death(self, slot: _Slot, outcomes: list[_Outcome | None]) -> None:
        was_busy = slot.state == "busy"
        code = _kill_slot(slot)
        hint = (
            f" (out of memory? memory_limit_mb={self.memory_limit_mb})"
            if self.memory_limit_mb
            else ""
        )
        if not was_busy:
            self._fail_queue(slot, outcomes, f"worker exited during start-up (exit code {code})")
            return
        if slot.queue:
            index = slot.queue.popleft()
            outcomes[index] = (
                "error",
                f"worker process died (exit code {code}){hint} while scoring this sample",
            )
        self._stats["worker_restarts"] += 1
        self._spawn_or_fail(slot, outcomes)

    def _expire(self, slot: _Slot, outcomes: list[_Outcome | None]) -> None:
        if slot.state == "busy":
            outcomes[slot.queue.popleft()] = ("timeout", None)
            # Restart even with nothing left to do: the next batch finds a warm worker.
            self._restart(slot, outcomes)
        else:
            _kill_slot(slot)
            self._fail_queue(
                slot, outcomes, f"worker did not start within {self.start_timeout_s:g} s"
            )

    def _drain(
        self,
        slot: _Slot,
        completions: Sequence[str],
        answers: Sequence[str],
        outcomes: list[_Outcome | None],
    ) -> None:
        while slot.conn is not None:
            conn = slot.conn
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
                    slot.state = "ready"
                    if slot.queue:
                        self._dispatch(slot, completions, answers, outcomes)
                else:
                    _kill_slot(slot)
                    self._fail_queue(slot, outcomes, f"worker could not load reward: {payload}")
            elif slot.state == "busy":
                index, kind, value = message
                if slot.queue and slot.queue[0] == index:
                    slot.queue.popleft()
                    outcomes[index] = (kind, value)
                    slot.deadline = time.monotonic() + self.timeout_s
                    if not slot.queue:
                        slot.state = "ready"

    def _run_isolated(self, completions: Sequence[str], answers: Sequence[str]) -> list[_Outcome]:
        outcomes: list[_Outcome | None] = [None] * len(completions)
        working: list[_Slot] = []
        for slot, chunk in zip(
            self._slots, _chunks(len(completions), len(self._slots)), strict=True
        ):
            if not chunk:
                continue
            slot.queue = deque(chunk)
            working.append(slot)
            if slot.state == "ready" and self._died_idle(slot):
                # Replace it rather than blame the first sample of this batch.
                self._restart(slot, outcomes)
            elif slot.state == "dead":
                self._spawn_or_fail(slot, outcomes)
            if slot.state == "ready":
                self._dispatch(slot, completions, answers, outcomes)
        while True:
            pending = [slot for slot in working if slot.queue]
            if not pending:
                break
            timeout = max(0.0, min(slot.deadline for slot in pending) - time.monotonic())
            ready = wait_for_connections([slot.conn for slot in pending], timeout)
            for slot in pending:
                if slot.conn in ready:
                    self._drain(slot, completions, answers, outcomes)
            now = time.monotonic()
            for slot in pending:
                # Only expire a slot with nothing unread: a result that arrived while we
                # were busy elsewhere (e.g. restarting another worker) still counts.
                if (
                    slot.queue
                    and slot.conn is not None
                    and now >= slot.deadline
                    and not _has_data(slot.conn)
                ):
                    self._expire(slot, outcomes)
        assert all(outcome is not None for outcome in outcomes)
        return outcomes  # type: ignore[return-value]
