"""``grpoflow doctor [CONFIG] [overrides] [--json]``: what this machine has, and what the
config still needs, with the fix for each.

One ``ok`` / ``warn`` / ``missing`` row per check (docs/platforms.md, 'grpoflow doctor'); a row
the config does not need never fails. Exit 0, 1 when something it needs is missing, 2 for a
config that does not load. Never prints a secret; every network probe is one logged GET bounded
by :data:`PROBE_TIMEOUT_S`; never starts Ray, an engine or a server, and never imports Prefect
or heavy packages here (a bounded child process tries each import).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rl_core.secrets import redact_url

__all__ = ["Check", "Probe", "main", "run_checks"]

log = logging.getLogger("grpoflow.doctor")

Status = Literal["ok", "warn", "missing"]

PROBE_TIMEOUT_S = 2.0  # every network probe, connect to last byte
IMPORT_TIMEOUT_S = 60.0  # importing sglang in a child process can take this long on a GPU box

# The fixes, in one place (the pip extras are defined in pyproject.toml).
FIX_RAY = "pip install -e '.[ray]'"
FIX_SGLANG = "on a CUDA or ROCm machine: pip install -e '.[sglang]' (GPU images only)"
FIX_MEGATRON = "pip install -e '.[megatron]' (megatron-core 0.16.1; CPU, CUDA or ROCm)"
FIX_ROUTER = "pip install -e . (sglang-router is a core dependency)"


@dataclass
class Check:
    """One row of the report."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    needed: bool = True  # does this config need it? a needed `missing` row fails the check


@dataclass
class Probe:
    """One bounded HTTP GET (the URL as printed: no user-info, no query)."""

    url: str
    ok: bool
    status_code: int | None
    error: str | None
    seconds: float

    def describe(self) -> str:
        if self.ok:
            return f"{self.url} answered HTTP {self.status_code} in {self.seconds:.2f}s"
        return f"{self.url}: {self.error} after {self.seconds:.2f}s"


# ------------------------------------------------------------------------ helpers


def mask(value: str) -> str:
    """A key id shown by its last 4 characters only."""
    return "****" + value[-4:] if len(value) > 8 else "****"


def _is_set(name: str) -> bool:
    return bool(os.environ.get(name))


def probe_http(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """GET ``url``; any HTTP answer counts as reachable. Bounded by ``timeout_s`` in total."""
    import httpx

    result: dict[str, Any] = {}

    def get() -> None:
        try:
            resp = httpx.get(url, timeout=httpx.Timeout(timeout_s), follow_redirects=False)
            result["status"] = resp.status_code
        except Exception as exc:  # any failure is "unreachable"; the type says which
            result["error"] = type(exc).__name__

    t0 = time.monotonic()
    worker = threading.Thread(target=get, name="doctor-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    seconds, status = time.monotonic() - t0, result.get("status")
    error = None if status else result.get("error") or f"no answer within {timeout_s:g}s"
    probe = Probe(redact_url(url), status is not None, status, error, seconds)
    log.info("doctor: probe GET %s", probe.describe())
    return probe


@functools.cache
def import_probe(module: str, dist: str) -> tuple[bool, str]:
    """Whether ``module`` imports (tried in a child process, bounded) and its version; once
    per process (each probe is a Python start-up plus the import: seconds of CPU)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False, "not installed"
    except (ImportError, ValueError):  # a missing parent package raises
        return False, "not installed"
    code = (f"import importlib, importlib.metadata as md\nm = importlib.import_module({module!r})"
            f"\nprint(getattr(m, '__version__', None) or md.version({dist!r}))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=IMPORT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"installed, but `import {module}` took over {IMPORT_TIMEOUT_S:.0f}s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"installed, but `import {module}` fails: {last[:200]}"
    return True, (out.stdout.strip().splitlines() or ["?"])[-1]


def _optional(name: str, ok: bool, version: str, needed: bool, why_needed: str,
              why_not: str, fix: str) -> Check:
    """The row of an importable package: ok, or missing with why (not) needed and the fix."""
    if ok:
        return Check(name, "ok", f"{name} {version}")
    why = why_needed if needed else f"not needed: {why_not}"
    return Check(name, "missing", f"{version} ({why})", fix, needed=needed)


# ------------------------------------------------------------------------- checks


def check_python() -> list[Check]:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] == (3, 11):
        return [Check("python", "ok", f"{version} ({sys.executable})")]
    return [Check("python", "warn", f"{version}; grpoflow is built and tested on 3.11",
                  "use Python 3.11 (requires-python in pyproject.toml)")]


def check_platform(cfg: Any, info: Any) -> list[Check]:
    from rl_core.cluster.platform import visible_devices

    if info.torch_version is None:
        rows = [Check("torch", "missing", "; ".join(info.notes) or "not installed",
                      "pip install torch (the CPU wheel here, the CUDA or ROCm wheel on GPUs), "
                      "then pip install -e .")]
    else:
        build = (f"HIP {info.hip_version}" if info.hip_version else
                 f"CUDA {info.cuda_version}" if info.cuda_version else "CPU")
        rows = [Check("torch", "ok", f"{info.torch_version} ({build} build)")]
    wants_gpu = [reason for reason, on in (
        ("rollout.engine=sglang", cfg.rollout.engine == "sglang"),
        ("train.backend=megatron", cfg.train.backend == "megatron"),
    ) if on]
    backend = info.collective_backend + (" (RCCL)" if info.kind == "rocm" else "")
    detail = f"{info.summary()}; collectives: {backend}" + "".join(f"; {n}" for n in info.notes)
    if wants_gpu and info.kind == "cpu":
        rows.append(Check("platform", "missing",
                          f"{detail}; {' and '.join(wants_gpu)} need a CUDA or ROCm GPU",
                          "run on a CUDA or ROCm machine, or set rollout.engine=embedded "
                          "train.backend=torch"))
    else:
        rows.append(Check("platform", "warn" if info.notes else "ok", detail,
                          needed=not info.notes))
    for dev in info.devices:
        arch = f", {dev.arch}" if dev.arch else ""
        rows.append(Check(f"gpu {dev.index}", "ok",
                          f"{dev.name}, {dev.total_memory_gib:.1f} GiB{arch}"))
    if info.kind != "cpu":
        var = "HIP_VISIBLE_DEVICES" if info.kind == "rocm" else "CUDA_VISIBLE_DEVICES"
        try:
            selected = visible_devices(info.kind)
        except ValueError as exc:
            rows.append(Check("visible devices", "missing", str(exc),
                              "export HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES with the "
                              "same ids, or unset CUDA_VISIBLE_DEVICES"))
        else:
            shown = f"{var}={selected}" if selected is not None else f"all ({var} not set)"
            rows.append(Check("visible devices", "ok", f"{shown}; Ray is told not to rewrite it "
                              "(RAY_EXPERIMENTAL_NOSET_*)"))
    return rows


def check_env_presets(cfg: Any, info: Any) -> list[Check]:
    from rl_core.cluster.platform import PLATFORM_ENV_PRESETS, platform_env

    overrides = getattr(cfg.cluster, "env", None) or {}
    presets = PLATFORM_ENV_PRESETS.get(info.kind, {})
    try:
        env = platform_env(info.kind, overrides, environ=os.environ)
    except (TypeError, ValueError) as exc:
        return [Check("env presets", "missing", str(exc), "fix cluster.env in the config")]
    parts = [f"{info.kind}: {len(env)} variables for every actor"
             + (f" ({len(presets)} presets; docs/platforms.md)" if presets else " (no presets)")]
    kept = sorted(k for k in presets if k in os.environ)
    # names only: cluster.env may carry tokens
    set_names = sorted(k for k, v in overrides.items() if v is not None)
    removed = sorted(k for k, v in overrides.items() if v is None)
    for label, names in (("your environment keeps its own", kept), ("cluster.env sets", set_names),
                         ("cluster.env removes", removed)):
        if names:
            parts.append(f"{label} {', '.join(names)}")
    return [Check("env presets", "ok", "; ".join(parts))]


def check_ray(cfg: Any) -> list[Check]:
    address = cfg.cluster.address
    ok, version = import_probe("ray", "ray")
    row = _optional("ray", ok, version, bool(address), "cluster.address is set",
                    "cluster.mode=local", FIX_RAY)
    if ok and address:
        row.detail += f"; cluster.address={address}"
    return [row]


def check_sglang(cfg: Any, info: Any) -> list[Check]:
    engine = cfg.rollout.engine
    needed = engine == "sglang"
    not_why = f"rollout.engine={engine}" + ("; on CPU the embedded engine is used"
                                            if info.kind == "cpu" else "")
    fix = FIX_SGLANG + (", or set rollout.engine=embedded" if needed else "")
    rows = [_optional("sglang", *import_probe("sglang", "sglang"), needed,
                      "rollout.engine=sglang", not_why, fix)]
    wanted = getattr(cfg.rollout, "sglang_platform", None)
    if needed and info.kind != "cpu" and wanted not in (None, info.kind):
        rows.append(Check("sglang platform", "warn", f"rollout.sglang_platform={wanted} but this "
                          f"machine is {info.kind}", f"rollout.sglang_platform={info.kind}"))
    # rl_core.rollout.router runs `python -m sglang_router.launch_router` with this Python.
    try:
        has_router = importlib.util.find_spec("sglang_router.launch_router") is not None
    except ImportError:
        has_router = False
    router, engines = getattr(cfg.rollout, "router", None), getattr(cfg.rollout, "num_engines", 1)
    router_needed = engine != "local" and (router or (router is None and engines > 1))
    if has_router:
        try:
            version = importlib.metadata.version("sglang-router")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        rows.append(Check("sglang-router", "ok", f"sglang-router {version} "
                          f"({Path(sys.executable).name} -m sglang_router.launch_router)"))
    else:
        why = (f"rollout.engine={engine} with {engines} engine(s)" if router_needed
               else "not needed: one engine or rollout.engine=local")
        rows.append(Check("sglang-router", "missing", f"not installed ({why})", FIX_ROUTER,
                          router_needed))
    return rows


def check_megatron(cfg: Any) -> list[Check]:
    needed = cfg.train.backend == "megatron"
    fix = FIX_MEGATRON + (", or set train.backend=torch" if needed else "")
    return [_optional("megatron-core", *import_probe("megatron.core", "megatron-core"), needed,
                      "train.backend=megatron", f"train.backend={cfg.train.backend}", fix)]


def check_mlflow(cfg: Any) -> tuple[list[Check], list[Probe]]:
    needed = cfg.tracking.backend == "mlflow"
    uri_env = os.environ.get("MLFLOW_TRACKING_URI")
    uri = uri_env or cfg.tracking.uri
    source = "MLFLOW_TRACKING_URI" if uri_env else "tracking.uri"
    if not needed and not uri:
        return [Check("mlflow", "ok", "not used (tracking.backend=none)", needed=False)], []
    row = _optional("mlflow", *import_probe("mlflow", "mlflow"), needed,
                    "tracking.backend=mlflow", "tracking.backend=none", "pip install mlflow")
    row.needed = needed
    rows, probes = [row], []
    auth = [n for n in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME") if _is_set(n)]
    auth_note = f"; auth: {', '.join(auth)} set" if auth else ""
    if not uri:
        rows.append(Check("mlflow server", "ok", "none: a local store under the run directory"))
    elif urlsplit(uri).scheme in ("http", "https"):
        probe = probe_http(uri)
        probes.append(probe)
        where = f"{probe.describe()} ({source})"
        if probe.ok and (probe.status_code or 0) < 500:
            rows.append(Check("mlflow server", "ok", where + auth_note))
        elif probe.ok:
            rows.append(Check("mlflow server", "warn", f"{where}: the server answers with an "
                              "error", "check the MLflow server's log", needed=needed))
        else:
            rows.append(Check("mlflow server", "missing", where, "start the server (mlflow "
                              "server --host 127.0.0.1 --port 5000 --workers 1) or fix "
                              f"{source}", needed=needed))
    else:
        rows.append(Check("mlflow server", "ok",
                          f"{redact_url(uri)} ({source}): not HTTP, no probe"))
    return rows, probes


_S3_FIELDS = ("storage.root", "data.source", "data.eval_source", "model.path", "checkpoint.uri")


def s3_fields(cfg: Any) -> list[str]:
    """The config fields that name an ``s3://`` location."""
    def value(field: str) -> str:
        section, name = field.split(".")
        return str(getattr(getattr(cfg, section), name) or "")

    return [field for field in _S3_FIELDS if value(field).startswith("s3://")]


def check_s3(cfg: Any) -> tuple[list[Check], list[Probe]]:
    fields = s3_fields(cfg)
    needed = bool(fields)
    env_name = next((n for n in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if _is_set(n)), None)
    if not fields and env_name is None:
        return [Check("s3", "ok", "not used (no s3:// in the config, no AWS_ENDPOINT_URL)")], []
    why = f"used by {', '.join(fields)}" if fields else "not needed: no s3:// in the config"
    ok, version = import_probe("boto3", "boto3")
    rows = [Check("boto3", "ok", f"boto3 {version} ({why})") if ok else
            Check("boto3", "missing", f"{version} ({why})", "pip install boto3", needed=needed)]

    # Credentials: whether they are set, never their values.
    key_id = os.environ.get("AWS_ACCESS_KEY_ID", "")
    has_secret = _is_set("AWS_SECRET_ACCESS_KEY")
    creds_file = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
                      or Path.home() / ".aws" / "credentials")
    notes = [f"AWS_ACCESS_KEY_ID {mask(key_id) if key_id else 'not set'}",
             f"AWS_SECRET_ACCESS_KEY {'set' if has_secret else 'not set'}"]
    if _is_set("AWS_SESSION_TOKEN"):
        notes.append("AWS_SESSION_TOKEN set")
    if _is_set("AWS_PROFILE"):
        notes.append(f"AWS_PROFILE={os.environ['AWS_PROFILE']}")
    if creds_file.is_file():
        notes.append(f"{creds_file} exists")
    role = [n for n in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") if _is_set(n)]
    if role:
        notes.append(f"{', '.join(role)} set")
    detail = "; ".join(notes)
    if bool(key_id) != has_secret:
        rows.append(Check("s3 credentials", "missing", detail, "export both AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY (or neither)", needed=needed))
    elif key_id or _is_set("AWS_PROFILE") or creds_file.is_file() or role:
        rows.append(Check("s3 credentials", "ok", detail))
    else:
        rows.append(Check("s3 credentials", "warn", f"{detail}; none found (an instance role may "
                          "still supply them)", "export AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, or set AWS_PROFILE", needed=False))

    if env_name is not None:
        endpoint, source = os.environ[env_name], env_name
        fix = "start the store or fix AWS_ENDPOINT_URL (e.g. http://127.0.0.1:9000 for MinIO)"
    else:
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        endpoint = f"https://s3.{region}.amazonaws.com" if region else "https://s3.amazonaws.com"
        source = "AWS default"
        fix = ("check this machine's route to AWS S3, or set AWS_ENDPOINT_URL for an "
               "S3-compatible store")
    probe = probe_http(endpoint)
    rows.append(Check("s3 endpoint", "ok", f"{probe.describe()} ({source})") if probe.ok else
                Check("s3 endpoint", "missing", f"{probe.describe()} ({source})", fix,
                      needed=needed))
    return rows, [probe]


def check_model(cfg: Any) -> tuple[list[Check], list[Probe]]:
    path, cache = cfg.model.path, Path(cfg.storage.cache_dir)
    if path == "embedded:tiny":
        built = len(list((cache / "models").glob("tiny-*/grpoflow_tiny.json")))
        return [Check("model", "ok", "embedded:tiny: built on this machine on first use (grpoflow "
                      f"bootstrap-model); {built} build(s) cached under {cache / 'models'}")], []
    if path.startswith("s3://"):
        return [Check("model", "ok", f"{path}: in S3 (see the s3 rows)")], []
    local = Path(path).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return [Check("model", "ok", f"{local}: a local HF directory")], []
        return [Check("model", "missing", f"{local} has no config.json",
                      "point model.path at a Hugging Face model directory")], []
    if local.exists() or path.startswith(("/", ".", "~")) or path.count("/") != 1:
        return [Check("model", "missing", f"model.path={path!r} is neither a directory nor a hub "
                      "id (org/name)", "set model.path to an HF directory, a hub id, or "
                      "embedded:tiny")], []
    token = "HF_TOKEN set" if _is_set("HF_TOKEN") else "HF_TOKEN not set"
    snapshots = cache / "models" / "hf" / path.replace("/", "--") / "snapshots"
    cached = list(snapshots.glob("*/grpoflow_manifest.json"))
    if cached:
        return [Check("model", "ok", f"{path}: cached in {cached[0].parent}")], []
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return [Check("model", "missing", f"{path}: not cached and HF_HUB_OFFLINE is set",
                      "run grpoflow download-model where the hub is reachable, or set "
                      "model.path to a local copy")], []
    probe = probe_http(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if probe.ok:
        return [Check("model", "ok", f"{path}: not cached yet, downloaded on first use; "
                      f"{probe.describe()}; {token}")], [probe]
    return [Check("model", "missing", f"{path}: not cached and the hub is unreachable "
                  f"({probe.describe()}); {token}", "set HF_ENDPOINT to a reachable mirror, or "
                  "download the model elsewhere and set model.path to the directory")], [probe]


def check_disk(cfg: Any) -> list[Check]:
    root, where = cfg.storage.root, "storage.root"
    if root.startswith("s3://"):
        root, where = cfg.storage.cache_dir, "storage.cache_dir; storage.root is in S3"
    path = Path(root).expanduser().resolve()
    probe = next(p for p in (path, *path.parents) if p.exists())
    try:
        usage = shutil.disk_usage(probe)
    except OSError as exc:
        return [Check("disk", "warn", f"{path}: {exc}", needed=False)]
    free_gib, want_gib = usage.free / 2**30, 1.0 if cfg.model.path == "embedded:tiny" else 20.0
    detail = f"{free_gib:.1f} GiB free of {usage.total / 2**30:.1f} GiB under {path} ({where})"
    if free_gib < want_gib:
        return [Check("disk", "warn", f"{detail}; under {want_gib:g} GiB, checkpoints may not fit",
                      f"free space there or point {where.split(';')[0]} at a larger volume",
                      needed=False)]
    return [Check("disk", "ok", detail)]


def check_threads(cfg: Any, info: Any) -> list[Check]:
    cpus, threads = info.cpu_count, cfg.train.num_threads
    omp = os.environ.get("OMP_NUM_THREADS")
    omp_note = f"; OMP_NUM_THREADS={omp}" if omp else ""
    if threads is None:
        return [Check("cpu threads", "ok", f"{cpus} CPUs; train.num_threads unset (torch's "
                      f"default){omp_note}; set it when engines and trainer share the CPUs")]
    if threads > cpus:
        return [Check("cpu threads", "warn", f"train.num_threads={threads} but only {cpus} CPUs "
                      f"are usable{omp_note}: oversubscribed", f"train.num_threads={cpus}",
                      needed=False)]
    return [Check("cpu threads", "ok", f"train.num_threads={threads} of {cpus} CPUs{omp_note}")]


VALIDATE_TIMEOUT_S = 180.0


def check_config(config: str | None, overrides: list[str]) -> list[Check]:
    """``grpoflow validate``'s checks (data rows, prompts, reward, planes), in a bounded child
    process (they import torch and transformers): one row each, a failure a needed miss."""
    cmd = [sys.executable, "-m", "rl_core.validate", *([config] if config else []), *overrides]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=VALIDATE_TIMEOUT_S)
        findings = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return [Check("config", "warn", f"grpoflow validate did not finish within "
                      f"{VALIDATE_TIMEOUT_S:.0f}s", "run `grpoflow validate CONFIG` alone")]
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [Check("config", "missing", f"grpoflow validate failed: {tail}",
                       "run `grpoflow validate CONFIG` for the whole message")]
    status = {"ok": "ok", "warn": "warn", "fail": "missing"}
    return [Check(f"config: {f['what']}", status[f["status"]], f["detail"])  # type: ignore[arg-type]
            for f in findings if f["what"] != "time"]


def run_checks(cfg: Any) -> tuple[list[Check], list[Probe], Any]:
    """Every check for ``cfg``: (rows, network probes, the detected platform)."""
    from rl_core.cluster.platform import detect_platform

    info = detect_platform()
    rows = [*check_python(), *check_platform(cfg, info), *check_env_presets(cfg, info),
            *check_ray(cfg), *check_sglang(cfg, info), *check_megatron(cfg)]
    probes: list[Probe] = []
    for check in (check_mlflow, check_s3, check_model):
        more, done = check(cfg)
        rows += more
        probes += done
    return [*rows, *check_disk(cfg), *check_threads(cfg, info)], probes, info


# ------------------------------------------------------------------------- output


def failed(rows: list[Check]) -> list[Check]:
    """The rows that make the check fail: needed and missing."""
    return [r for r in rows if r.status == "missing" and r.needed]


def format_report(origin: str, rows: list[Check]) -> str:
    width = max(len(r.name) for r in rows) + 2
    lines = [f"grpoflow doctor: {origin}"]
    for r in rows:
        status = r.status if r.needed or r.status == "ok" else f"{r.status}*"
        lines.append(f"  {status:<9}{r.name:<{width}}{r.detail}")
        if r.fix and r.status != "ok":
            lines.append(f"  {'':<9}{'':<{width}}fix: {r.fix}")
    optional = [r for r in rows if r.status == "missing" and not r.needed]
    warns = [r for r in rows if r.status == "warn"]
    tail = [f"{len(optional)} optional item(s) absent"] if optional else []
    tail += [f"{len(warns)} warning(s)"] if warns else []
    if optional or any(not r.needed for r in warns):
        tail.append("* = not needed by this config")
    extra = f" ({'; '.join(tail)})" if tail else ""
    if bad := failed(rows):
        lines.append(f"not ready: this config needs {len(bad)} missing item(s): "
                     f"{', '.join(r.name for r in bad)}{extra}")
    else:
        lines.append(f"ready: nothing this config needs is missing{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``grpoflow doctor [CONFIG] [section.key=value ...] [--json]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="grpoflow doctor", description="What this machine "
                                     "has, and what the config still needs.")
    parser.add_argument("config", nargs="?", help="YAML config (e.g. configs/tiny-cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: rollout.engine=sglang")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    config, overrides = args.config, [*args.overrides, *extra]
    if config and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None

    from rl_core.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        print(f"grpoflow doctor: {exc}", file=sys.stderr)
        return 2
    origin = config or "built-in defaults"
    if overrides:  # a URL in an override may carry a password
        origin += " + " + " ".join(o if "://" not in o else o.split("=", 1)[0] + "="
                                   + redact_url(o.split("=", 1)[1]) for o in overrides)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        rows, probes, info = run_checks(cfg)
        if config:  # the config's own checks, as `grpoflow validate` makes them
            rows += check_config(config, overrides)
    finally:
        log.removeHandler(handler)
    ready = not failed(rows)
    if args.json:
        print(json.dumps({"config": origin, "ready": ready, "platform": info.to_dict(),
                          "checks": [asdict(r) for r in rows],
                          "probes": [asdict(p) for p in probes]}, indent=2))
    else:
        print(format_report(origin, rows))
    return 0 if ready else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
