"""A pool of rollout engines: start, watch, restart, re-sync, update weights.

:class:`EnginePool` owns N engine processes (any server speaking SGLang's protocol: real
SGLang on GPUs, the embedded engine on CPU), started from a command factory
``command(index, port) -> argv``, optionally behind a :class:`~rl_core.rollout.router.
RouterProcess`. A monitor thread polls every engine's ``/health_generate`` every
``health_interval_s``; an engine that fails ``failure_threshold`` consecutive checks (or
whose process exited) is taken out of service, restarted, re-synced to the current weights
and only then put back (into the router, or into the client's round-robin set).

``weight_update`` runs the sequence slime, miles and AReaL use on every engine: pause →
flush cache → update (from disk here; a caller callback for the distributed path) →
continue, then checks that every engine reports the new ``weight_version``.

Never imports Prefect or MLflow; never waits without a bound; never puts an engine back
into service before it serves the current weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.rollout.client import RolloutError, SyncSGLangClient
from rl_core.rollout.router import RouterPolicy, RouterProcess
from rl_core.rollout.sglang_launcher import (
    free_port,
    kill_process,
    start_process,
    stop_process,
    wait_healthy,
)
from rl_core.weight_sync import WeightSyncError

__all__ = ["EngineCommand", "EngineHandle", "EnginePool", "ProcessLauncher"]

log = logging.getLogger(__name__)

EngineCommand = Callable[[int, int], Sequence[str]]
"""``command(index, port)``: the argv that serves engine ``index`` on 127.0.0.1:``port``."""


class ProcessLauncher:
    """Starts engines as local processes (each in its own session) from ``command``.

    A launcher is what the pool needs to own an engine: ``spawn(index, port, log_path) ->
    (proc, host, port)`` where ``proc`` answers ``poll()``, ``pid`` and ``returncode`` like a
    :class:`subprocess.Popen`; ``stop(proc, timeout_s)``; ``kill(proc)``.
    :class:`~rl_core.rollout.ray_engines.RayActorLauncher` is the other one (Ray actors).
    """

    def __init__(self, command: EngineCommand, env: Mapping[str, str] | None = None) -> None:
        self.command = command
        self.env = None if env is None else {**os.environ, **env}

    def spawn(self, index: int, port: int, log_path: Path) -> tuple[Any, str, int]:
        return start_process(self.command(index, port), log_path, env=self.env), "127.0.0.1", port

    def stop(self, proc: Any, timeout_s: float) -> None:
        stop_process(proc, timeout_s)

    def kill(self, proc: Any) -> None:
        kill_process(proc)


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

    ``resync(url)`` brings a restarted engine to the current weights; without it the pool
    re-applies its last ``weight_update(model_path=...)`` from disk. A ``resync`` that
    returns ``False`` defers: the engine stays out of service, ``awaiting_weights``, until
    the next :meth:`weight_update` includes it (the distributed path, whose broadcast needs
    the trainer). ``client`` is a
    :class:`SyncSGLangClient` whose generation requests go to the router (``router=True``)
    or round-robin over the engines in service; control calls take ``url=``.
    """

    def __init__(
        self,
        command: EngineCommand | None,
        num_engines: int,
        *,
        log_dir: str | Path,
        launcher: Any = None,
        env: Mapping[str, str] | None = None,
        ports: Sequence[int] | None = None,
        router: bool = False,
        router_policy: RouterPolicy = "cache_aware",
        router_kwargs: Mapping[str, Any] | None = None,
        resync: Callable[[str], None] | None = None,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 20.0,
        failure_threshold: int = 3,
        max_failed_recoveries: int = 3,
        startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 10.0,
        monitor: bool = True,
        client_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if ports is not None and len(ports) != num_engines:
            raise ValueError(f"{len(ports)} ports for {num_engines} engines")
        if (command is None) == (launcher is None):
            raise ValueError("EnginePool: pass exactly one of command or launcher=")
        self.launcher = launcher if launcher is not None else ProcessLauncher(command, env)
        self.log_dir = Path(log_dir)
        ports = list(ports) if ports is not None else [free_port() for _ in range(num_engines)]
        self.engines = [
            EngineHandle(i, p, self.log_dir / f"engine-{i}.log") for i, p in enumerate(ports)
        ]
        self.use_router = router
        self.router_policy = router_policy
        self.router_kwargs = dict(router_kwargs or {})
        self.resync = resync
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.failure_threshold = failure_threshold
        self.max_failed_recoveries = max_failed_recoveries
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.monitor_enabled = monitor
        self.client_kwargs = dict(client_kwargs or {})
        self.router: RouterProcess | None = None
        self.client: SyncSGLangClient | None = None
        self.weight_version: str | None = None  # None: engines serve their initial weights
        self._disk_source: str | None = None  # last model_path given to weight_update
        # Memory tags the engines released (colocated planes: the trainer holds the devices).
        # While set, the monitor checks liveness only: a released engine cannot generate.
        self.released: set[str] = set()
        # Held by weight updates and by recoveries: a restarted engine is re-synced to a
        # version no update can overtake, and the monitor never probes a paused engine.
        self._sync_lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def in_service_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.in_service]

    def awaiting_urls(self) -> list[str]:
        """Restarted engines that wait for the next weight update to go back into service."""
        return [e.url for e in self.engines if e.awaiting_weights and not e.in_service]

    def update_targets(self) -> list[str]:
        """What the next :meth:`weight_update` updates: in service, then awaiting weights."""
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
                self._spawn(e)
            for e in self.engines:
                remaining = max(1.0, self.startup_timeout_s - (time.monotonic() - t0))
                wait_healthy(e.url, timeout_s=remaining, proc=e.proc, log_path=e.log_path)
                e.in_service = True
            if self.use_router:
                self.router = RouterProcess(
                    self.engine_urls,
                    log_dir=self.log_dir,
                    policy=self.router_policy,
                    **self.router_kwargs,
                ).start()
            target = self.router.url if self.router is not None else self.engine_urls
            self.client = SyncSGLangClient(target, **self.client_kwargs)
        except BaseException:
            self.stop()
            raise
        log.info(
            "engine pool: %d engine(s) up in %.1fs%s",
            len(self.engines),
            time.monotonic() - t0,
            f" behind router {self.router.url}" if self.router else "",
        )
        if self.monitor_enabled:
            self._stop.clear()
            self._monitor = threading.Thread(
                target=self._monitor_loop, name="engine-pool-monitor", daemon=True
            )
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
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.router is not None:
            self.router.close()
            self.router = None
        for e in self.engines:  # again: the monitor may have spawned one meanwhile
            if e.proc is not None:
                self.launcher.stop(e.proc, self.stop_timeout_s)
                e.proc = None

    def __enter__(self) -> EnginePool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, e: EngineHandle) -> None:
        e.proc, e.host, e.port = self.launcher.spawn(e.index, e.port, e.log_path)

    def kill(self, index: int) -> None:
        """SIGKILL engine ``index`` (its whole process session): a crash, for tests and drills."""
        e = self.engines[index]
        if e.proc is not None:
            self.launcher.kill(e.proc)

    # ------------------------------------------------------------------ health

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check_health()
            except Exception:  # the monitor must outlive any one bad pass
                log.exception("engine pool: health pass failed")

    def check_health(self) -> list[int]:
        """One monitor pass; returns the indices of engines restarted in it.

        Skipped (returns ``[]``) while a weight update holds the engines paused.
        """
        if not self._sync_lock.acquire(blocking=False):
            return []
        try:
            return self._check_health_locked()
        finally:
            self._sync_lock.release()

    def _check_health_locked(self) -> list[int]:
        client = self._require_client()
        probe = [e for e in self.engines if e.in_service and e.alive and not self.released]

        async def probe_all() -> list[bool]:
            return list(
                await asyncio.gather(
                    *(
                        client.aio.health_generate(url=e.url, timeout_s=self.health_timeout_s)
                        for e in probe
                    )
                )
            )

        ok = client.run(probe_all(), timeout_s=self.health_timeout_s + 5.0) if probe else []
        for e, good in zip(probe, ok, strict=True):
            if good:
                e.failures = 0
            else:
                e.failures += 1
                log.warning(
                    "engine %d (%s): health check failed (%d/%d)",
                    e.index,
                    e.url,
                    e.failures,
                    self.failure_threshold,
                )
        restarted = []
        for e in self.engines:
            if self._stop.is_set():
                break
            dead = e.proc is None or not e.alive
            if dead and e.in_service:
                log.warning(
                    "engine %d (%s): process exited with code %s",
                    e.index,
                    e.url,
                    None if e.proc is None else e.proc.returncode,
                )
            idle = not e.in_service and not e.awaiting_weights
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
        if not self._sync_lock.acquire(timeout=timeout_s):
            raise RuntimeError(f"restart({index}): a weight update held the pool {timeout_s}s")
        try:
            e = self.engines[index]
            e.failed_recoveries = 0
            if not self._recover(e):
                raise RuntimeError(f"engine {index} ({e.url}) did not come back; see {e.log_path}")
        finally:
            self._sync_lock.release()

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
        e.awaiting_weights = False
        e.restarts += 1
        log.warning("engine %d (%s): restarting (restart %d)", e.index, e.url, e.restarts)
        try:
            if e.proc is not None:
                self.launcher.stop(e.proc, self.stop_timeout_s)
            if self._stop.is_set():
                return False
            self._spawn(e)
            wait_healthy(e.url, timeout_s=self.startup_timeout_s, proc=e.proc, log_path=e.log_path)
            # Not back in service before it serves the current weights.
            if not self._resync(e):
                e.failures = e.failed_recoveries = 0
                e.awaiting_weights = True
                log.warning(
                    "engine %d (%s): restarted in %.1fs; out of service until the next weight "
                    "update brings it to the current weights",
                    e.index, e.url, time.monotonic() - t0,
                )  # fmt: skip
                return True
            if self.router is not None:
                self.router.add_worker(e.url)
        except Exception as err:
            e.failed_recoveries += 1
            gave_up = e.failed_recoveries >= self.max_failed_recoveries
            log.error(
                "engine %d (%s): recovery failed (%d/%d)%s: %s", e.index, e.url,
                e.failed_recoveries, self.max_failed_recoveries,
                "; left out of service until restart() is called" if gave_up else "", err,
            )  # fmt: skip
            if e.proc is not None:  # never leave a half-synced engine answering
                self.launcher.stop(e.proc, self.stop_timeout_s)
            return False
        e.failures = 0
        e.failed_recoveries = 0
        e.in_service = True
        self._publish_members()
        log.warning(
            "engine %d (%s): back in service after %.1fs at weight_version %s",
            e.index,
            e.url,
            time.monotonic() - t0,
            self.weight_version or "initial",
        )
        return True

    def _resync(self, e: EngineHandle) -> bool:
        """Bring ``e`` to the current weights; False: deferred to the next weight update."""
        client = self._require_client()
        if self.resync is not None:
            if self.resync(e.url) is False:
                return False
        elif self._disk_source is not None:
            client.update_weights_from_disk(self._disk_source, self.weight_version, url=e.url)
        elif self.weight_version is not None:
            raise WeightSyncError(
                f"engine {e.index} ({e.url}) restarted but the pool cannot re-sync it to "
                f"weight_version {self.weight_version}: pass EnginePool(resync=...)"
            )
        if self.weight_version is not None:
            served = client.weight_version(url=e.url)
            if served != self.weight_version:
                raise WeightSyncError(
                    f"engine {e.index} ({e.url}) serves weight_version {served} after resync, "
                    f"expected {self.weight_version}"
                )
        return True

    # ------------------------------------------------------------------ weights

    def weight_update(
        self,
        version: int | str,
        *,
        model_path: str | Path | None = None,
        update: Callable[[list[str], str], None] | None = None,
        pause_mode: str = "abort",
        flush_wait_s: float = 60.0,
        timeout_s: float = 600.0,
    ) -> None:
        """Move every engine in service to ``version``: pause → flush → update → continue.

        Give ``model_path`` (a safetensors checkpoint: ``/update_weights_from_disk``) or
        ``update(urls, version)`` (e.g. the distributed broadcast, run while the engines are
        paused). ``pause_mode="abort"`` (default) aborts in-flight requests (they return
        partial samples with ``finish_reason.type == "abort"``) and flushes the cache before
        the update; ``retract`` / ``in_place`` keep them and skip the separate flush.
        Engines are always resumed, even when the update fails. Raises
        :class:`WeightSyncError` unless every engine reports ``version`` afterwards.
        """
        if (model_path is None) == (update is None):
            raise ValueError("weight_update: pass exactly one of model_path= or update=")
        client = self._require_client()
        version = str(version)
        t0 = time.monotonic()
        if not self._sync_lock.acquire(timeout=timeout_s):
            raise WeightSyncError(
                f"weight_update to {version}: an engine recovery held the pool for {timeout_s}s"
            )
        try:
            urls = self.update_targets()
            if not urls:
                raise WeightSyncError(f"weight_update to {version}: no engine in service")
            try:
                client.run(
                    self._update_all(urls, version, model_path, update, pause_mode, flush_wait_s),
                    timeout_s=timeout_s,
                )
            except (WeightSyncError, TimeoutError) as e:
                # A crashed or hung engine fails every retry of this update, and the monitor
                # cannot replace it while the update holds the lock: take it out now, so the
                # retry updates the others and the monitor restarts and re-syncs it.
                answering = self._take_out_unresponsive(urls)
                if isinstance(e, TimeoutError):  # cut off mid-way: never leave one paused
                    self._resume_quietly(answering)
                    raise WeightSyncError(
                        f"weight_update to {version} did not finish within {timeout_s}s"
                    ) from e
                raise
            self.weight_version = version
            self._disk_source = str(model_path) if model_path is not None else None
            self._admit_awaiting(urls)
        finally:
            self._sync_lock.release()
        log.debug(
            "weight_update: %d engine(s) at weight_version %s in %.2fs",
            len(urls),
            version,
            time.monotonic() - t0,
        )

    def _take_out_unresponsive(self, urls: list[str]) -> list[str]:
        """Take out of service the engines among ``urls`` that do not answer ``/health``
        within ``health_timeout_s`` (liveness only: a paused engine still answers it);
        returns those that answered."""
        client = self._require_client()

        async def alive(url: str) -> bool:
            try:
                await client.aio._control(
                    "GET", "/health", url=url, retries=0, timeout_s=self.health_timeout_s
                )
            except RolloutError:
                return False
            return True

        async def probe_all() -> list[bool]:
            return list(await asyncio.gather(*(alive(u) for u in urls)))

        try:
            answered = client.run(probe_all(), timeout_s=self.health_timeout_s + 5.0)
        except TimeoutError:
            answered = [False] * len(urls)
        for e in self.engines:
            if e.in_service and e.url in urls and not answered[urls.index(e.url)]:
                log.warning("engine %d (%s): no answer during a weight update; out of service "
                            "until the monitor restarts it", e.index, e.url)  # fmt: skip
                e.failures = self.failure_threshold
                self._take_out(e)
        return [u for u, ok in zip(urls, answered, strict=True) if ok]

    def _resume_quietly(self, urls: list[str]) -> None:
        """``/continue_generation`` on ``urls``, bounded; failures are logged, not raised."""
        client = self._require_client()

        async def resume_all() -> list[Any]:
            return await asyncio.gather(
                *(client.aio.resume(url=u) for u in urls), return_exceptions=True
            )

        try:
            results = client.run(resume_all(), timeout_s=self.health_timeout_s + 5.0)
        except TimeoutError:
            results = [TimeoutError("resume")] * len(urls)
        for u, r in zip(urls, results, strict=True):
            if isinstance(r, BaseException):
                log.error("engine %s: continue_generation after a failed update: %s", u, r)

    def _admit_awaiting(self, updated: list[str]) -> None:
        """Engines that waited for this update serve its weights now: back into service."""
        for e in self.engines:
            if e.awaiting_weights and e.url in updated:
                if self.router is not None:
                    self.router.add_worker(e.url)
                e.awaiting_weights = False
                e.in_service = True
                log.warning(
                    "engine %d (%s): back in service at weight_version %s",
                    e.index, e.url, self.weight_version,
                )  # fmt: skip
        self._publish_members()

    async def _update_all(
        self,
        urls: list[str],
        version: str,
        model_path: str | Path | None,
        update: Callable[[list[str], str], None] | None,
        pause_mode: str,
        flush_wait_s: float,
    ) -> None:
        aio = self._require_client().aio

        async def each(step: str, make: Callable[[str], Any]) -> None:
            results = await asyncio.gather(*(make(u) for u in urls), return_exceptions=True)
            errors = [
                f"{u}: {r}"
                for u, r in zip(urls, results, strict=True)
                if isinstance(r, BaseException)
            ]
            if errors:
                raise WeightSyncError(
                    f"weight_update to {version}: {step} failed on " + "; ".join(errors)
                )

        failure: BaseException | None = None
        try:
            await each("pause_generation", lambda u: aio.pause(pause_mode, url=u))
            if pause_mode == "abort":
                # Idle engines: flush now. With retract / in_place the paused requests still
                # wait, so an explicit flush would be refused; the update flushes instead.
                await each("flush_cache", lambda u: aio.flush_cache(url=u, wait_s=flush_wait_s))
            if model_path is not None:
                await each(
                    "update_weights_from_disk",
                    lambda u: aio.update_weights_from_disk(
                        str(model_path), version, url=u, flush_cache=True
                    ),
                )
            else:
                assert update is not None
                try:
                    await asyncio.to_thread(update, list(urls), version)
                except (RolloutError, OSError) as e:
                    raise WeightSyncError(f"weight_update to {version}: update failed: {e}") from e
        except BaseException as e:
            failure = e
            raise
        finally:
            # Never leave an engine paused, whatever failed above.
            try:
                await each("continue_generation", lambda u: aio.resume(url=u))
            except WeightSyncError as e:
                if failure is None:
                    raise
                log.error("%s (after: %s)", e, failure)
        served = await asyncio.gather(
            *(aio.weight_version(url=u) for u in urls), return_exceptions=True
        )
        wrong = [f"{u} reports {v}" for u, v in zip(urls, served, strict=True) if v != version]
        if wrong:
            raise WeightSyncError(
                f"weight_update to {version} not applied everywhere: " + "; ".join(wrong)
            )

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Sequence[str] | None = None, timeout_s: float = 120.0) -> None:
        """``/release_memory_occupation`` on every engine in service (``tags`` None: weights
        and KV cache), so that a colocated trainer gets the devices."""
        self._memory("release", tags, timeout_s)

    def resume_memory(self, tags: Sequence[str] | None = None, timeout_s: float = 120.0) -> None:
        """``/resume_memory_occupation``: undo :meth:`release_memory` for ``tags``."""
        self._memory("resume", tags, timeout_s)

    def _memory(self, what: str, tags: Sequence[str] | None, timeout_s: float) -> None:
        client = self._require_client()
        wanted = set(tags) if tags else {"weights", "kv_cache"}
        if not self._sync_lock.acquire(timeout=timeout_s):
            raise WeightSyncError(f"{what}_memory: the pool was busy for {timeout_s}s")
        try:
            urls = self.in_service_urls()
            call = client.aio.release_memory if what == "release" else client.aio.resume_memory

            async def all_engines() -> list[Any]:
                return await asyncio.gather(
                    *(call(sorted(wanted), url=u) for u in urls), return_exceptions=True
                )

            results = client.run(all_engines(), timeout_s=timeout_s)
            errors = [f"{u}: {r}" for u, r in zip(urls, results, strict=True)
                      if isinstance(r, BaseException)]  # fmt: skip
            if what == "release":
                self.released |= wanted
            else:
                self.released -= wanted
            if errors:
                raise RolloutError(f"{what}_memory {sorted(wanted)} failed on " + "; ".join(errors))
        finally:
            self._sync_lock.release()

    def _require_client(self) -> SyncSGLangClient:
        if self.client is None:
            raise RuntimeError("EnginePool is not started (call start() or use it as a context)")
        return self.client
