"""A pool of rollout engines: start, watch, restart, re-sync, update weights.

:class:`EnginePool` owns N SGLang-protocol engine processes (optionally behind the router). A
monitor thread polls ``/health_generate``; an engine that fails ``failure_threshold`` checks
in a row, or exits, is restarted and re-synced before it serves again. :meth:`EnginePool.paused`
is the engines' half of :func:`rl_core.weight_sync.sync_weights` (pause, abort, flush, ...,
continue, always). Never waits unbounded; never puts an engine back into service before it
serves the current weights (docs/reliability.md, "Failure model: the weight sync").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.host import free_port
from rl_core.rollout import launch
from rl_core.rollout.client import RolloutError, SyncSGLangClient
from rl_core.rollout.router import RouterPolicy, RouterProcess
from rl_core.weight_sync import WeightSyncError

__all__ = ["EngineHandle", "EnginePool", "ProcessLauncher"]

log = logging.getLogger(__name__)


class ProcessLauncher:
    """Starts engines as local processes (each in its own session) from ``command``. The
    launcher interface: ``spawn(index, port, log_path) -> (proc, host, port)`` (``proc`` like a
    :class:`subprocess.Popen`: ``poll()``, ``pid``, ``returncode``), ``stop(proc, timeout_s)``,
    ``kill(proc)``; the other launcher is :class:`~rl_core.rollout.ray_engines.RayActorLauncher`."""

    def __init__(self, command: launch.EngineCommand, env: Mapping[str, str] | None = None) -> None:
        self.command = command
        self.env = None if env is None else {**os.environ, **env}

    def spawn(self, index: int, port: int, log_path: Path) -> tuple[Any, str, int]:
        proc = launch.start_process(self.command(index, port), log_path, env=self.env)
        return proc, "127.0.0.1", port

    def stop(self, proc: Any, timeout_s: float) -> None:
        launch.stop_process(proc, timeout_s)

    def kill(self, proc: Any) -> None:
        launch.kill_process(proc)


@dataclass
class EngineHandle:
    """One engine: its address, process and health record."""

    index: int
    port: int
    log_path: Path
    proc: Any = None  # a subprocess.Popen, or what the launcher gives (poll/pid/returncode)
    host: str = "127.0.0.1"
    in_service: bool = False
    failures: int = 0  # consecutive failed health checks
    restarts: int = 0  # restarts so far
    failed_recoveries: int = 0  # consecutive restarts that did not bring it back
    awaiting_weights: bool = False  # restarted, healthy, served at the next weight update

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EnginePool:
    """N engine processes, optionally behind ``sglang-router``, kept healthy and in sync.
    ``resync(url)`` brings a restarted engine to the current weights (``False``: it waits out
    of service, ``awaiting_weights``, for the next update). ``client`` sends generation to the
    router or round-robin over the engines in service; control calls take ``url=``."""

    def __init__(
        self, command: launch.EngineCommand | None, num_engines: int, *, log_dir: str | Path,
        launcher: Any = None, env: Mapping[str, str] | None = None, router: bool = False,
        ports: Sequence[int] | None = None, router_policy: RouterPolicy = "cache_aware",
        router_kwargs: Mapping[str, Any] | None = None, resync: Callable[[str], None] | None = None,
        health_interval_s: float = 5.0, health_timeout_s: float = 20.0, failure_threshold: int = 3,
        max_failed_recoveries: int = 3, startup_timeout_s: float = 300.0, monitor: bool = True,
        stop_timeout_s: float = 10.0, client_kwargs: Mapping[str, Any] | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if ports is not None and len(ports) != num_engines:
            raise ValueError(f"{len(ports)} ports for {num_engines} engines")
        if (command is None) == (launcher is None):
            raise ValueError("EnginePool: pass exactly one of command or launcher=")
        self.launcher = launcher if launcher is not None else ProcessLauncher(command, env)
        self.log_dir = logs = Path(log_dir)
        # Chosen ports are re-chosen on every restart (another process may hold the old one
        # by then); ports the caller pinned are kept.
        self.pinned_ports = bool(ports)
        ports = list(ports) if ports else [free_port() for _ in range(num_engines)]
        self.engines = [EngineHandle(i, p, logs / f"engine-{i}.log") for i, p in enumerate(ports)]
        self.router_kwargs, self.use_router = dict(router_kwargs or {}), router
        self.client_kwargs, self.router_policy = dict(client_kwargs or {}), router_policy
        self.resync, self.max_failed_recoveries = resync, max_failed_recoveries
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.failure_threshold, self.monitor_enabled = failure_threshold, monitor
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.router: RouterProcess | None = None
        self.client: SyncSGLangClient | None = None
        self.weight_version: str | None = None  # None: engines serve their initial weights
        # Memory tags the engines released (colocated planes: the trainer holds the devices).
        # While set, the monitor checks liveness only: a released engine cannot generate.
        self.released: set[str] = set()
        # Held by weight updates and by recoveries: a restarted engine is re-synced to a
        # version no update can overtake, and the monitor never probes a paused engine.
        self._sync_lock, self._stop = threading.Lock(), threading.Event()
        # Checks an engine that joins (add_engine) before it serves: the weight probe.
        self.admit_check: Callable[[str], None] | None = None
        self._monitor: threading.Thread | None = None

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def engine(self, index: int) -> EngineHandle:
        """Engine ``index`` (its own index: engines that left leave gaps)."""
        if (e := next((x for x in self.engines if x.index == index), None)) is None:
            raise ValueError(f"no engine {index} in the pool (engines {[x.index for x in self.engines]})")
        return e

    def in_service_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.in_service]

    def awaiting_urls(self) -> list[str]:
        """Restarted engines that wait for the next weight update to go back into service."""
        return [e.url for e in self.engines if e.awaiting_weights and not e.in_service]

    def update_targets(self) -> list[str]:
        """What the next weight update updates: in service, then awaiting weights."""
        return self.in_service_urls() + self.awaiting_urls()

    @property
    def url(self) -> str | None:
        """The router's URL when there is one."""
        return self.router.url if self.router is not None else None

    def start(self) -> EnginePool:
        """Start every engine, wait (bounded) until all are healthy, then router and monitor."""
        t0 = time.monotonic()
        try:
            for e in self.engines:
                e.proc, e.host, e.port = self.launcher.spawn(e.index, e.port, e.log_path)
            for e in self.engines:
                remaining = max(1.0, self.startup_timeout_s - (time.monotonic() - t0))
                self._wait_healthy(e, remaining)
                e.in_service = True
            if self.use_router:
                self.router = RouterProcess(self.engine_urls, log_dir=self.log_dir,
                                            policy=self.router_policy, **self.router_kwargs).start()
            target = self.router.url if self.router is not None else self.engine_urls
            self.client = SyncSGLangClient(target, **self.client_kwargs)
        except BaseException:
            self.stop()
            raise
        log.info("engine pool: %d engine(s) up in %.1fs%s", len(self.engines),
                 time.monotonic() - t0, f" behind router {self.router.url}" if self.router else "")
        if self.monitor_enabled:
            self._stop.clear()
            self._monitor = threading.Thread(target=self._monitor_loop,
                                             name="engine-pool-monitor", daemon=True)
            self._monitor.start()
        return self

    def stop(self) -> None:
        """Stop the monitor, the router and every engine (each bounded; idempotent)."""
        self._stop.set()
        # Stop engines first: a recovery waiting on a starting engine then fails at once.
        for e in self.engines:
            e.in_service = e.awaiting_weights = False
            if e.proc is not None:
                self.launcher.stop(e.proc, self.stop_timeout_s)
        if self._monitor is not None:
            self._monitor.join(self.health_timeout_s + self.stop_timeout_s + 30.0)
            if self._monitor.is_alive():
                log.error("engine pool: the monitor thread did not stop in time")
            self._monitor = None
        for part in (self.client, self.router):
            if part is not None:
                part.close()
        self.client = self.router = None
        for e in self.engines:  # again: the monitor may have spawned one meanwhile
            if e.proc is not None:
                self.launcher.stop(e.proc, self.stop_timeout_s)
                e.proc = None

    def __enter__(self) -> EnginePool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_engine(self, timeout_s: float | None = None) -> EngineHandle:
        """Start one more engine and put it into service serving the current weights, taken
        from the transport's staged copy (``resync``: disk or the object store, never the
        trainer) and checked by ``admit_check`` (the weight probe). Training goes on
        meanwhile: the pool is held only while it loads the weights (as a restart is). An
        engine the transport cannot bring up to date now waits for the next weight update."""
        limit = self.startup_timeout_s if timeout_s is None else timeout_s
        index = max((e.index for e in self.engines), default=-1) + 1
        e, t0 = EngineHandle(index, free_port(), self.log_dir / f"engine-{index}.log"), time.monotonic()
        e.proc, e.host, e.port = self.launcher.spawn(e.index, e.port, e.log_path)
        try:
            self._wait_healthy(e, limit)
            with self._held(limit, "add_engine"):
                if self._stop.is_set():
                    raise RuntimeError("add_engine: the pool is stopping")
                ready = self._resync(e)
                if ready and self.admit_check is not None and self.weight_version is not None:
                    self.admit_check(e.url)
                self.engines.append(e)
                e.awaiting_weights, e.in_service = not ready, ready
                if ready and self.router is not None:
                    self.router.add_worker(e.url)
                self._publish_members()
        except BaseException:
            self.launcher.stop(e.proc, self.stop_timeout_s)
            raise
        log.warning("engine %d (%s): joined in %.1fs at weight_version %s%s", e.index, e.url,
                    time.monotonic() - t0, self.weight_version or "initial",
                    "" if e.in_service else " (in service after the next weight update)")
        return e

    def remove_engine(self, index: int | None = None, drain_timeout_s: float = 60.0) -> int:
        """Drain engine ``index`` (default: the newest) and stop it: it takes no new work, the
        requests it runs finish (bounded by ``drain_timeout_s``; what is left then fails over:
        the client retries it on another engine), then it leaves the pool. Its index."""
        with self._held(drain_timeout_s + self.health_timeout_s, "remove_engine"):
            if len(self.engines) < 2:
                raise ValueError("remove_engine: the pool's last engine cannot leave")
            e = self.engines[-1] if index is None else self.engine(index)
            if e.in_service:
                self._take_out(e)
            e.awaiting_weights = False
        # Outside the lock: an update may run while the engine's last requests finish.
        self._drain(e, drain_timeout_s)
        with self._held(self.startup_timeout_s, "remove_engine"):
            self.engines.remove(e)
            self._publish_members()
        if e.proc is not None:
            self.launcher.stop(e.proc, self.stop_timeout_s)
        log.warning("engine %d (%s): left the pool (%d engine(s) now)", e.index, e.url,
                    len(self.engines))
        return e.index

    def _drain(self, e: EngineHandle, timeout_s: float) -> None:
        """Wait (bounded) until ``e`` runs and queues no request (what is left when the bound
        passes fails over to the other engines when it stops: the client retries there)."""
        aio, deadline = self._require_client().aio, time.monotonic() + timeout_s
        while e.alive and time.monotonic() < deadline:
            try:
                load = self._require_client().run(aio._control(
                    "GET", "/get_load", url=e.url, retries=0, timeout_s=self.health_timeout_s),
                    timeout_s=self.health_timeout_s + 5.0)
            except (RolloutError, TimeoutError):
                return  # it does not answer: nothing to wait for
            rows = load if isinstance(load, list) else [load]
            if not any(r.get("num_reqs") or r.get("num_waiting_reqs") for r in rows):
                return
            time.sleep(0.1)
        log.warning("engine %d (%s): still busy after %.0fs of draining; stopping it (its "
                    "requests are retried on the other engines)", e.index, e.url, timeout_s)

    @contextlib.contextmanager
    def _held(self, timeout_s: float, what: str) -> Iterator[None]:
        if not self._sync_lock.acquire(timeout=timeout_s):
            raise RuntimeError(f"{what}: a weight update held the pool {timeout_s:.0f}s")
        try:
            yield
        finally:
            self._sync_lock.release()

    def kill(self, index: int) -> None:
        """SIGKILL engine ``index`` (its whole process session): a crash, for tests and drills."""
        if (proc := self.engine(index).proc) is not None:
            self.launcher.kill(proc)

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check_health()
            except Exception:  # the monitor must outlive any one bad pass
                log.exception("engine pool: health pass failed")

    def check_health(self) -> list[int]:
        """One monitor pass; returns the indices of engines restarted in it. Skipped (returns
        ``[]``) while a weight update holds the engines paused."""
        if not self._sync_lock.acquire(blocking=False):
            return []
        try:
            return self._check_health_locked()
        finally:
            self._sync_lock.release()

    def _gather(self, urls: Sequence[str], call: Callable[[str], Awaitable[Any]],
                timeout_s: float, raises: bool = False) -> list[Any]:
        """``call(url)`` for every url at once on the client's loop, bounded by ``timeout_s``;
        an exception is that url's result (``raises``: it propagates)."""
        async def run_all() -> list[Any]:
            calls = (call(u) for u in urls)
            return list(await asyncio.gather(*calls, return_exceptions=not raises))

        return self._require_client().run(run_all(), timeout_s=timeout_s)

    def _check_health_locked(self) -> list[int]:
        aio = self._require_client().aio
        probe = [e for e in self.engines if e.in_service and e.alive and not self.released]
        bound = self.health_timeout_s
        ok = self._gather([e.url for e in probe], lambda u: aio.health_generate(
            url=u, timeout_s=bound), bound + 5.0, raises=True) if probe else []
        for e, good in zip(probe, ok, strict=True):
            e.failures = 0 if good else e.failures + 1
            if not good:
                log.warning("engine %d (%s): health check failed (%d/%d)", e.index, e.url,
                            e.failures, self.failure_threshold)
        restarted = []
        for e in self.engines:
            if self._stop.is_set():
                break
            dead, idle = not e.alive, not (e.in_service or e.awaiting_weights)
            if dead and e.in_service:
                log.warning("engine %d (%s): process exited with code %s", e.index, e.url,
                            None if e.proc is None else e.proc.returncode)
            if dead or e.failures >= self.failure_threshold or idle:
                if e.failed_recoveries >= self.max_failed_recoveries:
                    if e.in_service:
                        self._take_out(e)
                    continue  # given up on (logged once); restart(index) tries again
                if self._recover(e):
                    restarted.append(e.index)
        return restarted

    def restart(self, index: int, timeout_s: float = 600.0) -> None:
        """Restart and re-sync engine ``index`` now, whatever its health (also after the
        monitor gave up on it); raises ``RuntimeError`` if it does not come back."""
        with self._held(timeout_s, f"restart({index})"):
            e = self.engine(index)
            e.failed_recoveries = 0
            if not self._recover(e):
                raise RuntimeError(f"engine {index} ({e.url}) did not come back; see {e.log_path}")

    def _wait_healthy(self, e: EngineHandle, timeout_s: float, retries: int = 2) -> None:
        """Wait (bounded) until ``e`` answers its health check. Its port was free when chosen
        but another process may take it before the engine binds: then the engine is started
        again on a new port, at most ``retries`` times."""
        for attempt in range(retries + 1):
            try:
                launch.wait_healthy(e.url, timeout_s=timeout_s, proc=e.proc, log_path=e.log_path)
                return
            except RuntimeError as err:
                if "address already in use" not in str(err) or attempt == retries:
                    raise
                taken = e.port
                self.launcher.stop(e.proc, self.stop_timeout_s)
                e.proc, e.host, e.port = self.launcher.spawn(e.index, free_port(), e.log_path)
                log.warning("engine %d: port %d was taken before it could bind; started it "
                            "again on port %d", e.index, taken, e.port)

    def _take_out(self, e: EngineHandle) -> None:
        e.in_service = False
        if self.router is not None:
            try:
                self.router.remove_worker(e.url)
            except Exception as err:
                log.warning("router: could not remove %s: %s", e.url, err)
        self._publish_members()

    def _publish_members(self) -> None:
        if self.client is not None and self.router is None:
            # With none in service keep every URL: requests retry until one comes back.
            self.client.set_base_urls(self.in_service_urls() or self.engine_urls)

    def _recover(self, e: EngineHandle) -> bool:
        """Restart ``e``, re-sync it, put it back; False (and out of service) on failure."""
        t0 = time.monotonic()
        if e.in_service:
            self._take_out(e)
        e.awaiting_weights, e.restarts = False, e.restarts + 1
        log.warning("engine %d (%s): restarting (restart %d)", e.index, e.url, e.restarts)
        try:
            if e.proc is not None:
                self.launcher.stop(e.proc, self.stop_timeout_s)
            if self._stop.is_set():
                return False
            port = e.port if self.pinned_ports else free_port()
            e.proc, e.host, e.port = self.launcher.spawn(e.index, port, e.log_path)
            self._wait_healthy(e, self.startup_timeout_s)
            # Not back in service before it serves the current weights.
            if not self._resync(e):
                e.failures, e.failed_recoveries, e.awaiting_weights = 0, 0, True
                log.warning("engine %d (%s): restarted in %.1fs; out of service until a weight "
                            "update brings it up to date", e.index, e.url, time.monotonic() - t0)
                return True
            if self.router is not None:
                self.router.add_worker(e.url)
        except Exception as err:
            e.failed_recoveries += 1
            gave_up = e.failed_recoveries >= self.max_failed_recoveries
            log.error("engine %d (%s): recovery failed (%d/%d)%s: %s", e.index, e.url,
                      e.failed_recoveries, self.max_failed_recoveries,
                      "; left out of service until restart() is called" if gave_up else "", err)
            if e.proc is not None:  # never leave a half-synced engine answering
                self.launcher.stop(e.proc, self.stop_timeout_s)
            self._publish_members()  # its new address, for when none is in service
            return False
        e.failures, e.failed_recoveries, e.in_service = 0, 0, True
        self._publish_members()
        log.warning("engine %d (%s): back in service after %.1fs at weight_version %s", e.index,
                    e.url, time.monotonic() - t0, self.weight_version or "initial")
        return True

    def _resync(self, e: EngineHandle) -> bool:
        """Bring ``e`` to the current weights; False: deferred to the next weight update."""
        client = self._require_client()
        if self.weight_version is None:
            return True  # a fresh engine serves the initial weights
        if self.resync is None:
            raise WeightSyncError(
                f"engine {e.index} ({e.url}) restarted but the pool cannot re-sync it to "
                f"weight_version {self.weight_version}: pass EnginePool(resync=...)")
        if self.resync(e.url) is False:
            return False
        if (served := client.weight_version(url=e.url)) != self.weight_version:
            raise WeightSyncError(f"engine {e.index} ({e.url}) serves weight_version {served} "
                                  f"after resync, expected {self.weight_version}")
        return True

    @contextlib.contextmanager
    def paused(self, *, timeout_s: float = 600.0, flush_wait_s: float = 60.0,
               mode: str = "abort") -> Iterator[list[str]]:
        """Hold the pool for a weight update: pause (``mode``: abort, retract or hold what is in
        flight), flush (``abort`` only: held requests make a flush fail), yield the URLs,
        resume on exit, always. Awaiting engines go back into service after a success;
        on a failure, engines that stopped answering are taken out of service."""
        self._require_client()
        if not self._sync_lock.acquire(timeout=timeout_s):
            raise WeightSyncError(f"weight update: an engine recovery held the pool {timeout_s}s")
        failed: BaseException | None = None
        try:
            if not (urls := self.update_targets()):
                raise WeightSyncError("weight update: no engine in service")
            # Control calls answer at once on a live engine (nothing runs after the abort):
            # a silent one is found within health_timeout_s, not the whole update's bound.
            bound = min(timeout_s, self.health_timeout_s + 5.0)
            try:
                self.each(urls, "pause_generation", lambda aio, u: aio.pause(mode, url=u),
                          timeout_s=bound)
                if mode == "abort":  # SGLang refuses a flush while requests are held
                    self.each(urls, "flush_cache", lambda aio, u: aio.flush_cache(
                        url=u, wait_s=min(flush_wait_s, bound)), timeout_s=bound)
                yield urls
            except BaseException as e:
                failed = e
                # A crashed or hung engine fails every retry of this update, and the monitor
                # cannot replace it while the update holds the lock: take it out now.
                if isinstance(e, WeightSyncError | TimeoutError | RolloutError):
                    urls = self._take_out_unresponsive(urls)
                raise
            finally:  # resume; a failure raises unless the update already failed (then: logged)
                try:
                    self.each(urls, "continue_generation", lambda aio, u: aio.resume(url=u),
                              timeout_s=self.health_timeout_s + 5.0)
                except WeightSyncError as e:
                    if failed is None:
                        raise
                    log.error("%s (after: %s)", e, failed)
            self._admit_awaiting(urls)
        finally:
            self._sync_lock.release()

    def each(self, urls: list[str], what: str, call: Callable[[Any, str], Any],
             timeout_s: float | None = None) -> None:
        """``call(client.aio, url)`` on every engine of ``urls`` at once (bounded); raises
        :class:`WeightSyncError` naming every engine that failed."""
        aio, limit = self._require_client().aio, timeout_s or self.health_timeout_s + 120.0
        try:
            results = self._gather(urls, lambda u: call(aio, u), limit)
        except TimeoutError as e:
            raise WeightSyncError(f"{what} on {urls} did not finish within {limit:.0f}s") from e
        if errors := _errors(urls, results):
            raise WeightSyncError(f"{what} failed on " + "; ".join(errors))

    def _take_out_unresponsive(self, urls: list[str]) -> list[str]:
        """Take out of service the engines of ``urls`` not answering ``/health`` within
        ``health_timeout_s`` (liveness: a paused engine answers it); returns those that did."""
        aio = self._require_client().aio

        async def alive(url: str) -> bool:
            try:
                await aio._control("GET", "/health", url=url, retries=0,
                                   timeout_s=self.health_timeout_s)
            except RolloutError:
                return False
            return True

        try:
            answered = self._gather(urls, alive, self.health_timeout_s + 5.0, raises=True)
        except TimeoutError:
            answered = [False] * len(urls)
        for e in self.engines:
            if e.in_service and e.url in urls and not answered[urls.index(e.url)]:
                log.warning("engine %d (%s): no answer during a weight update; out of service "
                            "until the monitor restarts it", e.index, e.url)
                e.failures = self.failure_threshold
                self._take_out(e)
        return [u for u, ok in zip(urls, answered, strict=True) if ok]

    def _admit_awaiting(self, updated: list[str]) -> None:
        """Engines that waited for this update serve its weights now: back into service."""
        for e in self.engines:
            if e.awaiting_weights and e.url in updated:
                if self.router is not None:
                    self.router.add_worker(e.url)
                e.awaiting_weights, e.in_service = False, True
                log.warning("engine %d (%s): back in service at weight_version %s",
                            e.index, e.url, self.weight_version)
        self._publish_members()

    def release_memory(self, tags: Sequence[str] | None = None, timeout_s: float = 120.0) -> None:
        """``/release_memory_occupation`` of ``tags`` (None: weights and KV cache) on the engines
        in service, so that a colocated trainer gets the devices."""
        self._memory("release", tags, timeout_s)

    def resume_memory(self, tags: Sequence[str] | None = None, timeout_s: float = 120.0) -> None:
        """``/resume_memory_occupation``: undo :meth:`release_memory` for ``tags``."""
        self._memory("resume", tags, timeout_s)

    def _memory(self, what: str, tags: Sequence[str] | None, timeout_s: float) -> None:
        aio = self._require_client().aio
        wanted = set(tags) if tags else {"weights", "kv_cache"}
        if not self._sync_lock.acquire(timeout=timeout_s):
            raise WeightSyncError(f"{what}_memory: the pool was busy for {timeout_s}s")
        try:
            urls = self.in_service_urls()
            call = aio.release_memory if what == "release" else aio.resume_memory
            results = self._gather(urls, lambda u: call(sorted(wanted), url=u), timeout_s)
            self.released = self.released | wanted if what == "release" else self.released - wanted
            if errors := _errors(urls, results):
                raise RolloutError(f"{what}_memory {sorted(wanted)} failed on " + "; ".join(errors))
        finally:
            self._sync_lock.release()

    def _require_client(self) -> SyncSGLangClient:
        if self.client is None:
            raise RuntimeError("EnginePool is not started (call start() or use it as a context)")
        return self.client


def _errors(urls: Sequence[str], results: Sequence[Any]) -> list[str]:
    return [f"{u}: {r}" for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
