"""Which machine this is (CPU, CUDA or ROCm) and the environment every actor gets there.

:func:`detect_platform` reports the platform, its devices and versions;
:data:`PLATFORM_ENV_PRESETS` is the one table of per-platform variables (each with its reason,
rendered into docs/platforms.md by ``python -m rl_core.cluster.platform``); :func:`platform_env`
merges it with the device selection and ``cluster.env``. Ray never rewrites visible devices;
ROCm's two variables must agree (docs/platforms.md, 'Visible devices'). Loads without Ray or
SGLang, torch only inside :func:`detect_platform`; never imports Prefect or MLflow; never
changes ``os.environ``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["PLATFORM_ENV_PRESETS", "PLATFORM_KINDS", "PRESET_REASONS", "DeviceInfo", "PlatformInfo",
           "PlatformKind", "detect_platform", "platform_env", "preset_table_markdown",
           "visible_devices", "visible_devices_env"]

log = logging.getLogger(__name__)

PlatformKind = Literal["cpu", "cuda", "rocm"]
PLATFORM_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm")

# The preset table: (name, value on CUDA, value on ROCm, why); None = not set there; CPU has
# none. Sources: slime's actor and engine environments, verl's Ray runtime env, SGLang's ROCm
# image, AMD's MI300X tuning guide.
_PRESET_ROWS: tuple[tuple[str, str | None, str | None, str], ...] = (
    ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1", None, "Ray leaves CUDA_VISIBLE_DEVICES "
     "alone: engines and trainer ranks address physical GPU ids (`base_gpu_id`, local rank) "
     "(slime, OpenRLHF)."),
    ("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", None, "1", "The same for "
     "HIP_VISIBLE_DEVICES, which current Ray sets for AMD GPUs (slime's AMD guide: must be 1)."),
    ("RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES", None, "1", "The same for "
     "ROCR_VISIBLE_DEVICES, which older Ray releases set instead."),
    ("NCCL_CUMEM_ENABLE", "0", "0", "SGLang sets it to 0 in its own processes; trainer ranks "
     "joining the weight-update group must match or the broadcast fails (slime)."),
    ("TORCH_NCCL_AVOID_RECORD_STREAMS", "1", "1", "Async collectives free their buffers at "
     "wait() instead of through recordStream, so FSDP2 memory does not creep."),
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1", "1", "One hardware queue keeps Megatron's TP/SP "
     "communication ahead of the GEMM it overlaps; megatron-core warns without it (verl, slime; "
     "on AMD too)."),
    ("HSA_NO_SCRATCH_RECLAIM", None, "1", "Scratch memory stays with its queue instead of being "
     "reclaimed; RCCL needs it on ROCm 7.1+ (SGLang and vLLM ROCm images)."),
    ("HIP_FORCE_DEV_KERNARG", None, "1", "Kernel arguments in device memory: lower launch "
     "latency (AMD MI300X tuning guide, SGLang's ROCm image)."),
    ("NCCL_MIN_NCHANNELS", None, "112", "More RCCL channels, so all-reduce uses the whole xGMI "
     "mesh of an 8-GPU MI300X/MI355X node (SGLang's ROCm image)."),
    ("TORCH_NCCL_HIGH_PRIORITY", None, "1", "RCCL collectives on high-priority streams so they "
     "overlap compute (AMD's Megatron recipes)."),
    ("SGLANG_USE_AITER", None, "1", "SGLang uses AMD's AITER kernels (attention, MoE, GEMM) on "
     "Instinct GPUs; remove it (`null`) on Radeon."),
    ("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "true", "true", "Colocated placement: the memory saver "
     "also releases graph memory while the trainer runs (slime)."),
    ("SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK", "true", "true", "Colocated trainer memory "
     "makes free memory differ across an engine's TP ranks; SGLang would refuse to start "
     "(slime)."),
    ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "false", "false", "The same switch under the "
     "name newer SGLang releases read."),
    ("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "false", None, "Skip DeepGEMM's ahead-of-time kernel "
     "compile (minutes per engine start); kernels compile on first use (slime)."),
)

PLATFORM_ENV_PRESETS: dict[str, dict[str, str]] = {
    kind: {name: values[i] for name, *values, _ in _PRESET_ROWS if values[i] is not None}
    for i, kind in enumerate(("cuda", "rocm"))
}
"""Per-platform environment presets (``cuda``, ``rocm``; the CPU platform has none)."""

PRESET_REASONS: dict[str, str] = {name: reason for name, _, _, reason in _PRESET_ROWS}
"""Why each preset variable is set, one line per variable."""

# Which variables select devices on each platform. On ROCm the HIP runtime honours both
# HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES; they must agree, so both are set.
_VISIBLE_DEVICE_VARS: dict[str, tuple[str, ...]] = {
    "cpu": (), "cuda": ("CUDA_VISIBLE_DEVICES",),
    "rocm": ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}


def _check_kind(kind: str) -> None:
    if kind not in PLATFORM_KINDS:
        raise ValueError(f"platform={kind!r}; allowed values: {list(PLATFORM_KINDS)}")


def visible_devices_env(kind: PlatformKind, devices: Sequence[int] | str) -> dict[str, str]:
    """The device-selection variables that restrict a process on ``kind`` to ``devices`` (a
    list of physical ids or a comma-separated string); on ROCm both ``HIP_VISIBLE_DEVICES``
    and ``CUDA_VISIBLE_DEVICES``, to the same value."""
    _check_kind(kind)
    if kind == "cpu":
        raise ValueError("platform=cpu has no devices to select; drop visible_devices")
    value = (devices.replace(" ", "") if isinstance(devices, str)
             else ",".join(str(int(d)) for d in devices))
    return {var: value for var in _VISIBLE_DEVICE_VARS[kind]}


def visible_devices(kind: PlatformKind, env: Mapping[str, str] | None = None) -> str | None:
    """The device selection in effect on ``kind`` (``None``: every device is visible).
    Raises ``ValueError`` when ROCm's two selection variables are both set and disagree."""
    _check_kind(kind)
    env = os.environ if env is None else env
    values = {var: env[var] for var in _VISIBLE_DEVICE_VARS[kind] if var in env}
    if len(set(values.values())) > 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ValueError(f"{shown} disagree; on ROCm HIP honours both, so set them to the same "
                         "ids (or unset CUDA_VISIBLE_DEVICES)")
    return next(iter(values.values()), None)


def platform_env(
    kind: PlatformKind, overrides: Mapping[str, str | None] | None = None, *,
    visible_devices: Sequence[int] | str | None = None, environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment variables a process on ``kind`` gets, as a new dict. Precedence, lowest
    first: presets; what ``environ`` already sets (``None``: ignore the environment); the device
    selection for ``visible_devices``; ``overrides`` (``cluster.env``; ``None`` removes)."""
    _check_kind(kind)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"platform_env overrides must be a mapping of name -> str | None, got "
                        f"{type(overrides).__name__}; pass device ids as visible_devices=")
    env = dict(PLATFORM_ENV_PRESETS.get(kind, {}))
    if environ is not None:
        env = {k: v for k, v in env.items() if k not in environ}
    if visible_devices is not None:
        env.update(visible_devices_env(kind, visible_devices))
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        elif isinstance(value, str):
            env[name] = value
        else:
            raise TypeError(f"cluster.env.{name} must be a string or null, got {value!r}; "
                            "quote it in YAML (e.g. '1')")
    visible = {var: env[var] for var in _VISIBLE_DEVICE_VARS[kind] if var in env}
    if len(set(visible.values())) > 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in visible.items())
        raise ValueError(
            f"{shown} disagree after cluster.env overrides; on ROCm set both to the same ids")
    return env


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator as torch sees it (index is torch's, after visible-devices)."""

    index: int
    name: str
    total_memory_bytes: int
    arch: str | None = None  # gfx942 on MI300X; sm_90 on H100

    @property
    def total_memory_gib(self) -> float:
        return self.total_memory_bytes / 2**30


@dataclass(frozen=True)
class PlatformInfo:
    """What :func:`detect_platform` found."""

    kind: PlatformKind
    devices: tuple[DeviceInfo, ...] = ()
    torch_version: str | None = None
    cuda_version: str | None = None  # torch.version.cuda: the CUDA torch was built with
    hip_version: str | None = None  # torch.version.hip: the HIP/ROCm torch was built with
    driver_version: str | None = None
    visible_devices: str | None = None
    collective_backend: str = "gloo"  # torch's name; "nccl" is RCCL on ROCm
    cpu_count: int = 1
    python_version: str = field(default_factory=lambda: ".".join(map(str, sys.version_info[:3])))
    notes: tuple[str, ...] = ()

    @property
    def device_count(self) -> int:
        return len(self.devices)

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    @property
    def memory_per_device_bytes(self) -> list[int]:
        return [d.total_memory_bytes for d in self.devices]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``grpoflow doctor --json``)."""
        return {**asdict(self), "devices": [asdict(d) for d in self.devices],
                "device_count": self.device_count, "notes": list(self.notes)}

    def summary(self) -> str:
        """One line for people: ``rocm: 8 x AMD Instinct MI300X (192 GiB), HIP 6.4 ...``."""
        if not self.devices:
            head = f"{self.kind}: no GPU, {self.cpu_count} CPUs"
        else:
            names = sorted(set(self.device_names))
            mem = sorted({round(d.total_memory_gib) for d in self.devices})
            head = (f"{self.kind}: {self.device_count} x {', '.join(names)} "
                    f"({'/'.join(str(m) for m in mem)} GiB each), {self.cpu_count} CPUs")
        toolkit = (f"HIP {self.hip_version}" if self.hip_version
                   else self.cuda_version and f"CUDA {self.cuda_version}")
        parts = [head, self.torch_version and f"torch {self.torch_version}", toolkit,
                 self.driver_version and f"driver {self.driver_version}"]
        return ", ".join(p for p in parts if p)


# Files that name the kernel driver's version without starting anything.
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")
AMDGPU_DRIVER_FILE = Path("/sys/module/amdgpu/version")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _driver_version(kind: str) -> str | None:
    """The kernel driver's version from a file (``None`` where there is none)."""
    try:
        if kind == "cuda":
            # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..."
            text = NVIDIA_DRIVER_FILE.read_text(errors="replace")
            for token in text.split("Kernel Module", 1)[-1].split():
                if token[:1].isdigit():
                    return token
        elif kind == "rocm":
            return AMDGPU_DRIVER_FILE.read_text(errors="replace").strip() or None
    except OSError:
        return None
    return None


def _device_info(torch: Any, index: int, kind: str) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    arch = getattr(props, "gcnArchName", None) if kind == "rocm" else None
    if arch:
        arch = str(arch).split(":", 1)[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
    elif kind == "cuda" and hasattr(props, "major"):
        arch = f"sm_{props.major}{props.minor}"
    return DeviceInfo(index=index, name=str(getattr(props, "name", f"device {index}")),
                      total_memory_bytes=int(getattr(props, "total_memory", 0)), arch=arch or None)


def detect_platform() -> PlatformInfo:
    """Detect CPU, CUDA or ROCm, and the devices this process can see: torch built with HIP and a
    visible device is ``rocm``, with CUDA and a visible device ``cuda``, anything else ``cpu`` with
    a note saying why."""
    cpus = _cpu_count()
    try:
        import torch
    except ImportError as exc:
        return PlatformInfo(kind="cpu", cpu_count=cpus, notes=(f"torch does not import: {exc}",))

    hip = getattr(torch.version, "hip", None) or None
    cuda = getattr(torch.version, "cuda", None) or None
    build = "rocm" if hip else "cuda" if cuda else "cpu"
    notes: list[str] = []
    kind: str = "cpu"
    devices: tuple[DeviceInfo, ...] = ()
    if build != "cpu":
        try:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception as exc:  # a broken driver raises here, not at import
            count = 0
            notes.append(f"torch.cuda failed: {type(exc).__name__}: {exc}")
        if count:
            kind = build
            devices = tuple(_device_info(torch, i, kind) for i in range(count))
        else:
            var = "HIP_VISIBLE_DEVICES" if build == "rocm" else "CUDA_VISIBLE_DEVICES"
            notes.append(f"torch is a {build.upper()} build but sees no GPU (check the driver, "
                         f"{var}" + (", /dev/kfd permissions" if build == "rocm" else "") + ")")
    visible: str | None
    try:
        visible = visible_devices(kind)  # type: ignore[arg-type]
    except ValueError as exc:
        visible = None
        notes.append(str(exc))
    backend = "gloo"
    if kind != "cpu":
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_nccl_available():
                backend = "nccl"
        except Exception:  # pragma: no cover - torch without distributed
            pass
    info = PlatformInfo(
        kind=kind, devices=devices, torch_version=str(torch.__version__),  # type: ignore[arg-type]
        cuda_version=None if hip else cuda, hip_version=hip, driver_version=_driver_version(kind),
        visible_devices=visible, collective_backend=backend, cpu_count=cpus, notes=tuple(notes))
    log.debug("detected platform: %s", info.summary())
    return info


def preset_table_markdown() -> str:
    """The preset table as Markdown, exactly as ``docs/platforms.md`` carries it."""
    lines = ["| variable | CUDA | ROCm | why |", "|---|---|---|---|"]
    for name, cuda, rocm, reason in _PRESET_ROWS:
        cells = [f"`{v}`" if v is not None else "—" for v in (cuda, rocm)]
        lines.append(f"| `{name}` | {cells[0]} | {cells[1]} | {reason} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m rl_core.cluster.platform [--markdown]``: the platform, or the table."""
    argv = sys.argv[1:] if argv is None else argv
    if "--markdown" in argv:
        print(preset_table_markdown())
        return 0
    import json

    print(json.dumps(detect_platform().to_dict(), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
