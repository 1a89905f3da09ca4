"""Ray bring-up and plane placement (rl_core.cluster.ray_cluster) against a real Ray.

Two Rays are started, one after the other, each once: a local one (``RayCluster.start``
with no address; class ``TestLocalRay``) and a two-node test cluster
(``ray.cluster_utils.Cluster``, both nodes on 127.0.0.1 with 2 CPUs and a custom resource
``node_a``/``node_b``; class ``TestTwoNodes``) that the driver joins by address. The
placement tests start tiny actors with the slots' options and check the node each one
reports. Everything binds 127.0.0.1, so the module also runs in a loopback-only network
namespace (``unshare -n``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from rl_core.cluster import ray_cluster as rc  # noqa: E402
from rl_core.cluster.ray_cluster import (  # noqa: E402
    MAX_TEMP_DIR_LEN,
    ClusterError,
    PlaneResources,
    RayCluster,
    need_for,
    place_planes,
    plan_bundles,
    ray_temp_dir,
)

ACTOR_TIMEOUT_S = 120  # an actor process takes ~4 s to start on an idle 2-core machine


def where_class():
    """A tiny actor that says where it runs (defined in a function: Ray ships it by value,
    since workers cannot import this test module)."""

    class Where:
        def where(self) -> tuple[str, str | None]:
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), ctx.get_placement_group_id()

    return Where


def start_actors(slots, attempts: int = 3) -> list[tuple[str, str | None]]:
    """Start one ``Where`` per slot with the slot's options; return where each one runs.

    Under a loaded machine Ray has (twice in ~40 suite runs, once in CI) cancelled a probe actor
    before it ran ("all references to the actor were removed ... never ran") though its handle
    was held: that is Ray's, not placement's, so fresh actors are tried again (a wrong placement
    is as wrong the second time); any other error, or the same one ``attempts`` times, fails."""
    cls = ray.remote(where_class())
    for attempt in range(1, attempts + 1):
        actors = [cls.options(**s.actor_options()).remote() for s in slots]
        try:
            return ray.get([a.where.remote() for a in actors], timeout=ACTOR_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            if attempt < attempts and "never ran" in str(e):
                print(f"probe actors: attempt {attempt} cancelled by Ray, trying again: {e}")
                continue
            nodes = [(n["NodeID"][:8], n["Alive"], n["Resources"]) for n in ray.nodes()]
            groups = {k[:8]: v["state"] for k, v in ray.util.placement_group_table().items()}
            raise AssertionError(f"probe actors failed (attempt {attempt}): {e}\nnodes: {nodes}\n"
                                 f"placement groups: {groups}") from e  # fmt: skip
        finally:
            for a in actors:
                ray.kill(a)
    raise AssertionError("unreachable")


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listening_addresses(pids: set[int]) -> set[str]:
    """The local addresses (hex, as in /proc/net/tcp*) on which ``pids`` listen for TCP."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    found.add(cols[1].split(":")[0])
    return found


LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


# ---------------------------------------------------------------- no Ray needed


def test_disaggregated_plan_one_bundle_per_actor():
    r = PlaneResources(2, 1, 1, 3, 2, 1)
    plan = plan_bundles(r, "disaggregated")
    assert plan.group_names == ("trainer", "rollout")
    assert plan.groups == (({"CPU": 1.0, "GPU": 1.0},) * 2, ({"CPU": 2.0, "GPU": 1.0},) * 3)
    assert [(g, b) for g, b, *_ in plan.trainer] == [(0, 0), (0, 1)]
    assert [(g, b) for g, b, *_ in plan.engines] == [(1, 0), (1, 1), (1, 2)]
    assert need_for(r, "disaggregated").totals == {"CPU": 8.0, "GPU": 5.0}


def test_colocated_plan_shares_devices_half_each():
    r = PlaneResources(2, 1, 1, 2, 2, 1)
    plan = plan_bundles(r, "colocated")
    assert plan.groups == (({"CPU": 2.0, "GPU": 1.0},) * 2,)
    assert plan.trainer == ((0, 0, 0.5, 0.5, (0,)), (0, 1, 0.5, 0.5, (1,)))
    assert plan.engines == ((0, 0, 1.0, 0.5, (0,)), (0, 1, 1.0, 0.5, (1,)))
    assert need_for(r, "colocated").totals == {"CPU": 4.0, "GPU": 2.0}
    # on CPU a device is a CPU bundle; the GPU key is absent, not 0
    cpu = plan_bundles(PlaneResources(1, 1, 0, 1, 1, 0), "colocated")
    assert cpu.groups == (({"CPU": 1.0},),)
    assert cpu.trainer[0][2:4] == cpu.engines[0][2:4] == (0.5, 0.0)


def test_colocated_multi_device_engines_span_consecutive_bundles():
    plan = plan_bundles(PlaneResources(4, 1, 1, 2, 1, 2), "colocated")
    assert len(plan.groups[0]) == 4
    assert [s[1] for s in plan.trainer] == [0, 1, 2, 3]
    assert [(s[1], s[4]) for s in plan.engines] == [(0, (0, 1)), (2, (2, 3))]
    # more engines than ranks: the extra devices hold engines only
    plan = plan_bundles(PlaneResources(1, 1, 1, 3, 1, 1), "colocated")
    assert len(plan.groups[0]) == 3 and [s[1] for s in plan.engines] == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"trainer_ranks": 0}, "trainer_ranks"),
        ({"engines": 0}, "engines"),
        ({"gpus_per_engine": -1}, "gpus_per_engine"),
        ({"gpus_per_engine": 1.5}, "whole number"),
        ({"cpus_per_trainer": 0, "gpus_per_trainer": 0}, "trainer must ask"),
    ],
)
def test_plane_resources_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlaneResources(**kwargs)


def test_unknown_placement_is_rejected():
    with pytest.raises(ValueError, match="cluster.placement"):
        plan_bundles(PlaneResources(), "spread")


def test_check_fits_names_missing_resource_and_node_shape():
    need = need_for(PlaneResources(2, 1, 1, 2, 1, 1), "disaggregated")
    with pytest.raises(ClusterError, match=r"lacks GPU \(GPU: asks 4, cluster has 0\)"):
        rc.check_fits(need, {"CPU": 8.0}, [{"CPU": 8.0}])
    big = need_for(PlaneResources(1, 1, 0, 1, 1, 4), "disaggregated")
    two_nodes = [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 2.0}]
    with pytest.raises(ClusterError, match=r"no single Ray node holds one bundle of CPU 1, GPU 4"):
        rc.check_fits(big, {"CPU": 8.0, "GPU": 4.0}, two_nodes)


def test_temp_dir_in_run_dir_when_short():
    run_dir = Path(tempfile.mkdtemp(prefix="gfr", dir="/tmp"))
    try:
        temp_dir, link = ray_temp_dir(run_dir)
        assert temp_dir == run_dir / "ray" and link is None and temp_dir.is_dir()
    finally:
        shutil.rmtree(run_dir)


def test_temp_dir_falls_back_to_short_dir_linked_from_long_run_dir(tmp_path):
    run_dir = tmp_path / ("r" * 80) / "run"
    temp_dir, link = ray_temp_dir(run_dir)
    try:
        assert len(str(run_dir / "ray")) > MAX_TEMP_DIR_LEN
        assert len(str(temp_dir)) <= MAX_TEMP_DIR_LEN and temp_dir.is_dir()
        assert link == run_dir / "ray" and link.is_symlink() and link.resolve() == temp_dir
        # a second start (resume) replaces the link with a fresh dir
        again, link2 = ray_temp_dir(run_dir)
        assert link2 == link and link.resolve() == again
        shutil.rmtree(again)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_socket_budget_matches_ray_limit():
    # the longest socket Ray makes under a temp dir of MAX_TEMP_DIR_LEN bytes fits 107 bytes
    longest = "/" + "t" * (MAX_TEMP_DIR_LEN - 1) + rc._SOCKET_SUFFIX
    assert len(longest) == 107
    from ray._private.utils import validate_socket_filepath

    validate_socket_filepath(longest)
    with pytest.raises(OSError):
        validate_socket_filepath(longest + "x")


class _SlowRay:
    """Stands in for the ``ray`` module: ``init`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.shut_down = threading.Event()

    def init(self, **kwargs):
        self.release.wait(30)
        return "ctx"

    def shutdown(self) -> None:
        self.shut_down.set()


def test_ray_thread_bounds_init_and_cleans_up_a_late_start():
    slow = _SlowRay()
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"starting Ray did not finish within 0.3 s"):
        rc._RayThread(slow, {}, "starting Ray").start(0.3)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ClusterError, match="still running"):
        rc._RayThread(_SlowRay(), {}, "starting Ray again").start(0.3)
    slow.release.set()  # the late start completes ...
    assert slow.shut_down.wait(10)  # ... and is shut down by its thread
    rc._abandoned.join(10)
    fast = _SlowRay()
    fast.release.set()
    thread = rc._RayThread(fast, {}, "starting Ray")
    assert thread.start(5) == "ctx"
    time.sleep(0.2)
    assert not fast.shut_down.is_set()  # Ray lives while its thread waits ...
    assert thread.stop(5) and fast.shut_down.is_set()  # ... and stops when asked


def test_connect_to_dead_address_fails_fast():
    assert not ray.is_initialized()
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"cluster.address='127.0.0.1:9'.*nothing answers"):
        RayCluster.start(SimpleNamespace(address="127.0.0.1:9"), "/unused", init_timeout_s=20)
    assert time.monotonic() - t0 < 15
    with pytest.raises(ClusterError, match="size a local Ray only"):
        RayCluster.start(SimpleNamespace(address="127.0.0.1:9"), "/unused", num_cpus=2)


# ---------------------------------------------------------------- a local Ray


pytestmark = pytest.mark.usefixtures("restore_ray_auth_mode")


@pytest.fixture(scope="class")
def local_ray():
    """``RayCluster.start`` with no address: a local Ray with 4 logical CPUs (~5 s)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gfr", dir="/tmp"))
    try:
        cluster = RayCluster.start(SimpleNamespace(address=None), run_dir, num_cpus=4)
        try:
            yield cluster, run_dir
        finally:
            cluster.shutdown()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class TestLocalRay:
    def test_local_start_binds_loopback_with_temp_dir_in_run_dir(self, local_ray):
        cluster, run_dir = local_ray
        assert cluster.owns and cluster.connected_here
        assert cluster.address.startswith("127.0.0.1:")
        assert cluster.temp_dir == run_dir / "ray"
        assert (run_dir / "ray" / "session_latest" / "sockets").is_dir()
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
        assert nodes[0]["RayletSocketName"].startswith(str(run_dir / "ray") + "/")
        assert ray.cluster_resources()["CPU"] == 4
        # every process Ray started listens on loopback only (GCS, raylet, agents, workers)
        addrs = listening_addresses(descendants(os.getpid()))
        assert addrs and addrs <= LOOPBACK_HEX, addrs
        if os.environ.get("RAY_AUTH_MODE", "token").lower() != "disabled":
            assert os.environ["RAY_AUTH_MODE"] == "token"
        assert cluster.startup_s > 0

    def test_start_again_reuses_connection_and_leaves_ray_running(self, local_ray):
        cluster, run_dir = local_ray
        for address in (cluster.address, "auto", None):
            again = RayCluster.start(SimpleNamespace(address=address), run_dir)
            assert not again.owns and not again.connected_here
            again.shutdown()
            assert ray.is_initialized()
            assert ray.cluster_resources()["CPU"] == 4
        with pytest.raises(ClusterError, match="already connected to Ray at 127.0.0.1:"):
            RayCluster.start(SimpleNamespace(address="127.0.0.1:1"), run_dir)

    def test_resource_check_names_what_is_missing(self, local_ray):
        cluster, run_dir = local_ray
        gpus = need_for(PlaneResources(2, 1, 1, 2, 1, 1), "disaggregated")
        with pytest.raises(ClusterError) as err:
            cluster.check_resources(gpus)
        msg = str(err.value)
        assert "lacks GPU (GPU: asks 4, cluster has 0)" in msg
        assert "cluster.gpus_per_engine" in msg and "disaggregated" in msg
        cpus = need_for(PlaneResources(3, 1, 0, 3, 1, 0), "disaggregated")
        with pytest.raises(ClusterError, match=r"lacks CPU \(CPU: asks 6, cluster has 4\)"):
            RayCluster.start(SimpleNamespace(address=None), run_dir, need=cpus)
        assert ray.is_initialized()  # a reused connection is not shut down by a failed check
        cluster.check_resources(need_for(PlaneResources(3, 1, 0, 3, 1, 0), "colocated"))

    def test_colocated_puts_rank_i_and_engine_i_in_bundle_i(self, local_ray):
        with place_planes(PlaneResources(2, 1, 0, 2, 1, 0), "colocated", timeout_s=60) as placed:
            assert len(placed.groups) == 1
            assert [s.bundle_index for s in placed.trainer] == [0, 1]
            assert [s.bundle_index for s in placed.engines] == [0, 1]
            for t, e in zip(placed.trainer, placed.engines, strict=True):
                assert t.group.id == e.group.id == placed.groups[0].id
                assert t.node_id == e.node_id and t.node_ip == "127.0.0.1"
                assert (t.num_cpus, e.num_cpus, t.num_gpus) == (0.5, 0.5, 0.0)
                strat = t.scheduling_strategy
                assert strat.placement_group.id == t.group.id
                assert strat.placement_group_bundle_index == t.bundle_index
            assert wait_for(lambda: ray.available_resources().get("CPU", 0) == 2)
            # trainer 0 and engine 0 both fit in bundle 0 (half a CPU each) and run there
            (t_node, t_pg), (e_node, e_pg) = start_actors([placed.trainer[0], placed.engines[0]])
            assert t_node == e_node == placed.trainer[0].node_id
            assert t_pg == e_pg == placed.groups[0].id.hex()
        assert wait_for(lambda: ray.available_resources().get("CPU", 0) == 4)

    def test_disaggregated_uses_separate_groups_and_bundles(self, local_ray):
        placed = place_planes(PlaneResources(1, 1, 0, 2, 1, 0), "disaggregated", timeout_s=60)
        try:
            assert len(placed.groups) == 2
            assert {s.group.id for s in placed.trainer} == {placed.groups[0].id}
            assert {s.group.id for s in placed.engines} == {placed.groups[1].id}
            assert [s.bundle_index for s in placed.engines] == [0, 1]
            assert all((s.num_cpus, s.num_gpus) == (1, 0) for s in placed.engines)
            assert wait_for(lambda: ray.available_resources().get("CPU", 0) == 1)
        finally:
            placed.remove()
        assert wait_for(lambda: ray.available_resources().get("CPU", 0) == 4)

    def test_impossible_placement_fails_within_bound_and_releases(self, local_ray):
        from ray.util.placement_group import placement_group_table

        t0 = time.monotonic()
        with pytest.raises(ClusterError) as err:
            place_planes(PlaneResources(1, 8, 0, 1, 1, 0), "disaggregated", timeout_s=2)
        assert time.monotonic() - t0 < 10
        msg = str(err.value)
        assert "placement 'disaggregated'" in msg and "within 2 s" in msg, msg
        assert "missing CPU 5" in msg and "had CPU 4 available of CPU 4" in msg, msg
        # busy rather than too small: 3 of 4 CPUs held, colocated 2 more asked for
        held = place_planes(PlaneResources(2, 1, 0, 1, 1, 0), "disaggregated", timeout_s=60)
        assert wait_for(lambda: ray.available_resources().get("CPU", 0) == 1)
        with (
            held,
            pytest.raises(ClusterError, match=r"'colocated'.*CPU 1 available.*missing CPU 1"),
        ):
            place_planes(PlaneResources(2, 1, 0, 2, 1, 0), "colocated", timeout_s=1)
        states = {t["state"] for t in placement_group_table().values()}
        assert states <= {"REMOVED"}, states


# ---------------------------------------------------------------- two fake nodes


@pytest.fixture(scope="class")
def two_nodes():
    """A ``ray.cluster_utils.Cluster``: head ``node_a`` and worker ``node_b``, 2 CPUs each,
    both on 127.0.0.1, with a private RAY_TMPDIR so its address file is ours alone."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ADDRESS")}
    tmp = tempfile.mkdtemp(prefix="gfc", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.pop("RAY_ADDRESS", None)
    node = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    # Two raylets and their workers on 2 cores the other test worker keeps busy: Ray's defaults declare a node dead
    # after 5 missed 10 s health checks and a worker lost if it takes 60 s to register,
    # which a busy test machine can exceed (the actors then "died"); bound both generously.
    patient = {"health_check_timeout_ms": 60_000, "health_check_failure_threshold": 20,
               "worker_register_timeout_seconds": 300}  # fmt: skip
    with rc._ray_keeps_loopback(True):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**node, "resources": {"node_a": 1}, "include_dashboard": False,
                            "_system_config": patient},  # fmt: skip
        )
        cluster.add_node(**node, resources={"node_b": 1})
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def joined(two_nodes):
    """This process joined to ``two_nodes`` through ``cluster.address=auto``, for one test (a
    test that joins by itself then finds this process unconnected, in any order)."""
    need = need_for(PlaneResources(2, 1, 0, 2, 1, 0), "disaggregated")
    cluster = RayCluster.start(SimpleNamespace(address="auto"), "/unused", need=need)
    yield cluster
    cluster.shutdown()


def node_names() -> dict[str, str]:
    names = {}
    for n in ray.nodes():
        if n["Alive"]:
            names[n["NodeID"]] = "node_a" if "node_a" in n["Resources"] else "node_b"
    return names


class TestTwoNodes:
    def test_join_by_address_and_leave_without_stopping_it(self, two_nodes):
        cluster = RayCluster.start(SimpleNamespace(address=two_nodes.address), "/unused")
        try:
            assert not cluster.owns and cluster.connected_here and cluster.temp_dir is None
            assert cluster.address == two_nodes.address
            alive = [n for n in ray.nodes() if n["Alive"]]
            assert len(alive) == 2 and {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}
            assert ray.cluster_resources()["CPU"] == 4
        finally:
            cluster.shutdown()
        assert not ray.is_initialized()
        assert two_nodes.remaining_processes_alive()

    def test_auto_finds_the_cluster_and_checks_resources(self, two_nodes, joined):
        assert joined.address == two_nodes.address and not joined.owns
        too_many = need_for(PlaneResources(1, 1, 0, 1, 3, 0), "disaggregated")
        with pytest.raises(ClusterError, match="no single Ray node holds one bundle of CPU 3"):
            joined.check_resources(too_many)

    def test_disaggregated_puts_each_plane_on_its_own_node(self, joined):
        names = node_names()
        r = PlaneResources(2, 1, 0, 2, 1, 0)
        with place_planes(r, "disaggregated", timeout_s=60) as placed:
            t_nodes = {s.node_id for s in placed.trainer}
            e_nodes = {s.node_id for s in placed.engines}
            assert len(t_nodes) == len(e_nodes) == 1 and t_nodes != e_nodes, placed.describe()
            where = start_actors([*placed.trainer, *placed.engines])
            ran = [names[node] for node, _ in where]
            want = [names[s.node_id] for s in (*placed.trainer, *placed.engines)]
            assert ran == want and ran[0] == ran[1] != ran[2] == ran[3], ran

    def test_colocated_spreads_devices_and_keeps_rank_with_engine(self, joined):
        names = node_names()
        r = PlaneResources(2, 2, 0, 2, 2, 0)  # a device = 2 CPUs = a whole fake node
        with place_planes(r, "colocated", timeout_s=60) as placed:
            assert placed.groups[0].bundle_specs == [{"CPU": 2.0}, {"CPU": 2.0}]
            assert placed.trainer[0].node_id != placed.trainer[1].node_id, placed.describe()
            where = start_actors([*placed.trainer, *placed.engines])
            ran = [names[node] for node, _ in where]
            # trainer 0 with engine 0, trainer 1 with engine 1, on two different nodes
            assert ran[0] == ran[2] != ran[1] == ran[3], ran
            assert ran == [names[s.node_id] for s in (*placed.trainer, *placed.engines)]
