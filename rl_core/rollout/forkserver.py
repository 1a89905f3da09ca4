"""Embedded engine processes forked from a server that has imported the engine once.

A fresh ``python -m rl_core.engine.server`` spends ~4 s of CPU importing torch, transformers'
Qwen2 modeling code (which pulls in torch.distributed.tensor and torch._dynamo) and FastAPI
before it reads a weight: on a 2-core machine that was most of what starting an engine cost,
and an engine restarted after a crash paid it again. :func:`start_forked` asks one
``multiprocessing`` fork server per process (started on first use, its preloaded module the
engine server) for a child instead; the child takes the command's arguments, its own session
(process group), the log file as stdout/stderr, the caller's environment and directory, and
the command line as its process title (``ps`` and the tests' process scans find it as
before). The handle has the part of :class:`subprocess.Popen` the launchers use.

The child neither imports this process's ``__main__`` (as ``multiprocessing`` would) nor anything
the server has not. CPU engines only: a GPU engine starts from a fresh interpreter (its imports are small next to
loading a model onto the device, and nothing is forked near a GPU runtime). The server never
runs torch code, so no thread pool exists when it forks. A fork that cannot be made falls back
to a fresh process (:func:`rl_core.rollout.launch.start_process`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import spawn
from pathlib import Path

__all__ = ["ENGINE_MODULE", "ForkedProcess", "forkable", "start_forked"]

ENGINE_MODULE = "rl_core.engine.server"
# transformers imports these lazily, on the first from_pretrained (~2 s of CPU more).
PRELOAD = [ENGINE_MODULE, "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.activations", "transformers.modeling_layers",
           "transformers.generation.utils"]
_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def forkable(cmd: Sequence[str]) -> bool:
    """``cmd`` is this interpreter running the embedded engine on the CPU (what
    :func:`start_forked` can start)."""
    return (len(cmd) > 3 and cmd[0] == sys.executable and list(cmd[1:3]) == ["-m", ENGINE_MODULE]
            and "--device" not in cmd and sys.platform.startswith("linux"))


def _fork_context() -> multiprocessing.context.ForkServerContext:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            # The server imports the engine and what loading a model imports (not this
            # process's __main__: a CLI's would pull in Prefect and MLflow).
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


class ForkedProcess:
    """A forked engine with ``subprocess.Popen``'s ``pid``, ``args``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._process, self.args = process, args
        self.pid: int = process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # polls; -N: killed by signal N, as Popen says it

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if (code := self.returncode) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_forked(cmd: Sequence[str], log_path: str | Path,
                 env: Mapping[str, str] | None = None) -> ForkedProcess:
    """Fork ``cmd`` (:func:`forkable`) from this process's engine fork server, its output
    appended to ``log_path`` (which the caller has created)."""
    from rl_core.engine.server import serve_forked  # what the fork server has imported

    process = _fork_context().Process(
        target=serve_forked, name="engine", daemon=True,
        args=(list(cmd), str(log_path), dict(os.environ if env is None else env)))
    with _lock:  # the child must not import this process's __main__ (a CLI: Prefect, MLflow)
        spawn.get_preparation_data = _without_main
        try:
            process.start()
        finally:
            spawn.get_preparation_data = _PREPARATION_DATA
    return ForkedProcess(process, list(cmd))


_PREPARATION_DATA = spawn.get_preparation_data


def _without_main(name: str) -> dict:
    data = _PREPARATION_DATA(name)
    data.pop("init_main_from_name", None)
    data.pop("init_main_from_path", None)
    return data
