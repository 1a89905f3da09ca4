"""Run untrusted Python in a fresh, isolated interpreter: its own session (killed whole on a
timeout), an address-space limit, an empty environment, ``/tmp`` as its directory.

Shared by the ``python`` agent tool (:mod:`rl_core.agents.tools`) and the ``code_tests``
reward (:mod:`rl_core.rewards.builtins`). Imports nothing heavy; never leaves a process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["Ran", "apply_memory_limit", "run_code"]


def apply_memory_limit(limit_mb: int) -> None:
    """RLIMIT_AS of this process (a child's ``preexec_fn``): ``limit_mb``, or the hard limit."""
    import resource

    limit, (_, hard) = limit_mb * 1024 * 1024, resource.getrlimit(resource.RLIMIT_AS)
    limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


@dataclass(frozen=True)
class Ran:
    """What the code did: its exit code (None: killed at the timeout) and its output."""

    returncode: int | None
    stdout: str
    stderr: str


def run_code(code: str, *, timeout_s: float = 10.0, memory_limit_mb: int | None = 1024) -> Ran:
    """Run ``code`` with ``python -I`` (no user site, no PYTHON* variables) in a new session;
    on a timeout the whole session is killed and ``returncode`` is None."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, cwd="/tmp",
        env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
        preexec_fn=(lambda: apply_memory_limit(memory_limit_mb)) if memory_limit_mb else None)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # the interpreter and whatever it started
        out, err = proc.communicate()
        return Ran(None, out.decode(errors="replace"), err.decode(errors="replace"))
    return Ran(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
