"""``grpoflow serve-tinker CONFIG``: the Tinker-compatible service on this machine.

The config (e.g. configs/tinker-tiny-cpu.yaml; dotted overrides as for every command):

* ``base_models``: served name -> model reference: ``embedded:tiny`` (the demo model, built
  once into ``cache_dir`` as ``grpoflow bootstrap-model`` builds it), a local Hugging Face
  directory, or a hub id (cached as ``grpoflow download-model`` caches it);
* ``host``, ``port`` (0: any free port), ``root`` (training runs and checkpoints);
* ``tenants``: tenant name -> the SHA-256 hex digests of its keys (never the keys:
  ``python -m grpoflow.tinker.serve hash-key`` reads a key and prints its digest, as
  ``printf %s "$KEY" | sha256sum`` does); a tenant's runs, checkpoints and requests are its own;
* ``api_keys`` and ``api_keys_env`` (the name of an environment variable holding
  comma-separated keys): more keys accepted, each ``tml-...``, each its own identity; no keys
  and no tenants: any ``tml-`` key;
* ``max_body_bytes`` (a larger request is answered 413), ``max_queued`` (a base model's queue,
  and a training client's requests waiting for an earlier one, beyond which 429);
* ``tracking``: MLflow lineage of every training client (:mod:`.lineage`): ``backend``
  (``mlflow`` or ``none``), ``uri`` (default ``MLFLOW_TRACKING_URI``, else the project store
  ``<storage_root>/mlflow.db`` as every grpoflow command uses), ``experiment``, ...;
* ``poll_timeout_s``, ``session_ttl_s``, ``startup_timeout_s``, ``log_level``.

Clients: ``tinker.ServiceClient(base_url="http://HOST:PORT", api_key="tml-...")``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rl_core.config.base import ConfigError, Section, read_config, validate_config

__all__ = ["TinkerServeConfig", "TinkerTrackingConfig", "api_keys_of", "build_app",
           "build_tracker", "load_serve_config", "resolve_models", "serve"]

log = logging.getLogger("grpoflow.tinker.serve")  # also as __main__ (supervised)

EXAMPLE = "configs/tinker-tiny-cpu.yaml"


class TinkerTrackingConfig(Section):
    """MLflow lineage of the service's training clients (grpoflow.tinker.lineage)."""

    backend: Literal["none", "mlflow"] = Field(
        "mlflow", description="`mlflow`: a run per training client; `none`: no tracking.")
    uri: str | None = Field(None, description="Tracking URI; default: MLFLOW_TRACKING_URI, "
                            "else sqlite:///<storage_root>/mlflow.db (the project store).")
    storage_root: str = Field("runs", description="The project's storage.root: where the "
                              "default store is, as for every grpoflow command.")
    experiment: str = Field("grpoflow-tinker", description="The MLflow experiment.")
    checkpoint_artifacts: bool = Field(True, description="Log each named checkpoint as the "
                                       "run's artifacts.")
    register_sampler_weights: bool = Field(
        True, description="Each named sampler-weights save: a version of the registered model "
        "tinker-<tenant>-<run> (needs checkpoint_artifacts).")
    flush_timeout_s: float = Field(10.0, ge=0, description="At shutdown, wait this long for "
                                   "queued records to reach MLflow.")


class TinkerServeConfig(Section):
    """``grpoflow serve-tinker``'s config (see the module docstring)."""

    base_models: dict[str, str] = Field(
        default_factory=lambda: {"grpoflow/tiny": "embedded:tiny"},
        description="Served name -> embedded:tiny, a local HF directory or a hub id.")
    host: str = Field("127.0.0.1", description="Address to bind (the default: this machine only; an interface address to serve others).")
    port: int = Field(8000, ge=0, le=65535, description="Port (0: any free port).")
    root: str = Field("runs/tinker", description="Training runs and checkpoints.")
    cache_dir: str = Field(".cache/grpoflow", description="Built and downloaded models.")
    tenants: dict[str, list[str]] | None = Field(
        None, description="Tenant name -> SHA-256 hex digests of its keys (not the keys).")
    api_keys: list[str] | None = Field(None, description="Accepted keys (tml-...).")
    api_keys_env: str | None = Field(
        "GRPOFLOW_TINKER_API_KEYS",
        description="Environment variable with more accepted keys, comma-separated.")
    poll_timeout_s: float = Field(30.0, gt=0, lt=45, description="retrieve_future long-poll.")
    max_queued: int = Field(256, ge=1, description="Queued requests per base model (and a "
                            "training client's held ones) before a submission answers 429.")
    max_body_bytes: int = Field(64 << 20, ge=1024, description="A larger request body is "
                                "answered 413.")
    session_ttl_s: float = Field(1800.0, gt=0, description="A session without a heartbeat "
                                 "this long is finished and its models dropped.")
    startup_timeout_s: float = Field(1800.0, gt=0, description="Bound on preparing the models "
                                     "and loading the backend.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tracking: TinkerTrackingConfig = Field(default_factory=TinkerTrackingConfig)


def load_serve_config(path: str | Path | None = None,
                      overrides: list[str] | None = None) -> TinkerServeConfig:
    data, origin = read_config(path, overrides, EXAMPLE)
    cfg = validate_config(TinkerServeConfig, data, origin)
    if not cfg.base_models:
        raise ConfigError(f"{origin}: base_models is empty; serve at least one, e.g. "
                          "base_models: {grpoflow/tiny: embedded:tiny}")
    for name in cfg.base_models:
        if not name or name.count(":") or name.startswith(("/", ".")):
            raise ConfigError(f"{origin}: base_models key {name!r} is not a usable model name "
                              "(no ':'; e.g. grpoflow/tiny)")
    if cfg.tenants is not None:
        from grpoflow.tinker.auth import check_tenants

        try:
            check_tenants(cfg.tenants)
        except ValueError as exc:
            raise ConfigError(f"{origin}: tenants: {exc}") from None
    return cfg


def api_keys_of(cfg: TinkerServeConfig) -> set[str] | None:
    """The accepted keys (config list plus ``api_keys_env``); None: any ``tml-`` key."""
    keys = set(cfg.api_keys or [])
    if cfg.api_keys_env and (raw := os.environ.get(cfg.api_keys_env, "").strip()):
        keys |= {k.strip() for k in raw.split(",") if k.strip()}
    if bad := sum(1 for k in keys if not k.startswith("tml-") or len(k) < 8):
        raise ConfigError(f"API keys must look like tml-<at least 4 characters> (the Tinker "
                          f"SDK refuses others): {bad} of the keys in api_keys and api_keys_env do not")
    return keys or None


def resolve_models(cfg: TinkerServeConfig) -> dict[str, Path]:
    """Served name -> a verified local model directory (``embedded:tiny`` built once, hub
    ids downloaded once; docs/models.md)."""
    from rl_core.config import DataConfig, ModelConfig
    from rl_core.models.hub import download_model

    out = {}
    for name, ref in cfg.base_models.items():
        if ref.startswith("embedded:"):  # built here (the training stack: a heavy import)
            from rl_core.base_model import snapshot_model

            path = snapshot_model(ModelConfig(path=ref), DataConfig(), cfg.cache_dir).path
        else:
            path = download_model(ref, cfg.cache_dir).path
        log.info("base model %s: %s (%s)", name, path, ref)
        out[name] = Path(path)
    return out


def _default_backend(models: dict[str, Path]) -> Any:  # noqa: ANN401
    """The compute: rl_core.tinker.backend.LoraBackend on the resolved model directories."""
    try:
        from rl_core.tinker.backend import LoraBackend
    except ImportError as exc:
        raise ConfigError("the Tinker service's compute (rl_core.tinker.backend.LoraBackend) "
                          f"is not available in this install: {exc}") from exc
    return LoraBackend({name: str(path) for name, path in models.items()})


def build_tracker(cfg: TinkerServeConfig) -> Any:  # noqa: ANN401
    """The lineage tracker ``cfg.tracking`` asks for (None: ``backend: none``). It touches
    no store until the first training client."""
    t = cfg.tracking
    if t.backend == "none":
        return None
    from grpoflow.tinker.lineage import MlflowLineage

    return MlflowLineage(t.uri, t.experiment, storage_root=t.storage_root, root=cfg.root,
                         checkpoint_artifacts=t.checkpoint_artifacts,
                         register_sampler_weights=t.register_sampler_weights,
                         flush_timeout_s=t.flush_timeout_s)


def build_app(cfg: TinkerServeConfig, backend: Any, tracker: Any = None) -> Any:  # noqa: ANN401
    """The FastAPI app for ``backend`` with ``cfg``'s keys, tenants, root and limits, and
    ``tracker`` (``serve`` passes :func:`build_tracker`'s)."""
    from grpoflow.tinker.app import create_app

    return create_app(backend, root=Path(cfg.root).expanduser(), api_keys=api_keys_of(cfg),
                      tenants=cfg.tenants, tracker=tracker, poll_timeout_s=cfg.poll_timeout_s,
                      max_queued=cfg.max_queued, session_ttl_s=cfg.session_ttl_s,
                      max_body_bytes=cfg.max_body_bytes)


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:  # noqa: ANN401
    """``fn()`` on a helper thread; TimeoutError if it takes longer than ``timeout``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="tinker-startup", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} took more than {timeout:.0f} s (startup_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def serve(cfg: TinkerServeConfig,
          backend_factory: Callable[[dict[str, Path]], Any] | None = None, *,
          ready_file: str | Path | None = None, stop_on_stdin_eof: bool = False) -> int:
    """Prepare the models, load the backend (both bounded by ``startup_timeout_s``), and
    serve until interrupted; the exit code. ``ready_file``: the base URL is written there once
    the service answers; ``stop_on_stdin_eof``: a graceful stop when stdin closes (the parent
    that holds its other end ended: flows/tinker_service.py)."""
    import uvicorn

    keys = api_keys_of(cfg)  # a bad key fails before minutes of model preparation
    started = time.monotonic()
    factory = backend_factory or _default_backend
    backend = _bounded(lambda: factory(resolve_models(cfg)), cfg.startup_timeout_s,
                       "preparing the base models and loading the backend")
    try:
        if (tracker := build_tracker(cfg)) is not None:
            tracker.open()  # the store is reached (and checked) from now on, in the background
        app = build_app(cfg, backend, tracker)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # noqa: ANN401
                super().handle_exit(sig, frame)
                # the long-polls end now, so the connections drain (not in the handler:
                # the event loop's thread may hold the futures' lock)
                threading.Thread(target=app.state.tinker.futures.wake_all, daemon=True).start()

        server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, lifespan="on",
                                       log_level=cfg.log_level, timeout_graceful_shutdown=15))

        def announce() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                port = server.servers[0].sockets[0].getsockname()[1]
                url = f"http://{cfg.host}:{port}"
                log.info("Tinker-compatible service ready on %s in %.0f s: %s; clients: "
                         "tinker.ServiceClient(base_url=%r) with a tml- API key%s%s", url,
                         time.monotonic() - started, ", ".join(cfg.base_models), url,
                         "" if keys or cfg.tenants else " (any is accepted: set tenants)",
                         "" if cfg.tracking.backend == "none" else
                         f"; lineage in MLflow experiment {cfg.tracking.experiment!r}")
                if ready_file is not None:
                    _write_atomically(Path(ready_file), url + "\n")

        def watch_stdin() -> None:
            import sys

            with contextlib.suppress(OSError, ValueError):
                while sys.stdin.buffer.read(4096):
                    pass
            log.info("stdin closed (the supervising process ended): stopping")
            server.should_exit = True  # as a signal would, without re-raising one at exit
            app.state.tinker.futures.wake_all()

        threading.Thread(target=announce, name="tinker-announce", daemon=True).start()
        if stop_on_stdin_eof:
            threading.Thread(target=watch_stdin, name="tinker-stdin", daemon=True).start()
        with contextlib.suppress(KeyboardInterrupt):  # re-raised after a graceful shutdown
            server.run()
    finally:
        backend.close()
    return 0


def _hash_key_main(argv: list[str]) -> int:
    """``python -m grpoflow.tinker.serve hash-key``: a key (typed without echo, or piped on
    stdin; never an argument, which ps and the shell history keep) -> its SHA-256 digest, the
    line a ``tenants`` entry lists."""
    import getpass
    import sys

    from grpoflow.tinker.auth import hash_key

    if argv != ["hash-key"]:
        print("usage: python -m grpoflow.tinker.serve hash-key  (reads the key from stdin)",
              file=sys.stderr)
        return 2
    key = (getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.read()).strip()
    if not key.startswith("tml-") or len(key) < 8:
        print("an API key looks like tml-<at least 4 characters> (the Tinker SDK refuses "
              "others)", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def serve_from_cli(config: str | None, overrides: list[str], **hooks: Any) -> int:  # noqa: ANN401
    """``grpoflow serve-tinker CONFIG [overrides]``: the service's log on stderr (secrets
    redacted), then :func:`serve` (with ``hooks``: ``ready_file``, ``stop_on_stdin_eof``)
    until Ctrl-C."""
    from rl_core.secrets import RedactFilter

    cfg = load_serve_config(config, overrides)
    service_log = logging.getLogger("grpoflow.tinker")
    if not any(h.get_name() == "grpoflow-cli" for h in service_log.handlers):
        handler = logging.StreamHandler()
        handler.set_name("grpoflow-cli")
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(RedactFilter())
        service_log.addHandler(handler)
    service_log.setLevel(cfg.log_level.upper())
    return serve(cfg, **hooks)


def _supervised_main(argv: list[str]) -> int:
    """``python -m grpoflow.tinker.serve supervised READY_FILE CONFIG [overrides]``: the
    service as a supervisor runs it (flows/tinker_service.py): the base URL written to
    READY_FILE once it answers, a graceful stop when stdin closes."""
    ready, config, *overrides = argv
    return serve_from_cli(config, overrides, ready_file=ready, stop_on_stdin_eof=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["supervised"] and len(sys.argv) >= 4:
        raise SystemExit(_supervised_main(sys.argv[2:]))
    raise SystemExit(_hash_key_main(sys.argv[1:]))
