"""The real ``sglang-router`` as a managed subprocess, and its worker API.

:class:`RouterProcess` runs ``python -m sglang_router.launch_router`` on 127.0.0.1, waits
(bounded) until it answers, and adds and removes workers (``/workers``, or the legacy
``/add_worker``), waiting until ``GET /workers`` shows each change, since registration is
asynchronous (docs/rollout.md, "Client, router, pool"). Never binds anything but 127.0.0.1
(the Prometheus exporter included); never leaves the router running after ``stop()``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import httpx

from rl_core.host import free_port
from rl_core.rollout.launch import log_tail, start_process, stop_process

__all__ = ["RouterError", "RouterProcess", "RouterPolicy"]

log = logging.getLogger(__name__)

# ``manual``: sticky by the request's routing-key header (rl_core.rollout.affinity).
RouterPolicy = Literal["round_robin", "cache_aware", "power_of_two", "random", "manual"]
_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random", "manual")


class RouterError(RuntimeError):
    """The router did not start, or did not take a worker change in time."""


class RouterProcess:
    """One ``sglang-router`` process bound to 127.0.0.1. Its own worker probes
    (``health_check_*``) and ``retries`` are a second line behind the pool's monitor, which
    removes dead engines explicitly, and the client's retries."""

    def __init__(
        self, worker_urls: Sequence[str] = (), *, log_dir: str | Path, port: int | None = None,
        policy: RouterPolicy = "cache_aware", request_timeout_s: float = 1800.0,
        health_check_interval_s: float = 10.0, health_check_timeout_s: float = 5.0,
        health_failure_threshold: int = 3, retries: int = 3, startup_timeout_s: float = 60.0,
        api_timeout_s: float = 10.0, extra_args: Sequence[str] = (), python: str = sys.executable,
    ) -> None:
        if policy not in _POLICIES:
            raise ValueError(f"router policy={policy!r}; allowed values: {list(_POLICIES)}")
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.policy, self.python = policy, python
        self.initial_workers = [u.rstrip("/") for u in worker_urls]
        self.log_path = Path(log_dir) / f"router-{self.port}.log"
        self.request_timeout_s, self.retries = request_timeout_s, retries
        self.health_check_interval_s = health_check_interval_s
        self.health_check_timeout_s = health_check_timeout_s
        self.health_failure_threshold = health_failure_threshold
        self.startup_timeout_s, self.api_timeout_s = startup_timeout_s, api_timeout_s
        self.extra_args = [str(a) for a in extra_args]
        self.proc: subprocess.Popen | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(api_timeout_s, connect=2.0))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The router's command line (flags as ``sglang-router`` 0.3.2 spells them)."""
        cmd = [
            self.python, "-m", "sglang_router.launch_router",
            "--host", self.host, "--port", str(self.port), "--policy", self.policy,
            "--request-timeout-secs", str(int(self.request_timeout_s)),
            "--health-check-interval-secs", str(max(1, int(self.health_check_interval_s))),
            "--health-check-timeout-secs", str(max(1, int(self.health_check_timeout_s))),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--health-check-endpoint", "/health",
            "--worker-startup-timeout-secs", str(max(1, int(self.startup_timeout_s))),
            "--worker-startup-check-interval", "1",
            "--retry-max-retries", str(max(1, self.retries + 1)),
            "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "2000",
            # A dead engine is the pool's business; the breaker would hide a restarted one.
            "--disable-circuit-breaker",
            "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
            "--log-level", "info",
        ]
        if self.initial_workers:
            cmd += ["--worker-urls", *self.initial_workers]
        return cmd + self.extra_args

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RouterProcess:
        """Start the router and wait until it answers and lists its initial workers."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        t0 = time.monotonic()
        self.proc = start_process(self.command(), self.log_path)
        try:
            self._wait_alive(t0 + self.startup_timeout_s)
            for url in self.initial_workers:
                self._wait_listed(url, present=True, deadline=t0 + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("router %s (%s) up after %.1fs with %d worker(s); log %s", self.url, self.policy,
                 time.monotonic() - t0, len(self.initial_workers), self.log_path)
        return self

    def _wait_alive(self, deadline: float) -> None:
        last = "no answer yet"
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RouterError(f"router exited with code {self.proc.returncode} during "
                                  f"startup; log {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                resp = self._http.get(self.url + "/liveness", timeout=2.0)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            if time.monotonic() >= deadline:
                raise RouterError(f"router {self.url} did not answer /liveness within "
                                  f"{self.startup_timeout_s:.0f}s (last: {last}); log "
                                  f"{self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the router; kill it after ``timeout_s`` (idempotent)."""
        if self.proc is not None:
            code = stop_process(self.proc, timeout_s)
            log.info("router %s stopped (exit code %s)", self.url, code)
            self.proc = None

    def close(self) -> None:
        self.stop()
        self._http.close()

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ worker API

    def workers(self) -> list[dict[str, Any]]:
        """The router's worker records (``GET /workers``; legacy ``/list_workers``)."""
        resp = self._http.get(self.url + "/workers")
        if resp.status_code in (404, 405):
            resp = self._http.get(self.url + "/list_workers")
            resp.raise_for_status()
            return [{"url": u} for u in resp.json().get("urls", [])]
        resp.raise_for_status()
        return list(resp.json().get("workers", []))

    def list_workers(self) -> list[str]:
        """URLs of the registered workers."""
        return [str(w["url"]).rstrip("/") for w in self.workers()]

    def add_worker(self, url: str, *, timeout_s: float | None = None) -> None:
        """Register ``url`` (an engine that already passes ``/health_generate``) and wait
        until the router lists it."""
        url = url.rstrip("/")
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        if url in self.list_workers():
            return
        resp = self._http.post(self.url + "/workers", json={"url": url})
        if resp.status_code in (404, 405):
            resp = self._http.post(self.url + "/add_worker", params={"url": url})
        self._check(resp, f"adding {url}")
        self._wait_listed(url, present=True, deadline=deadline)
        log.info("router %s: added worker %s", self.url, url)

    def remove_worker(self, url: str, *, timeout_s: float | None = None) -> None:
        """Deregister ``url`` and wait until the router no longer lists it."""
        url = url.rstrip("/")
        deadline = time.monotonic() + (timeout_s or self.api_timeout_s)
        records = [w for w in self.workers() if str(w.get("url", "")).rstrip("/") == url]
        if not records:
            return
        worker_id = records[0].get("id")
        resp = (self._http.delete(f"{self.url}/workers/{quote(str(worker_id), safe='')}")
                if worker_id else httpx.Response(404))
        if resp.status_code in (404, 405):
            resp = self._http.post(self.url + "/remove_worker", params={"url": url})
        self._check(resp, f"removing {url}")
        self._wait_listed(url, present=False, deadline=deadline)
        log.info("router %s: removed worker %s", self.url, url)

    def _check(self, resp: httpx.Response, what: str) -> None:
        if resp.status_code >= 400:
            raise RouterError(f"router {self.url}: {what}: HTTP {resp.status_code}: "
                              f"{resp.text[:300]}")

    def _wait_listed(self, url: str, *, present: bool, deadline: float) -> None:
        t0 = time.monotonic()
        while True:
            try:
                records = {str(w["url"]).rstrip("/"): w for w in self.workers()}
            except httpx.HTTPError as e:
                records, err = {}, e
            else:
                err = None
                listed = url in records and records[url].get("is_healthy", True)
                if listed if present else url not in records:
                    log.debug("router %s: waited %.2fs for %s to be %s", self.url,
                              time.monotonic() - t0, url, "listed" if present else "gone")
                    return
            if time.monotonic() >= deadline:
                state = "listed and healthy" if present else "removed"
                raise RouterError(
                    f"router {self.url}: {url} not {state} after {time.monotonic() - t0:.1f}s"
                    f"{f' ({err})' if err else ''}; router log {self.log_path}:\n"
                    f"{log_tail(self.log_path, 10)}")
            time.sleep(0.1)
