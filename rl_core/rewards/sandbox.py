"""Run untrusted Python in bubblewrap: no network, a read-only root, a private ``/tmp``, no
project files, no environment, and CPU, memory, process, file and output limits.

Shared by the ``python`` agent tool (:mod:`rl_core.agents.tools`), the code environment
(:mod:`rl_core.agents.code_env`) and the ``code_tests`` reward (:mod:`rl_core.rewards.code`).
Each run is a fresh ``bwrap`` with its own network, PID, IPC and UTS namespaces; only the system
directories (``/usr`` and its links) and the interpreter's installation are mounted, read-only,
plus a small tmpfs ``/tmp``; the code runs with ``python -I -S`` (the standard library only: no
site-packages, no ``.pth`` start-up code, no ``exit()`` builtin: ``sys.exit``). Limits are set inside, after the namespaces exist (``prlimit``:
RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE); as root the code also drops to an
unprivileged uid of its own (``setpriv``; drawn at random per run from a range no user has, so
the process limit counts that run's processes only, across every process on the machine). A run past its wall-clock bound, or past its output cap, is killed whole (the bwrap
process group; the PID namespace takes every descendant with it). The bound is the smaller of
``SandboxLimits.wall_s`` and what the caller's ``deadline`` leaves after ``reserve_s``: the
caller (a reward, an environment step) always keeps time to answer.

At most ``max_concurrent`` runs at once; up to ``max_queued`` more wait for a slot (within
their deadline), and beyond that a run is refused at once (``status="busy"``). Where bubblewrap
cannot run (not installed, no user namespaces), :func:`require_sandbox` raises
:class:`SandboxUnavailable` naming the fix; nothing ever runs unisolated. docs/agents.md,
'Code sandbox'. Imports nothing heavy; never leaves a process behind; never logs the code's
environment (it has none).
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace

__all__ = ["Ran", "Sandbox", "SandboxLimits", "SandboxUnavailable", "apply_memory_limit",
           "default_sandbox", "require_sandbox", "run_code"]

_FIX = ("install bubblewrap: `make sandbox-deps` (as root it runs apt-get install -y bubblewrap), "
        "or your distribution's `bubblewrap` package")
# As root each run's uid/gid is drawn from [_UID_BASE, _UID_BASE + _UID_SPAN): no such user. Two
# of a thousand concurrent runs share one with odds ~2.5e-4, and then only share a process limit.
_UID_BASE, _UID_SPAN = 2_000_000_000, 2_000_000_000
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_MIN_RUN_S = 0.05  # a run is not started with less than this left before the caller's deadline
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def apply_memory_limit(limit_mb: int) -> None:
    """RLIMIT_AS of this process (a child's ``preexec_fn``): ``limit_mb``, or the hard limit."""
    import resource

    limit, (_, hard) = limit_mb * 1024 * 1024, resource.getrlimit(resource.RLIMIT_AS)
    limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces here; the message names the fix."""


@dataclass(frozen=True)
class SandboxLimits:
    """Bounds on one run (docs/agents.md, 'Code sandbox')."""

    wall_s: float = 10.0  # wall clock, start to kill (and the caller's deadline bounds it)
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at this, SIGKILL a second later
    memory_mb: int = 512  # RLIMIT_AS of each process
    processes: int = 16  # RLIMIT_NPROC: processes and threads of the run
    output_bytes: int = 65536  # stdout + stderr kept; more kills the run
    file_mb: int = 16  # RLIMIT_FSIZE, and the size of the private /tmp

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "output_bytes", "file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Ran:
    """What a run did. ``status``: ``ok`` (the code exited; ``returncode`` says how, negative
    for a signal: bwrap reports 128 + the signal, e.g. 152 for the CPU limit's SIGXCPU),
    ``timeout`` (killed at ``wall_s``), ``output_limit`` (killed for printing too much),
    ``deadline`` (cut short by the caller's deadline before its own ``wall_s``), ``busy`` (no
    slot before the deadline, or the queue was full: never started), ``error`` (bwrap could not
    be started).
    A run that exits on its own is ``ok`` whatever it printed: the code cannot fake a failure
    of the sandbox."""

    returncode: int | None
    stdout: str
    stderr: str
    status: str = "ok"
    wall_s: float = 0.0

    @property
    def infrastructure_failure(self) -> bool:
        """The sandbox, not the code, failed: no score should be read from this run."""
        return self.status in ("busy", "deadline", "error")


_checked: dict[tuple[str, ...], str] = {}  # argv prefix -> "" (works) or the failure
_check_lock = threading.Lock()


def _interpreter() -> tuple[str, str]:
    """(the base interpreter's real path, its installation prefix): never a venv's copy."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


class Sandbox:
    """A bounded queue of bubblewrap runs (see the module docstring). ``python``: the
    interpreter to run (default: this one's base installation, mounted read-only);
    ``ro_paths``: more host paths mounted read-only (e.g. a directory of packages the code may
    import), never the project or ``$HOME`` wholesale. Raises :class:`SandboxUnavailable`."""

    def __init__(self, limits: SandboxLimits | None = None, *, max_concurrent: int | None = None,
                 max_queued: int = 1024, reserve_s: float = 0.5, python: str | None = None,
                 ro_paths: tuple[str, ...] = ()) -> None:
        self.limits = limits or SandboxLimits()
        self.max_concurrent = max_concurrent or 4 * (os.cpu_count() or 1)  # benchmarks/sandbox_throughput.py
        if self.max_concurrent < 1 or max_queued < 0 or reserve_s < 0:
            raise ValueError("sandbox: max_concurrent must be >= 1, max_queued and reserve_s >= 0")
        self.max_queued, self.reserve_s = max_queued, float(reserve_s)
        exe, prefix = _interpreter()
        self.python = python or exe  # another interpreter: under /usr or in ro_paths
        self._ro_paths = tuple(dict.fromkeys(
            os.path.realpath(p) for p in ((prefix,) if python is None else ()) + tuple(ro_paths)
            if os.path.exists(p)))
        self._root = os.geteuid() == 0
        self._slots: queue.Queue[int] = queue.Queue()
        for i in range(self.max_concurrent):
            self._slots.put(i)
        self._waiting, self._lock = 0, threading.Lock()
        self.stats = dict.fromkeys(("runs", "timeouts", "output_limits", "busy", "errors"), 0)
        self.check()

    # ------------------------------------------------------------------ the command

    def _bwrap_args(self) -> list[str]:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(f"the code sandbox needs bubblewrap (`bwrap`), which is not "
                                     f"on PATH: {_FIX}")
        args = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session",
                "--hostname", "sandbox"]
        if not self._root:  # an unprivileged user's bwrap needs its own user namespace
            args += ["--unshare-user", "--cap-drop", "ALL"]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        made = {"/"}
        for path in self._ro_paths:
            if path == "/" or any(path == d or path.startswith(d + "/") for d in _SYSTEM_DIRS):
                continue  # already mounted (the project itself is never mounted)
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):  # parents readable by the sandbox's uid
                parent = "/" + "/".join(parts[:i])
                if parent not in made:
                    made.add(parent)
                    args += ["--perms", "0755", "--dir", parent]
            args += ["--ro-bind", path, path]
        files = [f for f in _SYSTEM_FILES if os.path.isfile(f)]
        if files:
            args += ["--perms", "0755", "--dir", "/etc"]
        for f in files:
            args += ["--ro-bind", f, f]
        size = str(self.limits.file_mb * 1024 * 1024)
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size,
                 "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
        for key, value in _ENV.items():
            args += ["--setenv", key, value]
        return [*args, "--"]

    def _inner(self, limits: SandboxLimits) -> list[str]:
        """Inside the namespaces: drop to a uid of the run's own (as root), set the limits."""
        drop = []
        if self._root:
            uid = str(_UID_BASE + secrets.randbelow(_UID_SPAN))
            drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        cpu = int(limits.cpu_s)
        return [*drop, "prlimit", f"--cpu={cpu}:{cpu + 1}",
                f"--as={limits.memory_mb * 1024 * 1024}", f"--nproc={limits.processes}",
                f"--fsize={limits.file_mb * 1024 * 1024}", "--core=0", "--"]

    def check(self) -> None:
        """Run ``true`` in the sandbox once per process (per set of mounts); raise
        :class:`SandboxUnavailable` with bubblewrap's message and the fix when it cannot run."""
        argv = self._bwrap_args()
        key = tuple(argv)
        with _check_lock:
            if key not in _checked:
                try:
                    done = subprocess.run([*argv, *self._inner(self.limits), self.python,
                                           "-I", "-S", "-c", "pass"], capture_output=True, timeout=60,
                                          env={"PATH": _ENV["PATH"]}, stdin=subprocess.DEVNULL)
                    _checked[key] = "" if done.returncode == 0 else (
                        done.stderr.decode(errors="replace").strip()[-500:]
                        or f"exit code {done.returncode}")
                except (OSError, subprocess.TimeoutExpired) as e:
                    _checked[key] = f"{type(e).__name__}: {e}"
            failure = _checked[key]
        if failure:
            raise SandboxUnavailable(
                f"the code sandbox (bubblewrap) cannot run here: {failure}. Fix: bwrap needs "
                "user namespaces (as a normal user: sysctl user.max_user_namespaces > 0, and "
                "kernel.apparmor_restrict_unprivileged_userns=0 or kernel."
                "unprivileged_userns_clone=1 where those exist; in a container: allow "
                "namespaces, e.g. docker --security-opt seccomp=unconfined --cap-add SYS_ADMIN), "
                f"setpriv and prlimit (util-linux), and {self.python} readable; or {_FIX}. "
                "grpoflow never runs untrusted code without isolation.")

    # ------------------------------------------------------------------ running

    def run(self, code: str, *, deadline: float | None = None,
            limits: SandboxLimits | None = None) -> Ran:
        """Run ``code`` (a Python program, given on stdin) and return what it did. ``deadline``
        (``time.monotonic()`` seconds): the caller's; the run, queueing included, ends
        ``reserve_s`` before it. Never raises for what the code does."""
        limits = limits or self.limits
        t0 = time.monotonic()
        cutoff = float("inf") if deadline is None else deadline - self.reserve_s
        with self._lock:
            if self._waiting >= self.max_queued + self.max_concurrent:
                self.stats["busy"] += 1
                return Ran(None, "", "the sandbox queue is full", "busy")
            self._waiting += 1
        try:
            try:  # queueing counts against the caller's deadline, not against wall_s
                slot = self._slots.get(timeout=None if deadline is None else max(0.0, cutoff - t0))
            except queue.Empty:
                slot = None
            if slot is None or cutoff - time.monotonic() < _MIN_RUN_S:
                self.stats["busy"] += 1
                if slot is not None:
                    self._slots.put(slot)
                return Ran(None, "", "no sandbox slot in time for the caller's deadline", "busy",
                           time.monotonic() - t0)
            try:
                return self._run(code, limits, cutoff, t0)
            finally:
                self._slots.put(slot)
        finally:
            with self._lock:
                self._waiting -= 1

    def _run(self, code: str, limits: SandboxLimits, cutoff: float, t0: float) -> Ran:
        argv = [*self._bwrap_args(), *self._inner(limits), self.python, "-I", "-S", "-"]
        self.stats["runs"] += 1
        start = time.monotonic()
        end = min(start + limits.wall_s, cutoff)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True,
                                    env={"PATH": _ENV["PATH"]})
        except OSError as e:
            self.stats["errors"] += 1
            return Ran(None, "", f"could not start bwrap: {e}", "error", time.monotonic() - t0)
        status = "error"
        try:
            out, status = self._pump(proc, code.encode(), limits.output_bytes, end)
        finally:  # also when interrupted: never leave a sandbox behind
            if status != "ok":
                with contextlib.suppress(OSError):  # bwrap and its namespace's init: all of it
                    os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
        stdout, stderr = (b"".join(out[k]).decode(errors="replace") for k in ("out", "err"))
        if status == "timeout" and end < start + limits.wall_s:
            status = "deadline"  # cut short for the caller, not by its own limit
        if status != "ok":
            self.stats[{"timeout": "timeouts", "deadline": "timeouts",
                        "output_limit": "output_limits"}[status]] += 1
        return Ran(returncode if status == "ok" else None, stdout, stderr, status,
                   time.monotonic() - t0)

    @staticmethod
    def _pump(proc: subprocess.Popen[bytes], data: bytes, cap: int,
              end: float) -> tuple[dict[str, list[bytes]], str]:
        """Feed the program on stdin; read stdout and stderr until both close (``ok``), more
        than ``cap`` bytes arrived (``output_limit``) or ``end`` (``timeout``)."""
        assert proc.stdin and proc.stdout and proc.stderr
        out: dict[str, list[bytes]] = {"out": [], "err": []}
        total, status, view = 0, "ok", memoryview(data)
        with selectors.DefaultSelector() as sel:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            while status == "ok" and sel.get_map():
                left = end - time.monotonic()
                if left <= 0:
                    status = "timeout"
                    break
                for key, _ in sel.select(left):
                    if key.fileobj is proc.stdin:
                        try:
                            view = view[os.write(proc.stdin.fileno(), view[:65536]):]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:  # it exited without reading: nothing to send
                            view = view[:0]
                        if not view.nbytes:
                            sel.unregister(proc.stdin)
                            proc.stdin.close()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    out[key.data].append(chunk[: max(0, cap - total)])
                    total += len(chunk)
                    if total > cap:
                        status = "output_limit"
                        break
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        return out, status


_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process's shared sandbox (default limits; one queue for every caller), created and
    checked on first use: raises :class:`SandboxUnavailable` where bubblewrap cannot run."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
        return _default


def require_sandbox() -> None:
    """Start-up check for whatever will run code: raises :class:`SandboxUnavailable` (naming
    the fix) where the sandbox cannot run."""
    default_sandbox()


def run_code(code: str, *, timeout_s: float = 10.0, memory_limit_mb: int | None = 1024,
             deadline: float | None = None) -> Ran:
    """Run ``code`` in the shared sandbox with a wall-clock bound of ``timeout_s`` (and the
    caller's ``deadline``) and ``memory_limit_mb`` of address space per process; on a timeout
    ``returncode`` is None."""
    box = default_sandbox()
    limits = replace(box.limits, wall_s=float(timeout_s), cpu_s=max(1, int(timeout_s + 0.999)),
                     memory_mb=int(memory_limit_mb or box.limits.memory_mb))
    return box.run(code, deadline=deadline, limits=limits)
