"""Rollout engines as Ray actors: one actor per engine, placed where the cluster plan says.

An :class:`EngineActor` runs one engine server on its node (``--parent-pid`` the actor), so
killing the actor takes the server with it within a second and the pool's monitor restarts a
fresh one. :class:`RayActorLauncher` is the pool's launcher for them: the same pool code drives
local processes and Ray actors. Every ``ray.get`` is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import ray

from rl_core.host import free_port
from rl_core.rollout.launch import start_process, stop_process

__all__ = ["EngineActor", "RayActorLauncher", "RayEngineProcess"]

log = logging.getLogger(__name__)


class EngineActor:
    """Runs ``command(index, port)`` on this actor's node (wrapped by ``ray.remote``)."""

    def __init__(self, command: Any, index: int, log_path: str,
                 env: Mapping[str, str] | None = None, host: str | None = None) -> None:
        self.host = host or ray.util.get_node_ip_address()
        self.port = free_port(self.host)
        argv = list(command(index, self.port))
        if "--host" not in argv and "rl_core.engine.server" in argv:
            argv += ["--host", self.host]
        self.proc = start_process(argv, log_path, env={**os.environ, **(env or {})})

    def address(self) -> tuple[str, int, int]:
        return self.host, self.port, self.proc.pid

    def load_weights(self, arrays: Mapping[str, Any], version: str, staging_dir: str,
                     timeout_s: float, flush_cache: bool = True) -> str:
        """``object_store`` sync: the arrays (from Ray's object store, no copy) go to
        node-local safetensors, then ``/update_weights_from_disk``; the server's answer."""
        from safetensors.torch import save_file

        from rl_core.weight_sync.source import from_arrays

        target = Path(staging_dir) / f"engine-{self.port}" / f"v{version}"
        shutil.rmtree(target.parent, ignore_errors=True)
        target.mkdir(parents=True)
        save_file(from_arrays(arrays), str(target / "model.safetensors"))
        resp = httpx.post(f"http://{self.host}:{self.port}/update_weights_from_disk", json={
            "model_path": str(target), "weight_version": version, "flush_cache": flush_cache,
        }, timeout=timeout_s)
        body = resp.json()
        if resp.status_code != 200 or not body.get("success", False):
            raise RuntimeError(f"{self.host}:{self.port} refused the weights: {body}")
        return str(body.get("message"))

    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        return stop_process(self.proc, timeout_s)


class RayEngineProcess:
    """The pool's view of one engine actor: alive / stop / kill, like a process."""

    def __init__(self, actor: Any, host: str, port: int, pid: int, call_timeout_s: float) -> None:
        self.actor, self.host, self.port, self.pid = actor, host, port, pid
        self.call_timeout_s = call_timeout_s
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """``None`` while the actor and its server run (a bounded call), else an exit code."""
        if self.returncode is not None:
            return self.returncode
        try:
            code = ray.get(self.actor.returncode.remote(), timeout=self.call_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            log.warning("engine actor at %s:%d is gone: %s", self.host, self.port, e)
            code = -9
        self.returncode = code
        return code

    def stop(self, timeout_s: float) -> None:
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + self.call_timeout_s)
        ray.kill(self.actor, no_restart=True)
        self.returncode = self.returncode if self.returncode is not None else 0

    def kill(self) -> None:
        """A crash: the actor dies at once; its server follows within a second."""
        ray.kill(self.actor, no_restart=True)


class RayActorLauncher:
    """Starts engine ``index`` as an :class:`EngineActor` with ``options[index]``: Ray actor
    options (resources, placement group strategy from :mod:`rl_core.cluster.ray_cluster`)."""

    def __init__(self, command: Any, options: Sequence[Mapping[str, Any]], *,
                 env: Mapping[str, str] | None = None, start_timeout_s: float = 300.0,
                 call_timeout_s: float = 10.0) -> None:
        self.command, self.options, self.env = command, list(options), dict(env or {})
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self._cls = ray.remote(EngineActor)

    def spawn(self, index: int, port: int, log_path: Path) -> tuple[RayEngineProcess, str, int]:
        """Start engine ``index``'s actor; ``port`` is ignored (the actor picks one on its
        node). Returns ``(proc, host, port)`` as the pool expects."""
        t0 = time.monotonic()
        opts = dict(self.options[index % len(self.options)]) if self.options else {}
        opts.setdefault("num_cpus", 0)
        opts.setdefault("max_restarts", 0)
        actor = self._cls.options(**opts).remote(self.command, index, str(log_path), self.env)
        try:
            host, port, pid = ray.get(actor.address.remote(), timeout=self.start_timeout_s)
        except Exception:
            ray.kill(actor, no_restart=True)
            raise
        log.info("engine %d: actor up at %s:%d (server pid %d) in %.1fs", index, host, port, pid,
                 time.monotonic() - t0)
        return RayEngineProcess(actor, host, port, pid, self.call_timeout_s), host, port

    def stop(self, proc: RayEngineProcess, timeout_s: float) -> None:
        proc.stop(timeout_s)

    def kill(self, proc: RayEngineProcess) -> None:
        proc.kill()
