"""SGLang's native HTTP API over the embedded engine: the app, and the uvicorn runners.

:func:`create_app` puts the routers (``routes_*``) and the protocol's error handlers over one
engine in ``app.state``; ``python -m rl_core.engine.server`` (:func:`main`, ``grpoflow engine
serve``) loads a model and serves it. Endpoints and shapes are SGLang's (docs/rollout.md), so
one client drives this server and real SGLang alike; hostile input gets a 4xx before it
reaches the scheduler. Never unpickles request data; binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from rl_core.engine import routes_admin, routes_generate, routes_openai, routes_weights
from rl_core.engine.core import EmbeddedEngine
from rl_core.engine.protocol import EXCEPTION_HANDLERS, MAX_REQUEST_BYTES, MAX_REQUEST_SAMPLES

__all__ = ["ServerThread", "build_server", "create_app", "main", "serve", "serve_in_thread"]

log = logging.getLogger(__name__)


def create_app(engine: EmbeddedEngine | None = None, *, health_timeout_s: float = 20.0,
               max_request_bytes: int = MAX_REQUEST_BYTES,
               max_request_samples: int = MAX_REQUEST_SAMPLES) -> FastAPI:
    """The SGLang-compatible app (OpenAI routes included) over ``engine``, or one attached
    later as ``app.state.engine`` (503 until then). Bodies over ``max_request_bytes`` get
    413, a ``/generate`` asking for more than ``max_request_samples`` samples 400."""
    for name, value in (("max_request_bytes", max_request_bytes),
                        ("max_request_samples", max_request_samples)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    app = FastAPI(title="grpoflow embedded engine (SGLang protocol)",
                  exception_handlers=EXCEPTION_HANDLERS)
    app.state.engine, app.state.health_timeout_s = engine, health_timeout_s
    app.state.max_request_bytes = max_request_bytes
    app.state.max_request_samples = max_request_samples
    for module in (routes_generate, routes_weights, routes_admin, routes_openai):
        app.include_router(module.router)
    return app


class ServerThread:
    """A uvicorn server for ``app`` on a background thread (tests, in-process engines);
    ``port=0`` binds a free port, ``url`` is the address it actually bound."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off")
        self.server, self.host, self.port = uvicorn.Server(config), host, port
        self._thread = threading.Thread(target=self.server.run, name="grpoflow-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=timeout)


def serve_in_thread(engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 30.0) -> ServerThread:
    """Serve ``engine`` from a background thread; returns once it accepts connections."""
    return ServerThread(create_app(engine), host=host, port=port).start(timeout)


LOAD_STACKS_AFTER_S = 60.0


def _stacks_if_not_done(done: threading.Event, after_s: float) -> threading.Thread:
    """If ``done`` is not set within ``after_s``, log every thread's stack once (holding the
    GIL, unlike faulthandler's watchdog, which reads other threads' frames without it while
    they import: a starved start must not be made to crash by its own diagnostics)."""
    def watch() -> None:
        if done.wait(after_s):
            return
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = [f"thread {names.get(tid, tid)}:\n" + "".join(traceback.format_stack(frame))
                  for tid, frame in sys._current_frames().items()]
        log.warning("the engine is still loading after %.0fs; every thread's stack:\n%s",
                    after_s, "\n".join(stacks))

    watcher = threading.Thread(target=watch, name="grpoflow-load-watch", daemon=True)
    watcher.start()
    return watcher


def build_server(model_path: str | Path, host: str = "127.0.0.1", port: int = 30000, *,
                 log_level: str = "info", max_request_bytes: int = MAX_REQUEST_BYTES,
                 **engine_kw: Any) -> Any:
    """A uvicorn server (call ``.run()``) whose engine loads on a background thread: health
    endpoints answer 503 until it is attached; if loading fails, the error is kept in
    ``server.config.app.state.load_error`` and the server stops itself."""
    import uvicorn

    app = create_app(None, max_request_bytes=max_request_bytes)
    app.state.load_error = None
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))

    loaded = threading.Event()

    def load() -> None:
        try:
            app.state.engine = EmbeddedEngine(model_path, **engine_kw)
            log.info("engine ready: %s on http://%s:%d", model_path, host, port)
        except BaseException as e:  # reported, then the server stops
            log.exception("could not load %s", model_path)
            app.state.load_error = e
            server.should_exit = True
        finally:
            loaded.set()

    # A load still running after a minute: every thread's stack into the log, to tell a
    # hang from a starved start (docs/testing.md, "A restarted engine that takes minutes").
    _stacks_if_not_done(loaded, LOAD_STACKS_AFTER_S)
    threading.Thread(target=load, name="grpoflow-engine-load", daemon=True).start()
    return server


def serve(model_path: str | Path, host: str = "127.0.0.1", port: int = 30000, *,
          log_level: str = "info", max_request_bytes: int = MAX_REQUEST_BYTES,
          **engine_kw: Any) -> int:
    """Load the engine and serve it until interrupted (health answers 503 while loading);
    the process exit code (1 if the model failed to load)."""
    server = build_server(model_path, host, port, log_level=log_level,
                          max_request_bytes=max_request_bytes, **engine_kw)
    app = server.config.app
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        if app.state.engine is not None:
            app.state.engine.close()
    return 1 if app.state.load_error is not None else 0


def _exit_with_parent(pid: int, interval_s: float = 1.0) -> None:
    """Exit (at once, no cleanup) within ``interval_s`` of process ``pid`` going away: an
    engine a training flow started must not outlive it (a flow killed with SIGKILL cannot stop
    its children, and an orphaned engine would hold its port and memory)."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != pid:
                log.warning("parent process %d is gone; exiting", pid)
                os._exit(3)

    if os.getppid() != pid:
        log.warning("--parent-pid %d is not this process's parent", pid)
    threading.Thread(target=watch, name="grpoflow-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """``grpoflow engine serve --model PATH --port P [--host 127.0.0.1] ...``."""
    ap = argparse.ArgumentParser(prog="grpoflow engine serve", description=(
        "Serve a Hugging Face causal LM with SGLang's HTTP protocol (embedded engine, CPU or "
        "one GPU)."))
    add = ap.add_argument
    add("--model", required=True, help="Hugging Face model directory")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add("--device", default="cpu")
    add("--max-running-requests", type=int, default=256)
    add("--max-total-tokens", type=int, default=None)
    add("--context-length", type=int, default=None)
    add("--num-threads", type=int, default=None, help="torch intra-op threads")
    add("--kv-layout", default="auto", choices=["auto", "slots", "padded"],
        help="KV cache layout (auto: slots for Llama-family models, padded otherwise)")
    add("--prefix-cache-tokens", type=int, default=0, help="keep finished requests' KV, up to "
        "this many tokens, for later prompts that start with them (slots layout; 0: off)")
    add("--max-loras-per-batch", type=int, default=1, help="LoRA adapters one running batch "
        "serves (SGLang's flag): 1 merges the batch's adapter into the weights; N > 1 applies "
        "up to N unmerged, per row (docs/lora.md)")
    add("--log-level", default="info")
    add("--control-timeout-s", type=float, default=60.0,
        help="bound on a control call's wait for the scheduler's next safe point")
    add("--weight-sync-timeout-s", type=float, default=120.0, help="bound on each collective of a "
        "distributed weight update (set it to the trainer's rollout.weight_sync_timeout_s)")
    add("--max-request-mb", type=float, default=MAX_REQUEST_BYTES / 2**20,
        help="refuse request bodies larger than this with 413")
    add("--parent-pid", type=int, default=None,
        help="exit when this process is gone (engines started by a training flow die with it)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    engine_kw = {k: v for k, v in vars(args).items()  # the rest are EmbeddedEngine's arguments
                 if k not in ("model", "host", "port", "log_level", "max_request_mb", "parent_pid")}
    return serve(args.model, args.host, args.port, log_level=args.log_level,
                 max_request_bytes=max(1, int(args.max_request_mb * 2**20)), **engine_kw)


if __name__ == "__main__":  # ``python -m rl_core.engine.server``: what EnginePool starts
    raise SystemExit(main())
