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
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["MAX_TEMP_DIR_LEN", "BundlePlan", "ClusterError", "PlanePlacement", "PlaneResources",
           "RayCluster", "ResourceNeed", "Slot", "need_for", "place_planes", "plan_bundles",
           "ray_temp_dir"]

log = logging.getLogger(__name__)

Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[str, ...] = ("colocated", "disaggregated")
LOOPBACK = "127.0.0.1"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}

# The longest path Ray puts under its temp dir is a unix socket:
# <temp>/session_<date>_<microseconds>_<pid>/sockets/plasma_store[.N]; pids go to 7 digits.
_SOCKET_SUFFIX = "/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.99"
_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
MAX_TEMP_DIR_LEN = _SOCKET_PATH_MAX - len(_SOCKET_SUFFIX)
"""The longest Ray temp dir (in bytes) whose socket paths stay within the unix limit."""

_FIELDS_HINT = ("the config fields: cluster.trainer_ranks, cluster.cpus_per_trainer, "
                "cluster.gpus_per_trainer, rollout.num_engines, cluster.cpus_per_engine, "
                "cluster.gpus_per_engine, cluster.placement")


class ClusterError(RuntimeError):
    """Ray could not be started or joined, or lacks what the config asks for."""


class _HasAddress(Protocol):
    address: str | None


@dataclass(frozen=True)
class PlaneResources:
    """What each plane's actors ask for (mirrors ``cluster.trainer_ranks``, ``rollout.num_engines``
    and ``cluster.{cpus,gpus}_per_{trainer,engine}``). A GPU count above 1 is a multi-device actor
    (a TP=4 engine is ``gpus_per_engine=4``), below 1 a share of one device."""
    trainer_ranks: int = 1
    cpus_per_trainer: float = 1.0
    gpus_per_trainer: float = 0.0
    engines: int = 1
    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0

    def __post_init__(self) -> None:
        for name in ("trainer_ranks", "engines"):
            if not isinstance(value := getattr(self, name), int) or value < 1:
                raise ValueError(f"PlaneResources.{name} must be an int >= 1, got {value!r}")
        for name in ("cpus_per_trainer", "gpus_per_trainer", "cpus_per_engine", "gpus_per_engine"):
            if not math.isfinite(value := getattr(self, name)) or value < 0:
                raise ValueError(f"PlaneResources.{name} must be >= 0, got {value!r}")
        for plane in ("trainer", "engine"):
            gpus = getattr(self, f"gpus_per_{plane}")
            if getattr(self, f"cpus_per_{plane}") + gpus <= 0:
                raise ValueError(f"each {plane} must ask for some CPU or GPU (both are 0)")
            if gpus > 1 and gpus != int(gpus):
                raise ValueError(f"gpus_per_{plane} above 1 must be a whole number, got {gpus}")

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_trainer > 0 or self.gpus_per_engine > 0


@dataclass(frozen=True)
class BundlePlan:
    """The placement groups to create (``groups``: bundles per group, named by
    ``group_names``) and where each actor goes: ``trainer[i]``/``engines[j]`` are ``(group,
    bundle, num_cpus, num_gpus, devices)``, ``devices`` every bundle index the actor covers."""
    placement: Placement
    group_names: tuple[str, ...]
    groups: tuple[tuple[dict[str, float], ...], ...]
    trainer: tuple[tuple[int, int, float, float, tuple[int, ...]], ...]
    engines: tuple[tuple[int, int, float, float, tuple[int, ...]], ...]


def _shape(cpus: float, gpus: float) -> dict[str, float]:
    """A bundle without zero entries (Ray rejects a bundle of zeros)."""
    return {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def plan_bundles(resources: PlaneResources, placement: str) -> BundlePlan:
    """The bundles ``placement`` needs for ``resources`` and the actor -> bundle mapping: one bundle
    per actor in a group per plane (disaggregated), or one shared group of single-device bundles in
    which each trainer rank and engine takes half of its first bundle (colocated; the layout:
    docs/multinode.md, 'Placement groups')."""
    if placement not in PLACEMENTS:
        raise ValueError(f"cluster.placement must be one of {PLACEMENTS}, got {placement!r}")
    r = resources
    if placement == "disaggregated":
        return BundlePlan(
            "disaggregated", ("trainer", "rollout"),
            ((_shape(r.cpus_per_trainer, r.gpus_per_trainer),) * r.trainer_ranks,
             (_shape(r.cpus_per_engine, r.gpus_per_engine),) * r.engines),
            tuple((0, i, r.cpus_per_trainer, r.gpus_per_trainer, (i,))
                  for i in range(r.trainer_ranks)),
            tuple((1, j, r.cpus_per_engine, r.gpus_per_engine, (j,)) for j in range(r.engines)))
    dt, de = max(1, math.ceil(r.gpus_per_trainer)), max(1, math.ceil(r.gpus_per_engine))
    n_devices = max(r.trainer_ranks * dt, r.engines * de)
    device = _shape(max(r.cpus_per_trainer, r.cpus_per_engine), 1.0 if r.uses_gpus else 0.0)

    def halves(n: int, per: int, cpus: float, gpus: float) -> tuple:
        return tuple((0, i * per, cpus / 2, min(gpus, 1.0) / 2,
                      tuple(range(i * per, i * per + per))) for i in range(n))

    return BundlePlan(
        "colocated", ("colocated",), ((device,) * n_devices,),
        halves(r.trainer_ranks, dt, r.cpus_per_trainer, r.gpus_per_trainer),
        halves(r.engines, de, r.cpus_per_engine, r.gpus_per_engine))


def _fmt(res: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items())) or "nothing"


@dataclass(frozen=True)
class ResourceNeed:
    """What a placement of the planes needs from the cluster, in total and per bundle."""
    resources: PlaneResources
    placement: Placement
    totals: dict[str, float]
    bundles: tuple[dict[str, float], ...]

    def describe(self) -> str:
        """One line a person can check against ``ray status``."""
        r = self.resources
        return (f"{_fmt(self.totals)} for {self.placement} planes: trainer {r.trainer_ranks} "
                f"rank(s) x (CPU {r.cpus_per_trainer:g}, GPU {r.gpus_per_trainer:g}), rollout "
                f"{r.engines} engine(s) x (CPU {r.cpus_per_engine:g}, GPU {r.gpus_per_engine:g})")


def need_for(resources: PlaneResources, placement: str) -> ResourceNeed:
    """The CPUs and GPUs ``placement`` reserves for ``resources``, summed over its bundles
    (disaggregated: each plane's own; colocated: one set of devices both planes share)."""
    plan = plan_bundles(resources, placement)
    bundles = tuple(b for group in plan.groups for b in group)
    totals: dict[str, float] = {}
    for key, value in (kv for b in bundles for kv in b.items()):
        totals[key] = totals.get(key, 0.0) + value
    return ResourceNeed(resources, plan.placement, totals, bundles)


def _missing(need: Mapping[str, float], have: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in need.items() if have.get(k, 0.0) + 1e-9 < v}


def _check_fits(need: ResourceNeed, totals: Mapping[str, float],
                nodes: Sequence[Mapping[str, float]]) -> None:
    """Fail when the cluster's totals, or every single node, are short of ``need``."""
    if short := _missing(need.totals, totals):
        lacking = "; ".join(f"{k}: asks {v:g}, cluster has {totals.get(k, 0.0):g}"
                            for k, v in sorted(short.items()))
        raise ClusterError(
            f"the Ray cluster lacks {', '.join(sorted(short))} ({lacking}). The config asks for "
            f"{need.describe()}. Give Ray more (ray start --num-cpus/--num-gpus, or a bigger "
            f"cluster via cluster.address) or ask for less: {_FIELDS_HINT}.")
    for bundle in {tuple(sorted(b.items())) for b in need.bundles}:
        if not any(not _missing(dict(bundle), node) for node in nodes):
            have = "; ".join(_fmt({k: v for k, v in n.items() if k in ("CPU", "GPU")})
                             for n in nodes)
            raise ClusterError(
                f"no single Ray node holds one bundle of {_fmt(dict(bundle))} (a bundle, and "
                f"so an actor, cannot span nodes); nodes have: {have}. The config asks for "
                f"{need.describe()}; adjust {_FIELDS_HINT}.")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is a dev dependency here
        raise ClusterError(
            "Ray is not installed: pip install 'grpoflow[ray]' (cluster.mode: ray)") from exc
    return ray


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
        ray = _import_ray()
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
                 _fmt(res), temp_dir)
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
        ray = _import_ray()
        nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
        _check_fits(need, ray.cluster_resources(), nodes)
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


@dataclass(frozen=True)
class Slot:
    """Where one trainer rank or engine runs: its bundle, node, and what it asks Ray for."""
    plane: Literal["trainer", "rollout"]
    index: int
    group: PlacementGroup = field(repr=False)
    bundle_index: int
    devices: tuple[int, ...]
    node_id: str
    node_ip: str
    num_cpus: float
    num_gpus: float

    @property
    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.bundle_index)

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options(...)`` that put the actor here."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "scheduling_strategy": self.scheduling_strategy}


@dataclass
class PlanePlacement:
    """Placement groups holding the planes' devices; :meth:`remove` releases them."""
    placement: Placement
    groups: tuple[PlacementGroup, ...] = field(repr=False)
    trainer: tuple[Slot, ...]
    engines: tuple[Slot, ...]

    def remove(self) -> None:
        """Release the reservations (actors placed in them are killed by Ray)."""
        if not _import_ray().is_initialized():
            return
        from ray.util import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already gone with its cluster
                log.debug("placement group %s not removed: %s", pg.id, exc)

    def describe(self) -> list[str]:
        """One line per actor: plane, index, bundle, node."""
        return [f"{s.plane} {s.index}: bundle {s.bundle_index} on {s.node_ip} "
                f"(node {s.node_id[:8]}; CPU {s.num_cpus:g}, GPU {s.num_gpus:g})"
                for s in (*self.trainer, *self.engines)]

    def __enter__(self) -> PlanePlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def place_planes(resources: PlaneResources, placement: str, *, timeout_s: float = 120.0,
                 strategy: str = "PACK", name: str = "grpoflow") -> PlanePlacement:
    """Reserve the planes' devices with placement groups (``strategy``, ``PACK``: fewest nodes) and
    say where each actor goes; needs a connected Ray. Waits at most ``timeout_s``, then removes the
    groups and raises :class:`ClusterError` naming what is missing."""
    ray = _import_ray()
    if not ray.is_initialized():
        raise ClusterError("place_planes needs a connected Ray: call RayCluster.start first")
    from ray.util.placement_group import placement_group, placement_group_table

    plan, need = plan_bundles(resources, placement), need_for(resources, placement)
    before = dict(ray.available_resources())
    groups = tuple(placement_group(list(bundles), strategy=strategy, name=f"{name}-{group}")
                   for group, bundles in zip(plan.group_names, plan.groups, strict=True))
    try:
        # pg.wait() takes whole seconds; ray.wait on the ready refs honours a float bound
        refs = [pg.ready() for pg in groups]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(done) < len(refs):
            late = next(n for n, ref in zip(plan.group_names, refs, strict=True) if ref not in done)
            raise ClusterError(_placement_timeout_message(ray, need, before, late, timeout_s))
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        tables = [placement_group_table(pg)["bundles_to_node_id"] for pg in groups]

        def slot(plane: Literal["trainer", "rollout"], index: int, spec: tuple) -> Slot:
            g, b, cpus, gpus, devices = spec
            node_ids = {tables[g][d] for d in devices}
            if len(node_ids) > 1:
                raise ClusterError(
                    f"{plane} {index} needs devices {devices[0]}-{devices[-1]} on one node but "
                    f"Ray placed them on {len(node_ids)} nodes; make the GPUs per node a "
                    "multiple of cluster.gpus_per_engine / cluster.gpus_per_trainer")
            node = tables[g][b]
            return Slot(plane, index, groups[g], b, devices, node, ips.get(node, ""), cpus, gpus)

        placed = PlanePlacement(plan.placement, groups,
                                tuple(slot("trainer", i, s) for i, s in enumerate(plan.trainer)),
                                tuple(slot("rollout", j, s) for j, s in enumerate(plan.engines)))
    except BaseException:
        PlanePlacement(plan.placement, groups, (), ()).remove()
        raise
    for line in placed.describe():
        log.info("placed %s", line)
    return placed


def _placement_timeout_message(ray: Any, need: ResourceNeed, before: Mapping[str, float],
                               group: str, timeout_s: float) -> str:
    """What is missing, against what was available when the placement began."""
    available = {k: v for k, v in before.items() if k in need.totals}
    total = {k: v for k, v in ray.cluster_resources().items() if k in need.totals}
    short = {k: v - available.get(k, 0.0) for k, v in _missing(need.totals, available).items()}
    lacking = ("missing " + ", ".join(f"{k} {v:g}" for k, v in sorted(short.items())) if short
               else "enough in total but not in the bundle shapes the nodes can hold")
    return (f"placement {need.placement!r} could not reserve its '{group}' group within "
            f"{timeout_s:g} s: it needs {need.describe()}; when it began the cluster had "
            f"{_fmt(available)} available of {_fmt(total)} ({lacking}). Free them (other jobs' "
            f"actors or placement groups), add nodes, or ask for less: {_FIELDS_HINT}.")
