"""SGLang launch commands and platform environment presets; a real launch on GPU machines."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import psutil
import pytest

from rl_core.cluster.platform import PLATFORM_ENV_PRESETS, platform_env
from rl_core.host import free_port
from rl_core.rollout.launch import (
    SGLangLaunchConfig,
    build_sglang_command,
    kill_process,
    sglang_engine_command,
    sglang_env,
    start_process,
    stop_process,
    wait_healthy,
)

PY = sys.executable


def test_default_command():
    cfg = SGLangLaunchConfig(model_path="/models/qwen")
    assert build_sglang_command(cfg) == [
        PY, "-m", "sglang.launch_server",
        "--model-path", "/models/qwen",
        "--tp-size", "1",
        "--dp-size", "1",
        "--base-gpu-id", "0",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--dtype", "auto",
    ]  # fmt: skip


def test_cuda_colocated_command_with_every_option():
    cfg = SGLangLaunchConfig(
        model_path="Qwen/Qwen3-30B-A3B",
        tp=4,
        dp=2,
        mem_fraction_static=0.7,
        enable_memory_saver=True,
        base_gpu_id=4,
        port=15000,
        dtype="bfloat16",
        trust_remote_code=True,
        enable_deterministic_inference=True,
        skip_server_warmup=True,
        extra_args=["--context-length", 8192],
        python="python3",
    )
    assert build_sglang_command(cfg) == [
        "python3", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-30B-A3B",
        "--tp-size", "4",
        "--dp-size", "2",
        "--mem-fraction-static", "0.7",
        "--enable-memory-saver",
        "--base-gpu-id", "4",
        "--host", "127.0.0.1",
        "--port", "15000",
        "--dtype", "bfloat16",
        "--trust-remote-code",
        "--enable-deterministic-inference",
        "--skip-server-warmup",
        "--context-length", "8192",
    ]  # fmt: skip


def test_rocm_command_is_the_same_cli():
    # A 7B model fits one MI300X: TP=1 per engine, one engine per GPU.
    cfg = SGLangLaunchConfig(
        model_path="/m",
        base_gpu_id=3,
        port=15003,
        platform="rocm",
        dtype="bfloat16",
        mem_fraction_static=0.8,
    )
    cmd = build_sglang_command(cfg)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "3"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.8"
    assert "--enable-memory-saver" not in cmd
    assert cfg.url == "http://127.0.0.1:15003"


def test_pool_command_factory_gives_each_engine_its_own_gpus_and_port():
    command = sglang_engine_command(SGLangLaunchConfig(model_path="/m", tp=2, base_gpu_id=1))
    cmd = command(2, 15002)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "5"  # 1 + 2 engines * 2 GPUs
    assert cmd[cmd.index("--port") + 1] == "15002"


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="tp and dp"):
        SGLangLaunchConfig(model_path="/m", tp=0)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangLaunchConfig(model_path="/m", mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="platform"):
        SGLangLaunchConfig(model_path="/m", platform="tpu")  # type: ignore[arg-type]


def test_rocm_env_preset():
    env = platform_env("rocm", visible_devices=[0, 1, 2, 3])
    for key, value in {
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "HSA_NO_SCRATCH_RECLAIM": "1",
        "HIP_FORCE_DEV_KERNARG": "1",
        "NCCL_MIN_NCHANNELS": "112",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "SGLANG_USE_AITER": "1",
    }.items():
        assert env[key] == value, key
    # HIP honours both variables; they must agree
    assert env["HIP_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in env


def test_cuda_env_preset():
    env = platform_env("cuda", visible_devices="2,3")
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert env["NCCL_CUMEM_ENABLE"] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "HIP_VISIBLE_DEVICES" not in env and "SGLANG_USE_AITER" not in env
    assert "CUDA_VISIBLE_DEVICES" not in platform_env("cuda")


def test_presets_are_one_table_and_not_mutated():
    assert set(PLATFORM_ENV_PRESETS) == {"cuda", "rocm"}
    platform_env("rocm", visible_devices=[0])["SGLANG_USE_AITER"] = "0"
    assert PLATFORM_ENV_PRESETS["rocm"]["SGLANG_USE_AITER"] == "1"
    assert "HIP_VISIBLE_DEVICES" not in PLATFORM_ENV_PRESETS["rocm"]
    with pytest.raises(ValueError, match="platform"):
        platform_env("metal")  # type: ignore[arg-type]


def test_server_env_drops_allocator_config():
    cfg = SGLangLaunchConfig(model_path="/m", platform="rocm", visible_devices=[5])
    env = sglang_env(cfg, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "A": "b"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["A"] == "b" and env["HIP_VISIBLE_DEVICES"] == "5"


def test_wait_healthy_reports_the_log_of_a_server_that_died(tmp_path):
    log = tmp_path / "dead.log"
    proc = start_process([PY, "-c", "import sys; print('boom: no GPU'); sys.exit(3)"], log)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*boom: no GPU"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=20, proc=proc, log_path=log)
    finally:
        stop_process(proc)


def test_wait_healthy_is_bounded(tmp_path):
    log = tmp_path / "hang.log"
    proc = start_process([PY, "-c", "import time; time.sleep(60)"], log)
    try:
        with pytest.raises(RuntimeError, match="not healthy within"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=0.5, proc=proc, log_path=log)
    finally:
        assert stop_process(proc, timeout_s=5) is not None


def test_stopping_a_reaped_process_never_signals_the_process_that_reuses_its_pid(tmp_path):
    """The kernel hands a reaped leader's pid to a new process (pid_max may be 32768): a
    second stop of the old handle must not kill the new process's group."""
    import subprocess

    old = start_process([PY, "-c", "pass"], tmp_path / "old.log")
    assert old.wait(timeout=60) == 0  # exited and reaped
    new = subprocess.Popen(["sleep", "60"], start_new_session=True)  # leads its own group
    try:
        old.pid = new.pid  # what a pid wrap-around does: the old handle's pid is in use again
        stop_process(old, timeout_s=1)
        with pytest.raises(subprocess.TimeoutExpired):  # (a SIGKILL ends it in milliseconds)
            new.wait(timeout=1)
    finally:
        new.kill()
        new.wait()


def test_a_leader_reaped_behind_its_handle_is_not_signalled_through_a_reused_pid(tmp_path):
    """A waitpid elsewhere (not the handle's) reaps the leader, so the handle still reads as
    running; its pid then goes to a process that is not ours: killing the old handle must not
    kill that process's group."""
    import subprocess

    old = start_process([PY, "-c", "pass"], tmp_path / "old.log")
    os.waitpid(old.pid, 0)  # reaped, and the handle does not know (returncode None)
    assert old.returncode is None
    # someone else's process leading its own group (double-forked: not our child)
    spawn = subprocess.run(
        [PY, "-c", "import subprocess as s; print(s.Popen(['sleep', '60'], start_new_session=True,"
         " stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"], capture_output=True, text=True, check=True,
        timeout=60)
    other = psutil.Process(int(spawn.stdout))
    try:
        old.pid = other.pid  # what a pid wrap-around does
        kill_process(old, timeout_s=1)
        deadline = time.monotonic() + 1.0  # a SIGKILL ends it in milliseconds; its parent
        while time.monotonic() < deadline:  # (init) may leave it a zombie: look for that
            assert other.status() != psutil.STATUS_ZOMBIE, "the other process's group was killed"
            time.sleep(0.05)
    finally:
        other.kill()


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (GPU images only)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU visible"
    return None


@pytest.mark.gpu
def test_launch_real_sglang_server(tmp_path, tiny_model, tiny_tok):
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    import torch

    from rl_core.rollout.client import SyncSGLangClient

    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tok.save_pretrained(model_dir)
    cfg = SGLangLaunchConfig(
        model_path=str(model_dir),
        port=free_port(),
        mem_fraction_static=0.3,
        platform="rocm" if torch.version.hip else "cuda",
        skip_server_warmup=True,
        extra_args=["--disable-cuda-graph"],
    )
    log = tmp_path / "sglang.log"
    proc = start_process(build_sglang_command(cfg), log, env=sglang_env(cfg))
    try:
        wait_healthy(cfg.url, timeout_s=600, proc=proc, log_path=log)
        with SyncSGLangClient(cfg.url) as client:
            r = client.generate([3, 4, 5], {"max_new_tokens": 4, "temperature": 1.0})
            assert len(r.completion_ids) == len(r.logprobs) >= 1
            assert client.weight_version() == "default"
    finally:
        stop_process(proc, timeout_s=30)
