"""Platform detection (CPU here; CUDA and ROCm through a monkeypatched torch), the preset
table, overrides and the visible-devices rule, and the table in docs/platforms.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl_core.cluster import platform as plat
from rl_core.cluster.platform import (
    PLATFORM_ENV_PRESETS,
    PRESET_REASONS,
    detect_platform,
    platform_env,
    preset_table_markdown,
    visible_devices,
    visible_devices_env,
)

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


# ------------------------------------------------------------------------- detection


def test_detects_this_cpu_machine(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = detect_platform()
    assert info.kind == "cpu" and info.devices == () and info.device_count == 0
    assert info.torch_version == torch.__version__
    assert info.hip_version is None and info.collective_backend == "gloo"
    assert info.cpu_count >= 1
    assert info.python_version.startswith("3.")
    d = info.to_dict()
    assert d["kind"] == "cpu" and d["device_count"] == 0 and d["devices"] == []
    assert info.summary().startswith("cpu: no GPU")


def _fake_gpus(monkeypatch, *, hip: str | None, cuda: str | None, props: list) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)


def test_detects_rocm_from_torch_version_hip(monkeypatch, tmp_path):
    mi300x = SimpleNamespace(
        name="AMD Instinct MI300X", total_memory=192 * GIB, gcnArchName="gfx942:sramecc+:xnack-"
    )
    _fake_gpus(monkeypatch, hip="6.4.43482", cuda=None, props=[mi300x] * 8)
    driver = tmp_path / "amdgpu_version"
    driver.write_text("6.10.5\n")
    monkeypatch.setattr(plat, "AMDGPU_DRIVER_FILE", driver)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    info = detect_platform()
    assert info.kind == "rocm" and info.device_count == 8
    assert info.device_names == ["AMD Instinct MI300X"] * 8
    assert info.memory_per_device_bytes == [192 * GIB] * 8
    assert info.devices[0].arch == "gfx942" and info.devices[7].index == 7
    assert info.hip_version == "6.4.43482" and info.cuda_version is None
    assert info.driver_version == "6.10.5"
    assert info.visible_devices == "0,1,2,3,4,5,6,7"
    assert info.collective_backend == "nccl"  # torch's name for RCCL on ROCm
    assert "8 x AMD Instinct MI300X (192 GiB each)" in info.summary()
    assert "HIP 6.4.43482" in info.summary() and info.notes == ()


def test_detects_cuda(monkeypatch, tmp_path):
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB, major=9, minor=0)
    _fake_gpus(monkeypatch, hip=None, cuda="12.8", props=[h100, h100])
    driver = tmp_path / "nvidia_version"
    driver.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Mar  5 2025\n"
        "GCC version:  gcc version 12.2.0\n"
    )
    monkeypatch.setattr(plat, "NVIDIA_DRIVER_FILE", driver)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")

    info = detect_platform()
    assert info.kind == "cuda" and info.device_count == 2
    assert info.devices[1].arch == "sm_90" and info.devices[1].total_memory_gib == 80
    assert info.cuda_version == "12.8" and info.hip_version is None
    assert info.driver_version == "570.124.06"
    assert info.visible_devices == "4,5"
    assert "CUDA 12.8" in info.summary() and "driver 570.124.06" in info.summary()


def test_gpu_build_without_a_visible_gpu_is_cpu_with_a_note(monkeypatch):
    _fake_gpus(monkeypatch, hip="6.4", cuda=None, props=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = detect_platform()
    assert info.kind == "cpu" and info.hip_version == "6.4"
    assert len(info.notes) == 1 and "ROCM build but sees no GPU" in info.notes[0]
    assert "HIP_VISIBLE_DEVICES" in info.notes[0]


def test_a_failing_driver_is_a_note_not_a_crash(monkeypatch):
    def boom() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    _fake_gpus(monkeypatch, hip=None, cuda="12.8", props=[])
    monkeypatch.setattr(torch.cuda, "is_available", boom)
    info = detect_platform()
    assert info.kind == "cpu"
    assert any("driver initialization failed" in n for n in info.notes)


def test_no_torch_is_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    info = detect_platform()
    assert info.kind == "cpu" and info.torch_version is None
    assert "torch does not import" in info.notes[0]


def test_missing_driver_files_give_none(monkeypatch, tmp_path):
    monkeypatch.setattr(plat, "NVIDIA_DRIVER_FILE", tmp_path / "absent")
    monkeypatch.setattr(plat, "AMDGPU_DRIVER_FILE", tmp_path / "absent")
    assert plat._driver_version("cuda") is None and plat._driver_version("rocm") is None
    assert plat._driver_version("cpu") is None


def test_module_imports_without_torch_ray_or_sglang():
    code = (
        "import sys; import rl_core.cluster.platform as p; "
        "heavy = [m for m in ('torch', 'ray', 'sglang', 'prefect', 'mlflow') "
        "if m in sys.modules]; assert not heavy, heavy; print(len(p.PLATFORM_ENV_PRESETS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


# ------------------------------------------------------------------ presets and overrides


def test_the_rocm_and_cuda_presets():
    rocm = platform_env("rocm")
    for key, value in {
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1",
        "HSA_NO_SCRATCH_RECLAIM": "1",
        "HIP_FORCE_DEV_KERNARG": "1",
        "NCCL_MIN_NCHANNELS": "112",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "SGLANG_USE_AITER": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }.items():
        assert rocm[key] == value, key
    cuda = platform_env("cuda")
    for key, value in {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }.items():
        assert cuda[key] == value, key
    assert not any(k.startswith(("HIP_", "HSA_")) or "AITER" in k for k in cuda)
    assert platform_env("cpu") == {}


def test_every_preset_is_a_string_with_a_reason():
    assert set(PLATFORM_ENV_PRESETS) == {"cuda", "rocm"}
    names = {k for env in PLATFORM_ENV_PRESETS.values() for k in env}
    assert names == set(PRESET_REASONS)
    for env in PLATFORM_ENV_PRESETS.values():
        assert all(isinstance(v, str) and v for v in env.values())
        # device selection is per process, never a preset
        assert not {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"} & set(env)
    assert all(len(r) > 20 and "\n" not in r for r in PRESET_REASONS.values())


def test_overrides_set_replace_and_remove():
    env = platform_env(
        "rocm",
        {"SGLANG_USE_AITER": None, "NCCL_MIN_NCHANNELS": "64", "NCCL_DEBUG": "WARN"},
    )
    assert "SGLANG_USE_AITER" not in env
    assert env["NCCL_MIN_NCHANNELS"] == "64" and env["NCCL_DEBUG"] == "WARN"
    assert env["HSA_NO_SCRATCH_RECLAIM"] == "1"
    # removing a variable that is not there is fine; the table itself is untouched
    assert "X" not in platform_env("cuda", {"X": None})
    assert PLATFORM_ENV_PRESETS["rocm"]["SGLANG_USE_AITER"] == "1"
    assert PLATFORM_ENV_PRESETS["rocm"]["NCCL_MIN_NCHANNELS"] == "112"


def test_bad_overrides_name_the_field():
    with pytest.raises(TypeError, match=r"cluster\.env\.NCCL_MIN_NCHANNELS"):
        platform_env("rocm", {"NCCL_MIN_NCHANNELS": 64})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="visible_devices="):
        platform_env("rocm", [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed values"):
        platform_env("tpu")  # type: ignore[arg-type]


def test_exported_variables_win_over_presets_but_not_over_overrides():
    exported = {"SGLANG_USE_AITER": "0", "NCCL_MIN_NCHANNELS": "32"}
    env = platform_env("rocm", {"NCCL_MIN_NCHANNELS": "64"}, environ=exported)
    assert "SGLANG_USE_AITER" not in env  # the actor inherits the user's 0
    assert env["NCCL_MIN_NCHANNELS"] == "64"  # cluster.env is the last word
    assert env["HIP_FORCE_DEV_KERNARG"] == "1"


# -------------------------------------------------------------------- visible devices


def test_rocm_sets_both_selection_variables():
    assert visible_devices_env("rocm", [0, 1, 2, 3]) == {
        "HIP_VISIBLE_DEVICES": "0,1,2,3",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    assert visible_devices_env("cuda", "2, 3") == {"CUDA_VISIBLE_DEVICES": "2,3"}
    env = platform_env("rocm", visible_devices=[4, 5])
    assert env["HIP_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert env["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"
    assert "HIP_VISIBLE_DEVICES" not in platform_env("rocm")
    with pytest.raises(ValueError, match="no devices"):
        visible_devices_env("cpu", [0])


def test_reading_the_selection_in_effect():
    assert visible_devices("rocm", {}) is None
    assert visible_devices("rocm", {"HIP_VISIBLE_DEVICES": "2,3"}) == "2,3"
    assert visible_devices("rocm", {"CUDA_VISIBLE_DEVICES": "1"}) == "1"  # HIP honours it too
    both = {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert visible_devices("rocm", both) == "0,1"
    assert visible_devices("cuda", {"HIP_VISIBLE_DEVICES": "7"}) is None
    assert visible_devices("cpu", {"CUDA_VISIBLE_DEVICES": "0"}) is None
    with pytest.raises(ValueError, match="disagree"):
        visible_devices("rocm", {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "2,3"})


def test_overrides_cannot_split_rocm_selection():
    with pytest.raises(ValueError, match="disagree"):
        platform_env("rocm", {"CUDA_VISIBLE_DEVICES": "6"}, visible_devices=[4])
    # overriding both to the same ids is fine
    env = platform_env(
        "rocm", {"CUDA_VISIBLE_DEVICES": "6", "HIP_VISIBLE_DEVICES": "6"}, visible_devices=[4]
    )
    assert env["HIP_VISIBLE_DEVICES"] == "6"


def test_conflicting_selection_is_a_note_in_detection(monkeypatch):
    h100 = SimpleNamespace(name="AMD Instinct MI355X", total_memory=288 * GIB, gcnArchName="gfx950")
    _fake_gpus(monkeypatch, hip="7.0", cuda=None, props=[h100])
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    info = detect_platform()
    assert info.kind == "rocm" and info.visible_devices is None
    assert any("disagree" in n for n in info.notes)


# ------------------------------------------------------------------------------- docs


def test_docs_carry_every_preset_and_the_generated_table():
    doc = (ROOT / "docs" / "platforms.md").read_text(encoding="utf-8")
    for env in PLATFORM_ENV_PRESETS.values():
        for key in env:
            assert f"`{key}`" in doc, f"{key} is not documented in docs/platforms.md"
    block = re.search(r"<!-- BEGIN preset-table.*?-->\n(.*?)\n<!-- END preset-table -->", doc, re.S)
    assert block, "docs/platforms.md lost its preset-table markers"
    assert block.group(1).strip() == preset_table_markdown(), (
        "docs/platforms.md is stale: paste the output of "
        "`python -m rl_core.cluster.platform --markdown` between the markers"
    )


def test_module_cli_prints_the_table_and_the_platform(capsys):
    assert plat.main(["--markdown"]) == 0
    assert capsys.readouterr().out.strip() == preset_table_markdown()
    assert plat.main([]) == 0
    assert '"kind": "cpu"' in capsys.readouterr().out
