"""Launching rollout servers: command lines, environments and the process helpers.

``embedded_engine_command`` starts ``python -m rl_core.engine.server`` tied to this process's
life; ``build_sglang_command`` makes ``python -m sglang.launch_server ...`` with the platform's
environment presets (docs/gpu.md, "How grpoflow starts the SGLang engines"). The process
helpers start every server in its own session, so stopping one stops its children. Never
imports sglang (this module must import on a CPU laptop); binds only the configured host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from rl_core.cluster.platform import PLATFORM_ENV_PRESETS, platform_env
from rl_core.host import pid_alive

EngineCommand = Callable[[int, int], Sequence[str]]
"""``command(index, port)``: the argv that serves engine ``index`` on 127.0.0.1:``port``."""

__all__ = ["EngineCommand", "EngineSpec", "SGLangLaunchConfig", "build_sglang_command",
           "embedded_engine_command", "kill_process", "log_tail", "sglang_engine_command",
           "sglang_env", "sglang_launch", "start_process", "stop_process", "wait_healthy"]

log = logging.getLogger(__name__)

Platform = Literal["cuda", "rocm"]


@dataclass
class SGLangLaunchConfig:
    """What one SGLang server runs: model, parallelism, memory, address, platform."""

    model_path: str
    tp: int = 1
    dp: int = 1
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False
    base_gpu_id: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    trust_remote_code: bool = False
    enable_deterministic_inference: bool = False
    skip_server_warmup: bool = False
    extra_args: list[str] = field(default_factory=list)
    platform: Platform = "cuda"
    visible_devices: Sequence[int] | str | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be >= 1, got tp={self.tp}, dp={self.dp}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.platform not in PLATFORM_ENV_PRESETS:
            raise ValueError(
                f"platform={self.platform!r}; allowed values: {sorted(PLATFORM_ENV_PRESETS)}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_sglang_command(cfg: SGLangLaunchConfig) -> list[str]:
    """``python -m sglang.launch_server ...`` for ``cfg`` (flag spellings of SGLang's CLI)."""
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", str(cfg.model_path),
           "--tp-size", str(cfg.tp), "--dp-size", str(cfg.dp)]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    cmd += ["--base-gpu-id", str(cfg.base_gpu_id), "--host", cfg.host, "--port", str(cfg.port),
            "--dtype", cfg.dtype]
    for flag, on in (("--trust-remote-code", cfg.trust_remote_code),
                     ("--enable-deterministic-inference", cfg.enable_deterministic_inference),
                     ("--skip-server-warmup", cfg.skip_server_warmup)):
        if on:
            cmd.append(flag)
    return cmd + [str(a) for a in cfg.extra_args]


def sglang_engine_command(cfg: SGLangLaunchConfig) -> Callable[[int, int], list[str]]:
    """A command factory for :class:`~rl_core.rollout.pool.EnginePool`: engine ``i`` on
    ``port`` runs ``cfg`` on GPUs ``base_gpu_id + i * tp * dp`` onwards."""

    def command(index: int, port: int) -> list[str]:
        first_gpu = cfg.base_gpu_id + index * cfg.tp * cfg.dp
        return build_sglang_command(replace(cfg, port=port, base_gpu_id=first_gpu))

    return command


def sglang_env(cfg: SGLangLaunchConfig, base: Mapping[str, str] | None = None,
               overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The full environment for ``cfg``'s server: ``base`` (default ``os.environ``) +
    presets + ``overrides`` (``cluster.env``; ``None`` removes a variable)."""
    env = dict(os.environ if base is None else base)
    # torch_memory_saver installs its own allocator; a user allocator config fights it.
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(platform_env(cfg.platform, overrides, visible_devices=cfg.visible_devices))
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
    return env


def sglang_launch(cfg: Any, model_path: str | Path) -> SGLangLaunchConfig:
    """The SGLang server of ``rollout.engine: sglang`` for a run config."""
    r, lora = cfg.rollout, cfg.train.lora
    # LoRA (train.lora): adapters are loaded by name at each sync; rollout.max_loras_per_batch
    # of them (per-role adapters, docs/lora.md) share a running batch
    n = str(r.max_loras_per_batch)
    args = ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules",
            *lora.target_modules, "--max-loras-per-batch", n] if lora.enabled else []
    if cfg.train.moe.routing_replay:  # requests ask for every token's experts (routing replay)
        args.append("--enable-return-routed-experts")
    return SGLangLaunchConfig(
        model_path=str(model_path), tp=r.sglang_tp,
        mem_fraction_static=r.sglang_mem_fraction_static,
        enable_memory_saver=cfg.cluster.placement == "colocated",
        dtype="auto" if cfg.model.dtype == "float32" else cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code, extra_args=[*args, *r.sglang_extra_args],
        platform=r.sglang_platform,
    )


@dataclass(frozen=True)
class EngineSpec:
    """One plane's engines: what they serve and how each starts. The rollout plane, the
    teacher, the judge and teacher-sample generation each fill one from their config section;
    :meth:`command` is the one place an engine's argv and environment are made."""

    kind: Literal["embedded", "sglang"]
    model_path: str
    num_engines: int = 1
    threads: int = 1  # torch threads per embedded engine
    dtype: str = "float32"  # the embedded engine's dtype
    trust_remote_code: bool = False
    max_running_requests: int = 256
    sglang: SGLangLaunchConfig | None = None  # kind sglang: the server's settings
    env: Mapping[str, str | None] | None = None  # cluster.env (None removes a variable)
    device: str = "cpu"  # the embedded engine's: cpu, or cuda (engine i on GPU i mod count)
    gpus: int = 0  # GPUs this process sees, for cuda (0: each engine takes its device 0)
    prefix_cache_tokens: int = 0  # the embedded engine's prefix cache (0: off)
    max_loras_per_batch: int = 1  # the embedded engine's (rollout.max_loras_per_batch)

    def command(self) -> tuple[EngineCommand, dict[str, str]]:
        """``(command(index, port), environment)`` of this spec's engines."""
        if self.kind == "sglang":
            if self.sglang is None:
                raise ValueError(f"an sglang engine for {self.model_path} needs its launch config")
            return sglang_engine_command(self.sglang), sglang_env(self.sglang, overrides=self.env)
        command = embedded_engine_command(
            self.model_path, dtype=self.dtype, num_threads=self.threads,
            max_running_requests=self.max_running_requests,
            trust_remote_code=self.trust_remote_code, device=self.device, gpus=self.gpus,
            prefix_cache_tokens=self.prefix_cache_tokens,
            max_loras_per_batch=self.max_loras_per_batch)
        return command, {"OMP_NUM_THREADS": str(self.threads), **platform_env("cpu", self.env)}


def embedded_engine_command(
    model_path: str | Path, *, dtype: str = "float32", num_threads: int | None = None,
    max_running_requests: int = 256, max_total_tokens: int | None = None,
    trust_remote_code: bool = False, weight_sync_timeout_s: float | None = None,
    device: str = "cpu", gpus: int = 0, prefix_cache_tokens: int = 0,
    max_loras_per_batch: int = 1,
) -> EngineCommand:
    """``command(index, port)`` for the embedded engine, tied to this process's life
    (``--parent-pid``); ``weight_sync_timeout_s``: its bound on each weight-update collective;
    ``max_loras_per_batch``: LoRA adapters one running batch serves (1, the default: merged);
    ``device`` ``cuda``: engine ``index`` on GPU ``index % gpus`` (``gpus`` 0: its device 0,
    e.g. a Ray actor that sees only its own)."""
    if trust_remote_code:
        raise ValueError("the embedded engine does not run remote code; use rollout.engine=local")

    def command(index: int, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "rl_core.engine.server", "--model", str(model_path),
               "--port", str(port), "--dtype", dtype,
               "--max-running-requests", str(max_running_requests), "--log-level", "warning",
               "--parent-pid", str(os.getpid())]
        if device != "cpu":
            cmd += ["--device", f"{device}:{index % gpus}" if device == "cuda" and gpus else device]
        for flag, value in (("--num-threads", num_threads),
                            ("--max-total-tokens", max_total_tokens),
                            ("--weight-sync-timeout-s", weight_sync_timeout_s),
                            ("--prefix-cache-tokens", prefix_cache_tokens),
                            ("--max-loras-per-batch", max_loras_per_batch if
                             max_loras_per_batch != 1 else None)):
            if value:
                cmd += [flag, str(value)]
        return cmd

    return command


# ---------------------------------------------------------------------- process helpers


def start_process(cmd: Sequence[str], log_path: str | Path, *,
                  env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdout and stderr appended to ``log_path``."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=None if env is None else dict(env),
                                start_new_session=True)
    log.info("started pid %d: %s (log %s)", proc.pid, " ".join(cmd[:4]), log_path)
    _register(proc.pid)
    return proc


# Where a watcher of this process (grpoflow's reaper) wants the pids of what it starts: a
# process that rewrites its own command line and environment (sglang-router's title does)
# cannot be recognised by them after its parent is gone.
PIDS_ENV = "GRPOFLOW_STARTED_PIDS"


def _register(pid: int) -> None:
    path = os.environ.get(PIDS_ENV)
    if not path:
        return
    import psutil

    with contextlib.suppress(OSError, psutil.Error):
        started = psutil.Process(pid).create_time()  # the pid alone may be reused later
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:  # one short line in one write: lines from threads never interleave
            os.write(fd, f"{pid} {started}\n".encode())
        finally:
            os.close(fd)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """SIGTERM the process's session, SIGKILL it after ``timeout_s``; returns the exit code."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0fs; killing it", proc.pid, timeout_s)
    kill_process(proc, timeout_s)  # children may outlive a leader that exited on SIGTERM
    return proc.returncode


def kill_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL the process's session now (simulates a crash); wait up to ``timeout_s``."""
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # poll() first: a leader reaped behind the handle's back (a waitpid elsewhere) reads as
    # ended (ECHILD), not as running.
    if proc.poll() is not None and pid_alive(proc.pid):
        # The leader is reaped and its pid is another process's now, so the group is gone
        # (the kernel never reuses a pid still held as a group id): a killpg would hit the
        # new process's group (pid_max can be 32768; a test suite wraps it).
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            if proc.poll() is None:
                proc.send_signal(sig)


def log_tail(log_path: str | Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    if log_path is None:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(
    url: str, *, timeout_s: float, path: str = "/health_generate",
    proc: subprocess.Popen | None = None, log_path: str | Path | None = None,
    interval_s: float = 0.5, request_timeout_s: float = 30.0,
) -> float:
    """Poll ``url + path`` until it answers 200; returns the seconds waited. Raises
    ``RuntimeError`` (with the log's tail) if ``proc`` exits or ``timeout_s`` passes."""
    t0 = time.monotonic()
    deadline, last = t0 + timeout_s, "no answer yet"
    with httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=2.0)) as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server for {url} exited with code {proc.returncode} before "
                                   f"{path} answered; log {log_path}:\n{log_tail(log_path)}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"{url}{path} not healthy within {timeout_s:.0f}s (last: "
                                   f"{last}); log {log_path}:\n{log_tail(log_path)}")
            try:
                resp = http.get(url + path, timeout=min(request_timeout_s, max(remaining, 0.1)))
                if resp.status_code == 200:
                    waited = time.monotonic() - t0
                    log.info("%s%s healthy after %.1fs", url, path, waited)
                    return waited
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
