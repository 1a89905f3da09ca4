"""The Tinker-compatible service as a long-running Prefect flow (``tinker-service``):

    start the service -> probe its health every ``health_every_s`` -> stop it

The service (``grpoflow serve-tinker``, grpoflow/tinker/, docs/tinker.md) runs as this flow's
child process, ``python -m grpoflow.tinker.serve supervised``: the flows never import the CLI
layer (.importlinter). It writes its base URL to a ready file once it answers, and stops by
itself when its stdin (a pipe this flow holds) closes, so it cannot outlive the flow's process
however that process ends (even SIGKILL).

* **Health.** ``GET <url>/api/v1/healthz``, bounded by ``probe_timeout_s``, every
  ``health_every_s``. The child's exit, or ``max_failures`` failed probes in a row, fail the
  flow run (the child stopped first); the flow's retries start a fresh service on the same
  ``root`` (checkpoints survive; tenants resume with ``load_state``; MLflow runs the dead
  service left RUNNING are ended by the next one).
* **Cancellation.** Prefect cancels a deployment's run by SIGTERM to the flow's process; the
  clean-up stops the child gracefully (SIGTERM: requests drain, sessions end, lineage is
  flushed) within ``stop_timeout_s``, then SIGKILL.
* **Reports.** Log lines when it is ready, on each failed probe, on recovery and every
  ``report_every_s``; the markdown artifact ``tinker-service-<config name>`` (URL, pid, log)
  when it is ready and when it stops. The child's own log (keys redacted) goes to
  ``<root>/service-logs/``; its tail is in the error of a failed run.

Never logs API keys: overrides are logged redacted and the keys stay in the service's config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows._redacted import redact_override, redacted_flow
from rl_core.config.base import read_config
from tasks.evaluate import artifact_key

__all__ = ["ServiceProcess", "probe", "tinker_service"]

EXAMPLE = "configs/tinker-tiny-cpu.yaml"
HEALTH_PATH = "/api/v1/healthz"


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """One bounded health probe of the service at ``url``: (healthy, what was seen)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    started = time.monotonic()
    try:
        with opener.open(url + HEALTH_PATH, timeout=timeout_s) as r:
            body = json.loads(r.read(4096) or b"{}")
            ok = r.status == 200 and body.get("status") == "ok"
            seen = f"HTTP {r.status} {body}"
    except (OSError, ValueError) as exc:  # refused, timed out, reset, not JSON
        ok, seen = False, f"{type(exc).__name__}: {exc}"
    return ok, f"{seen} in {1000 * (time.monotonic() - started):.0f} ms"


class ServiceProcess:
    """``python -m grpoflow.tinker.serve supervised`` as a child: :meth:`start`,
    :meth:`wait_ready`, :meth:`stop` (graceful, bounded, then SIGKILL)."""

    def __init__(self, config: str, overrides: list[str], log_file: Path) -> None:
        self.config, self.overrides, self.log_file = config, overrides, log_file
        self.ready_file = Path(tempfile.mkdtemp(prefix="grpoflow-tinker-")) / "url"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "grpoflow.tinker.serve", "supervised",
               str(self.ready_file), self.config, *self.overrides]
        with self.log_file.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout_s: float) -> str:
        """The base URL once the service answers; RuntimeError if it exits first or takes
        longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.is_file():
            if (rc := self.exited()) is not None:
                raise RuntimeError(f"the Tinker service exited with code {rc} before it was "
                                   f"ready (config {self.config}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Tinker service was not ready within {timeout_s:.0f} s "
                                   f"(the flow's startup_timeout_s):\n{self.tail()}")
            self.wait(0.2)  # returns at once if the child exits
        self.url = self.ready_file.read_text().strip()
        return self.url

    def wait(self, seconds: float) -> int | None:
        """Wait ``seconds`` or until the child exits; its exit code, or None if running."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=max(seconds, 0.0))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float) -> str:
        """Stop the child (stdin closed and SIGTERM: a graceful shutdown; SIGKILL after
        ``timeout_s``); how it ended."""
        proc = self.proc
        if proc is None:
            return "never started"
        if (rc := proc.poll()) is not None:
            how = f"had exited with code {rc}"
        else:
            started = time.monotonic()
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout_s)
                how = f"stopped in {time.monotonic() - started:.1f} s (code {proc.returncode})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                how = f"killed: no graceful stop within {timeout_s:.0f} s (stop_timeout_s)"
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        self.ready_file.unlink(missing_ok=True)
        self.ready_file.parent.rmdir()
        return how

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@redacted_flow(name="tinker-service", retries=3, retry_delay_seconds=5)
def tinker_service(config: str = EXAMPLE, overrides: list[str] | None = None,
                   health_every_s: float = 30.0, probe_timeout_s: float = 5.0,
                   max_failures: int = 3, startup_timeout_s: float = 3600.0,
                   stop_timeout_s: float = 25.0, report_every_s: float = 600.0,
                   max_runtime_s: float | None = None) -> dict[str, Any]:
    """Serve the Tinker API (``grpoflow serve-tinker config overrides``) until the flow run is
    cancelled, or for ``max_runtime_s`` (then COMPLETED); fails when the service dies or
    misses ``max_failures`` health probes in a row (see the module docstring)."""
    log = get_run_logger()
    overrides = list(overrides or [])
    data, _ = read_config(config, overrides, EXAMPLE)
    name = Path(config).stem
    root = Path(str(data.get("root") or "runs/tinker")).expanduser()
    log_file = root / "service-logs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    service = ServiceProcess(config, overrides, log_file)
    shown = " ".join(redact_override(o) for o in overrides)
    log.info("starting the Tinker service: grpoflow serve-tinker %s %s (log: %s)", config,
             shown, log_file)
    started = time.monotonic()
    summary: dict[str, Any] = {"config": config, "log": str(log_file), "checks": 0,
                               "failed_checks": 0}
    service.start()
    try:
        url = service.wait_ready(startup_timeout_s)
        summary.update(url=url, pid=service.proc.pid if service.proc else None)
        log.info("Tinker service ready on %s in %.0f s (pid %s): "
                 "tinker.ServiceClient(base_url=%r, api_key='tml-...')", url,
                 time.monotonic() - started, summary["pid"], url)
        _report(name, summary, "ready")
        _watch(service, log, summary, health_every_s=health_every_s,
               probe_timeout_s=probe_timeout_s, max_failures=max_failures,
               report_every_s=report_every_s, max_runtime_s=max_runtime_s)
    finally:  # cancelled (SIGTERM), failed, or done: the service never outlives the flow
        summary["stopped"] = how = service.stop(stop_timeout_s)
        summary["uptime_s"] = round(time.monotonic() - started, 1)
        log.info("Tinker service %s after %.0f s", how, summary["uptime_s"])
        if "url" in summary:
            _report(name, summary, "stopped")
    return summary


def _watch(service: ServiceProcess, log: Any, summary: dict[str, Any], *,  # noqa: ANN401
           health_every_s: float, probe_timeout_s: float, max_failures: int,
           report_every_s: float, max_runtime_s: float | None) -> None:
    """Probe until ``max_runtime_s``; raise when the service exits or is unhealthy."""
    began = last_report = time.monotonic()
    failures = 0
    while max_runtime_s is None or time.monotonic() - began < max_runtime_s:
        left = health_every_s if max_runtime_s is None else min(
            health_every_s, max(0.0, max_runtime_s - (time.monotonic() - began)))
        if (rc := service.wait(left)) is not None:
            raise RuntimeError(f"the Tinker service at {service.url} exited with code {rc}; "
                               f"the flow's retries restart it. Its log ({service.log_file}) "
                               f"ends:\n{service.tail()}")
        ok, seen = probe(service.url, probe_timeout_s)
        summary["checks"] += 1
        summary["last_check"] = seen
        if ok:
            if failures:
                log.info("Tinker service healthy again after %d failed probes: %s", failures,
                         seen)
            failures = 0
        else:
            failures += 1
            summary["failed_checks"] += 1
            log.warning("Tinker service health probe %d/%d failed: GET %s%s: %s", failures,
                        max_failures, service.url, HEALTH_PATH, seen)
            if failures >= max_failures:
                raise RuntimeError(
                    f"the Tinker service at {service.url} failed {failures} health probes in "
                    f"a row (max_failures; last: {seen}); stopping it, the flow's retries "
                    f"restart it. Its log ({service.log_file}) ends:\n{service.tail()}")
        if time.monotonic() - last_report >= report_every_s:
            last_report = time.monotonic()
            log.info("Tinker service healthy: %d checks, %d failed; last %s", summary["checks"],
                     summary["failed_checks"], seen)


def _report(name: str, summary: dict[str, Any], what: str) -> None:
    rows = "\n".join(f"| {k} | `{v}` |" for k, v in summary.items())
    create_markdown_artifact(
        markdown=f"# Tinker service {name}: {what}\n\n| | |\n|---|---|\n{rows}\n",
        key=artifact_key("tinker-service", name),
        description=f"the Tinker service of {name}: {what}")
