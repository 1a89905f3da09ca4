"""A real ``mlflow server`` process for tests: SQLite backend, proxied artifacts (a local
directory, or an S3 bucket on the test's S3 endpoint).

Started with ``--workers 1`` and ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` (otherwise it
spawns ~10 processes and ~3 GB), in its own process group so that stopping it stops the
uvicorn worker too. Every wait is bounded. :meth:`MlflowServer.kill` and
``start_mlflow_server(root, port=server.port)`` take a server down and bring it back on the
same port and store (an outage, for tests/test_tracking_outage.py).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rl_core.host import free_port

MLFLOW_VERSION = importlib.metadata.version("mlflow")


@dataclass
class MlflowServer:
    url: str
    db_path: Path
    artifacts: Path | str  # a directory, or the s3:// destination
    log_path: Path
    proc: subprocess.Popen
    restart: Callable[[int], subprocess.Popen] | None = None  # on another port (chosen port)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until this MLflow answers ``/version`` with MLflow's version (a ``/health``
        could be another server's that took the port first); raise with the server's log if
        it exits or the bound passes. A server on a port the test did not choose that lost its
        port to another process is started again on a fresh one (``url`` changes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.restart is None or "already in use" not in self._log_tail():
                    raise RuntimeError(f"mlflow server exited early:\n{self._log_tail()}")
                port = free_port()
                self.url, self.proc = f"http://127.0.0.1:{port}", self.restart(port)
                continue
            try:
                with urllib.request.urlopen(f"{self.url}/version", timeout=2) as r:
                    if r.status == 200 and r.read().decode().strip() == MLFLOW_VERSION:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {timeout}s:\n{self._log_tail()}")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill(self, timeout: float = 20.0) -> None:
        """SIGKILL the server's process group (a crash, not a shutdown) and reap it."""
        if self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)
            while time.monotonic() < deadline:  # the worker, reaped by init, goes a moment later
                os.killpg(pgid, 0)
                time.sleep(0.1)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it has not exited."""
        if self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout  # the worker may outlive the CLI by a moment
        with contextlib.suppress(ProcessLookupError):
            while time.monotonic() < deadline:
                os.killpg(pgid, 0)
                time.sleep(0.2)
            os.killpg(pgid, signal.SIGKILL)


def start_mlflow_server(
    root: Path,
    timeout: float = 180.0,
    wait: bool = True,
    *,
    artifacts_destination: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> MlflowServer:
    """Start ``mlflow server`` on a free 127.0.0.1 port with its store under ``root``;
    with ``wait``, returns once ``/health`` answers (else call :meth:`MlflowServer.wait_ready`
    later, so that other setup overlaps the server's ~10-30 s start).

    ``artifacts_destination`` (e.g. ``s3://bucket/mlflow``, with ``env`` pointing the server
    at the endpoint: ``MLFLOW_S3_ENDPOINT_URL`` and credentials) replaces the local
    ``root/artifacts``; clients always go through the server's artifact proxy. ``port``
    (default: a free one) with the ``root`` of a stopped server restarts that server: same
    URL, same store; its log is appended to."""
    root.mkdir(parents=True, exist_ok=True)
    chosen, port = port is not None, port or free_port()
    db, log_path = root / "mlflow.db", root / "server.log"
    artifacts: Path | str = artifacts_destination or root / "artifacts"
    env = {
        **os.environ,
        **(env or {}),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }

    def launch(port: int) -> subprocess.Popen:
        cmd = [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--backend-store-uri", f"sqlite:///{db}",
            "--artifacts-destination", str(artifacts),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--workers", "1",
        ]  # fmt: skip
        with log_path.open("a") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    server = MlflowServer(f"http://127.0.0.1:{port}", db, artifacts, log_path, launch(port),
                          restart=None if chosen else launch)
    if wait:
        server.wait_ready(timeout)
    return server
