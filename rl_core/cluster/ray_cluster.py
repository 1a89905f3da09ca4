"""Ray for the two planes: start a local Ray or join a cluster, check that it holds what the
config asks for, and reserve devices with placement groups (docs/multinode.md, 'Placement groups').

Local (``cluster.address`` unset): 127.0.0.1 only, no dashboard, token authentication, temp dir
under the run directory; joined: shutdown only disconnects (docs/architecture.md, 'Ray on a
shared host'). Every wait is bounded. A local start sets ``RAY_AUTH_MODE=token`` unless set,
writes ``~/.ray/auth_token`` if missing and, from the main thread, installs Ray's SIGTERM
handler. Ray is imported only where needed. Never imports Prefect or MLflow; never stops a Ray
it did not start; never reads the config.
"""


from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

from rl_core.cluster.placement import (
    BundlePlan,
    ClusterError,
    PlanePlacement,
    PlaneResources,
    ResourceNeed,
    Slot,
    check_fits,
    format_resources,
    import_ray,
    need_for,
    place_planes,
    plan_bundles,
)

__all__ = ["MAX_TEMP_DIR_LEN", "BundlePlan", "ClusterError", "PlanePlacement", "PlaneResources",
           "RayCluster", "ResourceNeed", "Slot", "need_for", "place_planes", "plan_bundles",
           "ray_temp_dir"]  # the placement names are rl_core.cluster.placement's

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}

# The longest path Ray puts under its temp dir is a unix socket:
# <temp>/session_<date>_<microseconds>_<pid>/sockets/plasma_store[.N]; pids go to 7 digits.
_SOCKET_SUFFIX = "/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.99"
_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
MAX_TEMP_DIR_LEN = _SOCKET_PATH_MAX - len(_SOCKET_SUFFIX)
"""The longest Ray temp dir (in bytes) whose socket paths stay within the unix limit."""

class _HasAddress(Protocol):
    address: str | None


def ray_temp_dir(run_dir: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """Ray's temp dir for a run, created: ``(<run_dir>/ray, None)``, or, when that is longer
    than :data:`MAX_TEMP_DIR_LEN` bytes, ``(short dir under /tmp, <run_dir>/ray)`` with the
    second a symlink to the first."""
    run_dir = Path(os.path.abspath(run_dir))
    wanted = run_dir / "ray"
    if wanted.is_symlink():
        wanted.unlink()  # a previous attempt's fallback: make a fresh one
    if len(os.fsencode(wanted)) <= MAX_TEMP_DIR_LEN:
        wanted.mkdir(parents=True, exist_ok=True)
        return wanted, None
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    short = Path(tempfile.mkdtemp(prefix="grpoflow-ray-", dir=base))
    if len(os.fsencode(short)) > MAX_TEMP_DIR_LEN:
        raise ClusterError(f"no short enough temp dir for Ray (tried {short}); set TMPDIR=/tmp")
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        wanted.symlink_to(short, target_is_directory=True)
    except OSError as exc:
        log.warning("Ray temp dir is %s (could not link it from %s: %s)", short, wanted, exc)
        return short, None
    return short, wanted


@contextmanager
def _ray_keeps_loopback(enabled: bool) -> Iterator[None]:
    """Stop Ray 2.60 replacing 127.0.0.1 by the routable address while it starts or connects
    (its private ``ENABLE_RAY_CLUSTER`` flag); the caller verifies the result afterwards."""
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


_abandoned: threading.Thread | None = None


class _RayThread:
    """The one thread that calls ``ray.init`` and, at the end, ``ray.shutdown``: Ray's GCS and
    raylet die with the *thread* that started them (``PR_SET_PDEATHSIG``). :meth:`start` waits at
    most ``timeout_s``; a start finishing later is shut down here, and later starts are refused
    until this thread ends (two would share process-wide state)."""

    def __init__(self, ray: Any, kwargs: dict[str, Any], what: str) -> None:
        self._ray, self._kwargs, self._what = ray, kwargs, what
        self._lock = threading.Lock()
        self._ready, self._stop = threading.Event(), threading.Event()
        self._abandoned = False
        self._ctx: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="grpoflow-ray", daemon=True)

    def _run(self) -> None:
        try:
            ctx = self._ray.init(**self._kwargs)
        except BaseException as exc:  # handed to the caller by start()
            self._error = exc
            self._ready.set()
            return
        with self._lock:
            if self._abandoned:
                self._ray.shutdown()
                return
            self._ctx = ctx
            self._ready.set()
        self._stop.wait()
        self._ray.shutdown()

    def start(self, timeout_s: float) -> Any:
        """Run ``ray.init`` in the thread; its context, or :class:`ClusterError`."""
        global _abandoned
        if _abandoned is not None and _abandoned.is_alive():
            raise ClusterError(
                f"{self._what}: an earlier ray.init in this process timed out and is still "
                "running; wait for it to give up or start a new process")
        worker_log = logging.getLogger("ray._private.worker")

        def drop(record: logging.LogRecord) -> bool:  # off the main thread Ray warns; see below
            return "SIGTERM handler is not set" not in record.getMessage()

        worker_log.addFilter(drop)
        try:
            self._thread.start()
            self._ready.wait(timeout_s)
            with self._lock:
                if not self._ready.is_set():
                    self._abandoned = True
                    _abandoned = self._thread
                    raise ClusterError(
                        f"{self._what} did not finish within {timeout_s:g} s (init_timeout_s); "
                        "see the Ray logs under its temp dir (session_latest/logs)")
        finally:
            worker_log.removeFilter(drop)
        if self._error is not None:
            raise ClusterError(f"{self._what} failed: {self._error}") from self._error
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        return self._ctx

    def stop(self, timeout_s: float) -> bool:
        """``ray.shutdown`` in the thread; False if it did not end within ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _warn_if_token_readable_by_others() -> None:
    """Ray writes ``~/.ray/auth_token`` with the umask's mode (often 0644): say so."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    with suppress(OSError):  # no token file: nothing to say
        if (mode := path.stat().st_mode) & 0o077:
            log.warning("Ray's token file %s is readable by other users (mode %o): chmod 600 %s",
                        path, mode & 0o777, path)


def _resolve_address(address: str) -> str:
    """``auto`` -> the address ``ray.init(address="auto")`` would use; others unchanged."""
    if address != "auto":
        return address
    from ray._private import services

    try:
        return services.get_ray_address_from_environment("auto", None)
    except ConnectionError as exc:
        raise ClusterError(
            "cluster.address=auto found no running Ray on this machine: set RAY_ADDRESS, "
            "give cluster.address=host:port, or start one with `ray start --head`") from exc


def _host_port(address: str) -> tuple[str, int | None]:
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    return host, int(port) if port.isdigit() else None


def _probe(address: str, timeout_s: float) -> None:
    """A plain TCP connect to ``address`` so a wrong address fails in seconds, not minutes
    (``ray.init`` retries an unreachable GCS for a long time)."""
    host, port = _host_port(address)
    if port is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(f"nothing answers at {host}:{port} ({exc})") from exc


class RayCluster:
    """A Ray this process started (``owns``: :meth:`shutdown` stops it) or joined; use
    :meth:`start` (a context manager that shuts down on exit). ``address``: GCS or ``ray://``;
    ``connected_here``: :meth:`start` called ``ray.init``; ``temp_dir``: a local start's;
    ``startup_s``: seconds ``ray.init`` took (0: a reused connection)."""

    def __init__(self, *, address: str, owns: bool, thread: _RayThread | None,
                 temp_dir: Path | None, startup_s: float) -> None:
        self.address, self.owns, self.temp_dir, self.startup_s = address, owns, temp_dir, startup_s
        self.connected_here, self._thread, self._closed = thread is not None, thread, False

    @classmethod
    def start(cls, cluster_cfg: _HasAddress, run_dir: str | os.PathLike[str], *,
              need: ResourceNeed | None = None, num_cpus: int | None = None,
              num_gpus: int | None = None, init_timeout_s: float = 120.0) -> RayCluster:
        """Start a local Ray (``cluster_cfg.address`` is ``None``) or join one, then check it.
        ``num_cpus``/``num_gpus`` size a local Ray (default: what Ray detects); ``None`` when
        joining. A cluster short of ``need`` (from :func:`need_for`) raises
        :class:`ClusterError` naming what is missing (a Ray started here is stopped first)."""
        ray = import_ray()
        address = getattr(cluster_cfg, "address", None)
        if ray.is_initialized():
            cluster = cls._reuse(ray, address)
        elif address is None:
            cluster = cls._start_local(ray, run_dir, num_cpus, num_gpus, init_timeout_s)
        else:
            if num_cpus is not None or num_gpus is not None:
                raise ClusterError(
                    f"num_cpus/num_gpus size a local Ray only; cluster.address={address!r} "
                    "joins an existing cluster (size it where it is started)")
            cluster = cls._connect(ray, address, init_timeout_s)
        if need is not None:
            try:
                cluster.check_resources(need)
            except BaseException:
                cluster.shutdown()
                raise
        return cluster

    @classmethod
    def _reuse(cls, ray: Any, address: str | None) -> RayCluster:
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto") and address != current:
            raise ClusterError(
                f"this process is already connected to Ray at {current}, not "
                f"cluster.address={address!r}: call ray.shutdown() first or set "
                f"cluster.address to {current!r}")
        log.info("using the Ray this process is already connected to (%s)", current)
        return cls(address=current, owns=False, thread=None, temp_dir=None, startup_s=0)

    @classmethod
    def _start_local(cls, ray: Any, run_dir: str | os.PathLike[str], num_cpus: int | None,
                     num_gpus: int | None, timeout_s: float) -> RayCluster:
        temp_dir, link = ray_temp_dir(run_dir)
        if link is not None:
            log.info("Ray temp dir %s (linked from %s: run dir path too long)", temp_dir, link)
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            log.warning("RAY_AUTH_MODE=disabled: Ray runs without token authentication; any "
                        "local user who finds its ports can run code in it")
        kwargs: dict[str, Any] = dict(_node_ip_address=LOOPBACK, include_dashboard=False,
                                      _temp_dir=str(temp_dir), num_cpus=num_cpus, num_gpus=num_gpus)
        t0 = time.monotonic()
        thread = _RayThread(ray, kwargs, "starting a local Ray")
        with _ray_keeps_loopback(True):
            thread.start(timeout_s)
        took = time.monotonic() - t0
        address = ray.get_runtime_context().gcs_address
        cluster = cls(address=address, owns=True, thread=thread, temp_dir=temp_dir, startup_s=took)
        ips = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
        if _host_port(address)[0] != LOOPBACK or ips != [LOOPBACK]:
            cluster.shutdown()
            raise ClusterError(
                f"the local Ray did not bind {LOOPBACK} (GCS {address}, nodes {ips}); "
                "this Ray version resolves loopback differently: run it in a loopback-only "
                "network namespace (docs/architecture.md, 'Ray on a shared host')")
        _warn_if_token_readable_by_others()
        res = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        log.info("started a local Ray at %s in %.1f s (%s; temp dir %s)", address, took,
                 format_resources(res), temp_dir)
        return cluster

    @classmethod
    def _connect(cls, ray: Any, address: str, timeout_s: float) -> RayCluster:
        resolved = _resolve_address(address)
        client = resolved.startswith("ray://")
        loopback = not client and _host_port(resolved)[0] in _LOOPBACK_HOSTS
        kwargs: dict[str, Any] = {"address": resolved}
        if loopback:  # a Ray bound to loopback: this driver must register as 127.0.0.1 too
            kwargs["_node_ip_address"] = LOOPBACK
        t0 = time.monotonic()
        thread = _RayThread(ray, kwargs, f"connecting to Ray at {resolved}")
        try:
            _probe(resolved, min(timeout_s, 10.0))
            with _ray_keeps_loopback(loopback):
                thread.start(timeout_s)
        except ClusterError as exc:
            raise ClusterError(
                f"could not join the Ray cluster at cluster.address={address!r} ({resolved}): "
                f"{exc}. Check it is up (`ray status --address {resolved}`); with token "
                "authentication set RAY_AUTH_MODE=token and the cluster's token "
                "(~/.ray/auth_token or RAY_AUTH_TOKEN)") from (exc.__cause__ or exc)
        took = time.monotonic() - t0
        gcs = resolved if client else ray.get_runtime_context().gcs_address
        log.info("joined the Ray cluster at %s in %.1f s", gcs, took)
        return cls(address=gcs, owns=False, thread=thread, temp_dir=None, startup_s=took)

    def check_resources(self, need: ResourceNeed) -> None:
        """Fail with :class:`ClusterError` unless the cluster's totals hold ``need`` and every
        bundle shape fits one node. What other jobs hold now is not subtracted:
        :func:`place_planes` waits for it, within its bound."""
        ray = import_ray()
        nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
        check_fits(need, ray.cluster_resources(), nodes)
        log.info("Ray has what the config asks for: %s", need.describe())

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop Ray if this process started it; disconnect if it joined; else do nothing."""
        closed, self._closed = self._closed, True
        if closed or self._thread is None:
            return
        t0 = time.monotonic()
        verb = "stopped the local Ray" if self.owns else "disconnected from Ray"
        if self._thread.stop(timeout_s):
            log.info("%s at %s in %.1f s", verb, self.address, time.monotonic() - t0)
        else:
            log.warning("ray.shutdown at %s did not finish within %g s", self.address, timeout_s)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"RayCluster(address={self.address!r}, owns={self.owns})"
