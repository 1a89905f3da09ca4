"""Security: what a run exposes on the network, which code it trusts, and what it writes down.

What this file is for: the "Security" part of the reliability suite (docs/reliability.md).

- **Loopback only.** Short demo runs (two embedded engines behind the real ``sglang-router``;
  the same on a local Ray) are watched while they run: every TCP socket that the test
  process or any of its descendants listens on (engines, router and its metrics port, Ray's
  GCS/raylet/agents/workers, the Prefect test server, torch.distributed stores) is bound to
  a loopback address, and at least the engines' and the router's ports were seen.
- **Ray token authentication** stays on for a local Ray: a client with a wrong token is
  refused (the environment side, ``RAY_AUTH_MODE=token``, is pinned by
  ``tests/test_ray_cluster.py::TestLocalRay::test_local_start_binds_loopback_with_temp_dir_in_run_dir``).
- **trust_remote_code** is off unless set: a model directory whose config needs its own code
  (``auto_map``) is refused by :func:`rl_core.models.hub.verify_model_dir`.
- **Secrets** planted in the environment and in config values reach none of: the run
  directory's files, Prefect's flow/task runs (parameters, states, results) and logs,
  stdout/stderr, and the error of a run that fails on purpose. The MLflow side (params,
  artifacts, the registered model) is ``tests/test_tracking.py::test_secrets_never_reach_mlflow``.

What it must never do: reach a network outside this machine (the failing endpoints are
closed loopback ports).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("restore_ray_auth_mode")]


def _short_run(tmp: Path, cache: Path, run: str, *extra: str) -> list[str]:
    return [
        f"storage.root={tmp}", f"storage.cache_dir={cache}", f"run_name={run}",
        "train.steps=2", "train.prompts_per_step=4", "rollout.n_samples=4",
        "checkpoint.every=0", "eval.every=0", "eval.num_examples=8", "eval.pass_k_examples=0",
        "train.num_threads=1", "rollout.engine_threads=1", "tracking.backend=none", *extra,
    ]  # fmt: skip


# ============================================================ listening sockets of a run


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _listening_sockets(pid: int) -> dict[int, tuple[str, int]]:
    """The listening TCP sockets of ``pid``'s network namespace: inode -> (ip, port), the
    address as psutil gives it (``/proc/<pid>/net/tcp`` and ``tcp6``, state 0A)."""
    out = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            ip, port = fields[1].split(":")
            raw = bytes.fromhex(ip)  # 32-bit words, each in host byte order
            if sys.byteorder == "little":
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return out


def _who(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} {' '.join(proc.cmdline()[:4])[:160]}"
    except psutil.Error:
        return f"pid {proc.pid}"


@dataclass
class ListenWatch:
    """Samples, every ``interval_s``, the TCP sockets the test process and all its
    descendants listen on, and the ports the run's planes say they serve."""

    interval_s: float = 0.3
    seen: dict[tuple[str, int], str] = field(default_factory=dict)  # (ip, port) -> who
    plane_ports: dict[int, str] = field(default_factory=dict)  # port -> engine-i / router
    samples: int = 0
    # sockets this process already listened on before the run (earlier tests of the
    # session): not the run's, reported apart
    before: dict[tuple[str, int], str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ListenWatch:
        self.sample()
        self.before, self.seen, self.samples = dict(self.seen), {}, 0
        self._thread = threading.Thread(target=self._loop, name="listen-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """What ``psutil.Process.net_connections`` finds listening, read from ``/proc`` with
        each network namespace's TCP tables parsed once per sample, not once per process
        (psutil's way cost ~4 ms of CPU per process and sample: a fifth of a core for a
        run on Ray)."""
        me = psutil.Process()
        try:
            procs = [me, *me.children(recursive=True)]
        except psutil.Error:
            return
        tables: dict[str, dict[int, tuple[str, int]]] = {}  # netns -> socket inode -> address
        for proc in procs:
            try:  # a process that ends between the listing and the look is skipped
                ns = os.readlink(f"/proc/{proc.pid}/ns/net")
                if ns not in tables:
                    tables[ns] = _listening_sockets(proc.pid)
                if not (table := tables[ns]):
                    continue
                fds = os.listdir(f"/proc/{proc.pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                except OSError:
                    continue
                key = table.get(int(link[8:-1])) if link.startswith("socket:[") else None
                if key is not None and key not in self.before and key not in self.seen:
                    self.seen[key] = _who(proc)
        self._plane_ports()
        self.samples += 1

    def _plane_ports(self) -> None:
        from rl_core import planes as planes_mod

        for p in list(planes_mod._REGISTRY.values()):
            pool = getattr(p.rollout, "pool", None)
            if pool is None:
                continue
            for e in pool.engines:
                self.plane_ports.setdefault(e.port, f"engine-{e.index}")
            if pool.router is not None:
                self.plane_ports.setdefault(pool.router.port, "router")

    def exposed(self) -> dict[tuple[str, int], str]:
        return {k: who for k, who in self.seen.items() if not _is_loopback(k[0])}


def test_a_demo_run_listens_on_loopback_only(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    """Two steps with two engines behind the router: nothing the run starts listens beyond
    loopback. On Ray (actors, a weight-sync group, Ray's servers) the same watch runs around
    every flow run of tests/test_ray_planes.py."""
    from flows.grpo_train import grpo_train

    extra = ["rollout.engine=embedded", "rollout.num_engines=2"]
    with ListenWatch() as watch:
        out = grpo_train(
            config=DEMO,
            overrides=_short_run(tmp_path, tiny_cache, "sockets", *extra),
            show_progress=False,
        )
    assert out["steps"] == 2
    assert watch.samples > 3, "the watch sampled the run while it ran"
    exposed = watch.exposed()
    assert not exposed, "listening beyond loopback:\n" + "\n".join(
        f"  {ip}:{port}  {who}" for (ip, port), who in sorted(exposed.items())
    )
    # not vacuous: the engines' and the router's ports were seen listening
    listening = {port for _, port in watch.seen}
    roles = {role for port, role in watch.plane_ports.items() if port in listening}
    assert roles >= {"engine-0", "engine-1", "router"}, (watch.plane_ports, watch.seen)


def test_a_torch_store_listens_only_on_the_address_its_peers_are_told() -> None:
    """torch's ``TCPStore`` alone binds ``::``; :func:`host_tcp_store` (the trainer ranks'
    store and the weight-sync group's) hands it a socket bound to the given address, and
    refuses an address that means every interface."""
    from datetime import timedelta

    from rl_core.weight_sync.process_group import host_tcp_store

    store = host_tcp_store("127.0.0.1", 0, 2, timeout=timedelta(seconds=5), wait_for_workers=False)
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening
    for everywhere in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            host_tcp_store(everywhere, 0, 2, timeout=timedelta(seconds=5), wait_for_workers=False)


def test_servers_grpoflow_launches_or_advises_bind_loopback() -> None:
    """grpoflow starts no server for the user: flows use Prefect's ephemeral API (a uvicorn
    child on 127.0.0.1, watched by the runs above) and MLflow's SQLite store in the run
    directory. Every Prefect or MLflow server command the code builds or prints (the
    screenshot script, ``grpoflow doctor``'s advice) says ``--host 127.0.0.1``, and no Python
    module binds every interface. (The docker stack publishes on 127.0.0.1 only:
    ``tests/test_docker.py``.)"""
    import re

    launch = re.compile(r"prefect\W+server\W+start|mlflow\W+server")
    found = []
    for folder in ("flows", "grpoflow", "tasks", "rl_core", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                assert "0.0.0.0" not in line and 'host="::"' not in line, f"{path}:{i + 1}"
                m = launch.search(line)
                if m and "--host" in " ".join(lines[i : i + 5]):
                    found.append(f"{path.relative_to(ROOT)}:{i + 1}")
                    near = " ".join(lines[i : i + 5]).replace('", "', " ")
                    assert "--host 127.0.0.1" in near, f"{path}:{i + 1}: {line.strip()}"
    assert len(found) >= 4, found  # screenshots.py's two servers, doctor.py's advice


# ================================================================= Ray token authentication


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory) -> Iterator[str]:
    """A local Ray as a run starts it (``RayCluster.start`` without an address); its GCS."""
    pytest.importorskip("ray")
    import tempfile
    from types import SimpleNamespace

    from rl_core.cluster.ray_cluster import RayCluster

    run_dir = Path(tempfile.mkdtemp(prefix="gfs", dir="/tmp"))
    cluster = RayCluster.start(SimpleNamespace(address=None), run_dir, num_cpus=1)
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


_CLIENT = textwrap.dedent(
    """
    import sys, ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
        print("CONNECTED", ray.cluster_resources())
    except Exception as exc:  # what a stranger on this machine gets
        print("REFUSED", type(exc).__name__, exc)
    """
)


@pytest.mark.parametrize("token", ["wrong", None], ids=["wrong-token", "no-token"])
def test_local_ray_refuses_a_client_without_its_token(local_ray: str, token: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    if token is None:
        env["RAY_AUTH_MODE"] = "disabled"
    else:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    env["HOME"] = "/nonexistent"  # no ~/.ray/auth_token to fall back on
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT, local_ray],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert "CONNECTED" not in out, out
    assert "REFUSED" in out or done.returncode != 0, out


# ======================================================================= trust_remote_code


def test_trust_remote_code_is_off_unless_set(tmp_path: Path) -> None:
    """The config default is off, and a model directory that needs its own code (``auto_map``
    in config.json) is refused by the start-up check unless ``model.trust_remote_code``."""
    from engine_helpers import save_tiny_model

    from rl_core.config import ModelConfig
    from rl_core.models.hub import ModelError, verify_model_dir

    assert ModelConfig().trust_remote_code is False
    model = save_tiny_model(tmp_path / "remote")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    config["model_type"] = "evil"
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelError, match="trust_remote_code"):
        verify_model_dir(model)


# ================================================================================ secrets

ENV_CANARIES = {
    "AWS_ACCESS_KEY_ID": "AKIACANARY0000000042",
    "AWS_SECRET_ACCESS_KEY": "canary-aws-secret-7f3e9d2c1b0a",
    "HF_TOKEN": "hf_canaryTOKENabcdefghijklmnop42",
    "MLFLOW_TRACKING_PASSWORD": "canary-mlflow-pw-5e4d3c",
    "MLFLOW_TRACKING_TOKEN": "canary-mlflow-token-9a8b7c",
}
URL_PASSWORD = "canary-url-pw-1d2e3f"  # user:password@ in a config URL
WANDB_KEY = "canary-wandb-key-4a5b6c"  # a secret-named value in cluster.env
CANARIES = [*ENV_CANARIES.values(), URL_PASSWORD, WANDB_KEY]
S3_ENV = ("AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL")  # the flow exports the endpoint


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections refused


def _leaks(text: str) -> list[str]:
    return [c for c in CANARIES if c in text]


def _prefect_records(since: float) -> dict[str, str]:
    """Every flow run, task run (parameters, states, result references) and log line the
    Prefect API holds from flow runs started after ``since``, as JSON text by what it is."""
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterStartTime,
        LogFilter,
        LogFilterFlowRunId,
    )

    start = datetime.fromtimestamp(since, tz=UTC)
    out: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=start)),
            limit=200,
        )
        ids = [r.id for r in runs]
        for r in runs:
            out[f"flow run {r.name}"] = r.model_dump_json(exclude={"parameters"})
            out[f"flow run {r.name} parameters"] = json.dumps(r.parameters)
        if not ids:
            return out
        in_runs = FlowRunFilter(id=FlowRunFilterId(any_=ids))
        for t in client.read_task_runs(flow_run_filter=in_runs, limit=200):
            out[f"task run {t.name}"] = t.model_dump_json()
        offset = 0
        while True:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)),
                limit=200,
                offset=offset,
            )
            for i, entry in enumerate(logs):
                kind = " traceback" if "Traceback (most recent call last)" in entry.message else ""
                out[f"log {offset + i}{kind}"] = entry.model_dump_json()
            if len(logs) < 200:
                break
            offset += 200
    return out


def _persisted_results(since: float) -> dict[str, str]:
    """Result files Prefect wrote (cached tasks persist theirs) since ``since``."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    root = Path(PREFECT_LOCAL_STORAGE_PATH.value())
    if not root.is_dir():
        return {}
    return {
        f"result {p}": p.read_bytes().decode("utf-8", "replace")
        for p in root.rglob("*")
        if p.is_file() and p.stat().st_mtime >= since
    }


def _assert_no_canary(where: dict[str, str]) -> None:
    found = {k: _leaks(v) for k, v in where.items()}
    found = {k: v for k, v in found.items() if v}
    assert not found, "secrets leaked:\n" + "\n".join(f"  {k}: {v}" for k, v in found.items())


@pytest.fixture
def canaries(monkeypatch) -> Iterator[None]:
    """The canaries in the environment (of this process and everything it starts)."""
    for name, value in ENV_CANARIES.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the failing S3 endpoint fails at once
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    before = {k: os.environ.get(k) for k in S3_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    from rl_core import storage

    storage.reset_clients()


def test_secrets_reach_no_file_prefect_record_log_or_error(
    prefect_harness, canaries, demo_model: Path, tiny_cache: Path, tmp_path: Path, capfd, caplog
) -> None:
    """Canaries in the environment and in config values (a password in a URL, a secret-named
    engine variable) through a successful run and two runs that fail on purpose (an S3
    endpoint and an MLflow server, both with credentials in the URL, both unreachable)."""
    import logging
    import traceback

    from flows.grpo_train import grpo_train

    caplog.set_level(logging.INFO)
    since = time.time() - 1
    endpoint = f"http://minio:{URL_PASSWORD}@127.0.0.1:{_closed_port()}"
    engine_env = f"cluster.env={{WANDB_API_KEY: {WANDB_KEY}, OMP_NUM_THREADS: '1'}}"
    ok = grpo_train(
        config=DEMO,
        overrides=_short_run(
            tmp_path, tiny_cache, "canary-ok", engine_env, f"storage.s3_endpoint_url={endpoint}"
        ),
        show_progress=False,
    )
    assert ok["steps"] == 2

    failing = {
        "s3": [
            f"storage.s3_endpoint_url={endpoint}",
            "checkpoint.uri=s3://grpoflow-canary/ckpt",
        ],
        "mlflow": [
            "tracking.backend=mlflow",
            f"tracking.uri=http://alice:{URL_PASSWORD}@127.0.0.1:{_closed_port()}",
        ],
    }
    errors: dict[str, str] = {}
    for name, extra in failing.items():
        state = grpo_train(
            config=DEMO,
            overrides=[*_short_run(tmp_path, tiny_cache, f"canary-{name}", engine_env), *extra],
            show_progress=False,
            return_state=True,
        )
        assert state.is_failed(), (name, state)
        exc = state.result(raise_on_failure=False)
        assert isinstance(exc, BaseException), (name, exc)
        errors[f"{name} error"] = str(exc)
        errors[f"{name} traceback"] = "".join(traceback.format_exception(exc))
        errors[f"{name} state"] = state.message or ""
    assert "127.0.0.1" in errors["s3 error"] and "127.0.0.1" in errors["mlflow error"], errors

    files = {
        f"file {p}": p.read_bytes().decode("utf-8", "replace")
        for p in tmp_path.rglob("*")
        if p.is_file()
    }
    assert any("metrics.jsonl" in k for k in files) and any("config.yaml" in k for k in files)
    out, err = capfd.readouterr()
    _assert_no_canary(
        {
            **files,
            **errors,
            **_prefect_records(since),
            **_persisted_results(since),
            "stdout": out,
            "stderr": err,
            "logging": caplog.text,
        }
    )


def test_a_flow_receives_its_parameters_whole_and_the_api_stores_them_redacted(
    prefect_harness,
) -> None:
    """:class:`flows._redacted.RedactedFlow` (grpo_train, evaluate, the asset flows): the
    function is called with the real overrides; the flow run's parameters in the API have the
    secrets masked (by the override's key, by a mapping's keys, and by text) and nothing else
    changed. A ``with_options`` copy redacts too."""
    from prefect.client.orchestration import get_client

    from flows._redacted import RedactedFlow, redacted_flow

    @redacted_flow(name="redaction-probe")
    def probe(overrides: list[str], api_key: str | None = None) -> list[str]:
        return [*overrides, str(api_key)]

    overrides = [
        f"storage.s3_endpoint_url=http://minio:{URL_PASSWORD}@127.0.0.1:9000",
        f"cluster.env={{WANDB_API_KEY: {WANDB_KEY}, OMP_NUM_THREADS: '1'}}",
        f"tracking.token={ENV_CANARIES['MLFLOW_TRACKING_TOKEN']}",
        "train.steps=2",
    ]
    copy = probe.with_options(name="redaction-probe-copy")
    assert isinstance(copy, RedactedFlow)
    for fl in (probe, copy):
        state = fl(overrides, api_key=WANDB_KEY, return_state=True)
        assert state.result() == [*overrides, WANDB_KEY]  # the real values reached the flow
        with get_client(sync_client=True) as client:
            stored = client.read_flow_run(state.state_details.flow_run_id).parameters
        assert not _leaks(json.dumps(stored)), stored
        assert stored["api_key"] == "***"
        assert stored["overrides"][0] == "storage.s3_endpoint_url=http://***@127.0.0.1:9000"
        assert json.loads(stored["overrides"][1].split("=", 1)[1]) == {
            "WANDB_API_KEY": "***",
            "OMP_NUM_THREADS": "1",
        }
        assert stored["overrides"][2:] == ["tracking.token=***", "train.steps=2"]
