"""The planes' share of a Ray cluster: what each plane needs (CPUs, GPUs per actor), whether
the cluster holds it, and the placement groups that reserve it, one bundle per actor
(docs/multinode.md, 'Placement groups'). Every wait is bounded; Ray is imported only here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["BundlePlan", "ClusterError", "PlanePlacement", "PlaneResources", "ResourceNeed",
           "Slot", "import_ray", "need_for", "place_planes", "plan_bundles"]

log = logging.getLogger(__name__)

Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[str, ...] = ("colocated", "disaggregated")
_FIELDS_HINT = ("the config fields: cluster.trainer_ranks, cluster.cpus_per_trainer, "
                "cluster.gpus_per_trainer, rollout.num_engines, cluster.cpus_per_engine, "
                "cluster.gpus_per_engine, cluster.placement")


class ClusterError(RuntimeError):
    """Ray could not be started or joined, or lacks what the config asks for."""


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


def format_resources(res: Mapping[str, float]) -> str:
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
        return (f"{format_resources(self.totals)} for {self.placement} planes: trainer {r.trainer_ranks} "
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


def check_fits(need: ResourceNeed, totals: Mapping[str, float],
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
            have = "; ".join(format_resources({k: v for k, v in n.items() if k in ("CPU", "GPU")})
                             for n in nodes)
            raise ClusterError(
                f"no single Ray node holds one bundle of {format_resources(dict(bundle))} (a bundle, and "
                f"so an actor, cannot span nodes); nodes have: {have}. The config asks for "
                f"{need.describe()}; adjust {_FIELDS_HINT}.")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is a dev dependency here
        raise ClusterError(
            "Ray is not installed: pip install 'grpoflow[ray]' (cluster.mode: ray)") from exc
    return ray


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
        if not import_ray().is_initialized():
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
    ray = import_ray()
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
            f"{format_resources(available)} available of {format_resources(total)} ({lacking}). Free them (other jobs' "
            f"actors or placement groups), add nodes, or ask for less: {_FIELDS_HINT}.")
