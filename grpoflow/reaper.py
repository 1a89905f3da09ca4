"""What a ``grpoflow`` command leaves running when it ends, however it ends: nothing.

:func:`start` launches a *reaper* (``python -m grpoflow.reaper``, its own session) that scans
the command's descendants every ``poll_s`` seconds, learns of its death from the kernel
(``PR_SET_PDEATHSIG``), then SIGTERMs what it saw (pid and start time still matching) and what
carries its marker or is listed by the launcher, and SIGKILLs the rest ``grace_s`` later.
:func:`exit_within` bounds the command's own exit after SIGTERM/SIGINT (docs/reliability.md).
Never imports Prefect, torch or rl_core (the reaper starts in ~50 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

__all__ = ["exit_within", "kill_descendants", "start"]

log = logging.getLogger("rl_core.reaper")  # the CLI shows rl_core's records
_PR_SET_PDEATHSIG = 1
MARK = "GRPOFLOW_REAPED_BY"
PIDS_ENV = "GRPOFLOW_STARTED_PIDS"  # rl_core.rollout.launch.PIDS_ENV (no rl_core import here)


def start(grace_s: float = 5.0, poll_s: float = 2.0) -> subprocess.Popen | None:
    """Start the reaper of this process (from the main thread: the kernel's parent-death
    signal follows the thread that forked). ``None`` where it cannot run (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    mark = f"{os.getpid()}-{time.time_ns()}"
    os.environ[MARK] = mark  # inherited by everything this process starts from now on
    import tempfile

    fd, pids = tempfile.mkstemp(prefix="grpoflow-started-", suffix=".pids")
    os.close(fd)
    os.environ[PIDS_ENV] = pids  # rl_core's process launcher appends what it starts
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "grpoflow.reaper", "--pid", str(os.getpid()),
             "--grace", str(grace_s), "--poll", str(poll_s), "--mark", mark, "--pids", pids,
             "--since", repr(time.time())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)
    except OSError as e:  # a run without a reaper still runs
        log.warning("could not start the process reaper (%s): a SIGKILLed run may leave its "
                    "Prefect API server running", e)
        return None


def kill_descendants(procs: list[psutil.Process], grace_s: float) -> list[int]:
    """SIGTERM ``procs`` (those still alive), SIGKILL what is left after ``grace_s``; the pids
    signalled. A process is only signalled while it is the one seen (psutil checks the start
    time), so a reused pid is never hit."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running():
                p.terminate()
                alive.append(p)
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=2.0)
    return [p.pid for p in alive]


def exit_within(seconds: float, code: int) -> None:
    """Arm a deadline: if this process still runs ``seconds`` from now, kill its descendants
    and leave with ``code`` (``os._exit``: no thread, atexit hook or finalizer can hold it)."""
    def deadline() -> None:
        time.sleep(seconds)
        print(f"grpoflow: still running {seconds:g}s after the stop signal; killing what it "
              "started and exiting", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            me = psutil.Process()
            kill_descendants(me.children(recursive=True), grace_s=2.0)
        os._exit(code)

    threading.Thread(target=deadline, name="grpoflow-exit-deadline", daemon=True).start()


class _ParentGone(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by the parent-death signal's handler, out of whatever the loop is doing."""


_armed = False  # the handler raises once, and only inside the watch loop's try


def _parent_gone(signum: int, frame: object) -> None:
    # Only raise: a handler that took a lock (threading.Event.set) could deadlock with the
    # very code it interrupted. And raise once: the signal comes again each time the kernel
    # moves us on to another thread of a dying multi-threaded parent (the parent-death signal
    # follows threads), and a second raise after the first was caught would end the reaper
    # before it reaps. The kernel also changes our parent before it signals, so the loop may
    # have left its try already: then there is nothing to do either.
    global _armed
    if _armed:
        _armed = False
        raise _ParentGone


def _marked(mark: str, skip: set[int], since: float) -> list[psutil.Process]:
    """The running processes started at or after ``since`` (the command's start: nothing
    older can carry its marker, and an unrelated process is never read) whose environment
    carries ``MARK=mark`` (but ``skip``)."""
    out = []
    for p in psutil.process_iter():
        if p.pid in skip:
            continue
        with contextlib.suppress(psutil.Error):
            if p.create_time() >= since - 1.0 and p.environ().get(MARK) == mark:
                out.append(p)
    return out


def _registered(path: str | None, skip: set[int], since: float) -> list[psutil.Process]:
    """The still-running processes listed in ``path`` ("pid create_time" lines, appended by
    the command's process launcher), each only while it is the process listed; the file is
    removed. A process that rewrote its environment and command line (sglang-router sets its
    title over them) is found this way when the scans missed it."""
    if not path:
        return []
    out = []
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError:
        return []
    for line in filter(None, lines):
        with contextlib.suppress(ValueError, psutil.Error):
            p_id, started = line.split()
            p = psutil.Process(int(p_id))
            if (p.pid not in skip and abs(p.create_time() - float(started)) < 0.05
                    and p.create_time() >= since - 1.0):
                out.append(p)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return out


def _watch(pid: int, grace_s: float, poll_s: float, mark: str | None = None,
           pids: str | None = None, started: float | None = None) -> int:
    """The reaper's loop (see the module docstring); returns its exit code."""
    global _armed
    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    try:
        parent = psutil.Process(pid)
        since = parent.create_time()
    except psutil.Error:
        # The command died before its reaper ran (a SIGKILL within its first moments):
        # what it started carries its mark (set before ``started``) or is in its list.
        if started is None:
            return 0
        log.info("reaper of %d: it ended before the first scan", pid)
        return _reap_missed(pid, me, [], grace_s, mark, pids, started)
    log.info("reaper of %d: watching (scan every %gs, grace %gs)", pid, poll_s, grace_s)
    signal.signal(signal.SIGUSR1, _parent_gone)
    _armed = True
    try:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
        while os.getppid() == pid and parent.is_running():  # (dead before PDEATHSIG was set)
            with contextlib.suppress(psutil.Error):
                for child in parent.children(recursive=True):
                    if child.pid != me:
                        seen.setdefault(child.pid, child)
                # forget the ones that ended (a pid may be reused by another process)
                for p_id in [p_id for p_id, p in seen.items() if not p.is_running()]:
                    del seen[p_id]
            time.sleep(poll_s)
        _armed = False  # (a signal before this line raises in the try; after, it is a no-op)
    except _ParentGone:  # (the handler disarmed itself)
        pass
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    deadline = time.monotonic() + grace_s  # every thread of the parent gone, then reap
    while os.getppid() == pid and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = list(seen.values())
    log.info("reaper of %d: its command ended; ending %s", pid, [
        f"{p.pid}:{_name(p)}" for p in procs])
    return _reap_missed(pid, me, procs, grace_s, mark, pids, since)


def _reap_missed(pid: int, me: int, procs: list[psutil.Process], grace_s: float,
                 mark: str | None, pids: str | None, since: float) -> int:
    """End ``procs`` and the started or marked processes the scans missed."""
    known = {p.pid for p in procs}
    missed = [p for p in _registered(pids, {me, pid}, since) if p.pid not in known]
    if mark:
        known |= {p.pid for p in missed}
        missed += [p for p in _marked(mark, {me, pid}, since) if p.pid not in known]
    if missed:
        log.info("reaper of %d: and the started or marked ones its scans missed: %s", pid, [
            f"{p.pid}:{_name(p)}" for p in missed])
        procs += missed
    killed = kill_descendants(procs, grace_s)
    log.info("reaper of %d: signalled %s; still running: %s", pid, killed,
             [p.pid for p in procs if _running(p)])
    return 0


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return "?"


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpoflow.reaper", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--pid", type=int, required=True, help="the process whose leftovers to reap")
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM -> SIGKILL, seconds")
    p.add_argument("--poll", type=float, default=2.0, help="descendant scan period, seconds")
    p.add_argument("--mark", default=None, help=f"the {MARK} value of the command's processes")
    p.add_argument("--since", type=float, default=None, help="when the command set its mark "
                   "(time.time()): reap by mark even if the command ended before the first scan")
    p.add_argument("--pids", default=None, help="the file the command's launcher lists the "
                   "processes it starts in")
    args = p.parse_args(argv)
    if path := os.environ.get("GRPOFLOW_REAPER_LOG"):  # what it saw and signalled
        logging.basicConfig(filename=path, level=logging.INFO,
                            format="%(asctime)s %(process)d %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is for the run
    try:
        return _watch(args.pid, args.grace, args.poll, args.mark, args.pids, args.since)
    except BaseException:  # stderr is /dev/null: say it where someone may look
        log.exception("reaper of %d: failed", args.pid)
        raise


if __name__ == "__main__":
    sys.exit(main())
