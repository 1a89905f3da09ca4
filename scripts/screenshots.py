"""Screenshots of the Prefect and MLflow UIs on a short demo run, for the docs.

    make screenshots                 # = .venv/bin/python scripts/screenshots.py
    .venv/bin/python scripts/screenshots.py --steps 30 --out docs/img --keep

What it does, every process on 127.0.0.1 and every file in a temporary directory:

1. finds Chromium (``$CHROMIUM``, ``chromium``, ``chromium-browser``, ``google-chrome``); when
   there is none, installs Debian's ``chromium`` with ``apt-get`` (as root);
2. starts a ``prefect server`` (SQLite under a fresh ``PREFECT_HOME``, free port, UI on) and
   an ``mlflow server`` (SQLite, ``--workers 1``, no job execution);
3. runs a short GRPO demo against both (configs/tiny-cpu.yaml, ``--steps`` steps, model
   registered with the alias ``candidate``) and the registry evaluation (``grpoflow evaluate
   --registry``), which makes it ``champion``; then a shorter second run (``--second-steps``)
   registers version 2, the new ``candidate``, and the registry evaluation runs again;
4. drives headless Chromium through the DevTools protocol: for each page, navigates, waits
   (bounded) until the page shows the run's name, prepares it as a user would (zooms the task
   graph; MLflow's *Model training* view, Assistant panel closed, a chart filter), waits until
   it has drawn its graph or charts, and saves a 1600x1000 PNG into ``--out``:
   ``prefect-flow-run.png``, ``mlflow-run-metrics.png``, ``mlflow-registered-model.png``.

Servers and Chromium are stopped in ``finally`` whatever happens. The helpers (:func:`
ensure_chromium`, :func:`start_stack`, :func:`run_demo`, :class:`Browser`, :func:`pages`)
are reused by ``tests/test_browser.py``. Only the standard library, ``websockets`` (a
dependency of Prefect) and, to shrink the PNGs, Pillow (a dependency of MLflow) are used.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# ``grpoflow`` as this checkout runs it (``python -m grpoflow.cli`` from ROOT), whatever an
# installed ``grpoflow`` script next to the interpreter would import.
GRPOFLOW = [sys.executable, "-m", "grpoflow.cli"]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
SHARED_CACHE = ROOT / ".cache" / "grpoflow"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Without the network-related ones the machine's refused connections flood Chromium.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
WINDOW = (1600, 1000)
_T0 = time.monotonic()

__all__ = [
    "Browser",
    "Demo",
    "Page",
    "ScreenshotError",
    "Service",
    "Stack",
    "capture",
    "ensure_chromium",
    "find_chromium",
    "main",
    "pages",
    "run_demo",
    "start_stack",
]


def log(msg: str) -> None:
    """One progress line on stderr, with the seconds since the script started."""
    print(f"[screenshots {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class ScreenshotError(RuntimeError):
    """A step failed; the message says what was waited for and what to do."""


# --------------------------------------------------------------------------- chromium


def find_chromium() -> str | None:
    """The Chromium binary: ``$CHROMIUM`` if set, else the first known name on ``PATH``."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if shutil.which(explicit) else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def ensure_chromium(install: bool = True) -> str:
    """Find Chromium; when there is none and ``install``, install Debian's ``chromium`` with
    ``apt-get`` (refreshing the package lists once if the first try fails)."""
    found = find_chromium()
    if found:
        return found
    if not install:
        raise ScreenshotError(_no_chromium("no Chromium binary found"))
    if os.environ.get("CHROMIUM"):
        raise ScreenshotError(_no_chromium(f"CHROMIUM={os.environ['CHROMIUM']} is not executable"))
    apt = shutil.which("apt-get")
    if apt is None:
        raise ScreenshotError(_no_chromium("no Chromium binary found and no apt-get to install it"))
    sudo: list[str] = []
    if os.geteuid() != 0:
        if not shutil.which("sudo"):
            raise ScreenshotError(_no_chromium("no Chromium binary found and not root"))
        sudo = ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = [*sudo, apt, "install", "-y", "--no-install-recommends", "chromium"]
    log("no Chromium found: " + " ".join(install_cmd))
    done = subprocess.run(install_cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        log("apt-get install failed; refreshing the package lists (apt-get update) once")
        subprocess.run([*sudo, apt, "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install_cmd, env=env, capture_output=True, text=True, timeout=900)
    found = find_chromium()
    if done.returncode != 0 or not found:
        tail = (done.stdout + done.stderr)[-2000:]
        raise ScreenshotError(_no_chromium(f"installing chromium failed:\n{tail}"))
    log(f"installed {found}")
    return found


def _no_chromium(why: str) -> str:
    return (
        f"{why}\nInstall it (Debian/Ubuntu: `sudo apt-get install -y --no-install-recommends "
        "chromium`) or point CHROMIUM at a Chromium/Chrome binary, then run again."
    )


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    """A server process in its own process group, its output in ``log_path``."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def start(
        cls, name: str, cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path = ROOT
    ) -> Service:
        """Start ``cmd`` in a new session (so :meth:`stop` reaches its children)."""
        with log_path.open("w") as out:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return cls(name, proc, log_path)

    def tail(self, chars: int = 3000) -> str:
        """The end of the process's output."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_http(self, url: str, timeout: float) -> None:
        """Block until ``url`` answers 200; raise with the log if the process exits or the
        bound passes."""
        log(f"waiting up to {timeout:.0f}s for {self.name} ({url})")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ScreenshotError(f"{self.name} exited early:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        log(f"{self.name} is up")
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise ScreenshotError(f"{self.name} did not answer {url} in {timeout:.0f}s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Signal the process group, then SIGKILL whatever is left after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name} ignored signal {sig} for {timeout:.0f}s: SIGKILL")
        with contextlib.suppress(ProcessLookupError):  # children may outlive the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


@dataclass
class Stack:
    """A Prefect server and an MLflow server, and the environment their clients get."""

    root: Path
    prefect: Service
    prefect_url: str  # the UI; the API is at {prefect_url}/api
    mlflow: Service
    mlflow_url: str
    env: dict[str, str] = field(repr=False)


@contextlib.contextmanager
def start_stack(root: Path, timeout: float = 240.0) -> Iterator[Stack]:
    """Start ``prefect server`` and ``mlflow server`` side by side under ``root``, wait for
    both (bounded), yield them, and stop them on the way out whatever happened (MLflow, then
    Prefect; no Prefect worker runs here: the flows run in the ``grpoflow`` processes)."""
    root.mkdir(parents=True, exist_ok=True)
    p_port, m_port = free_port(), free_port()
    prefect_url, mlflow_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{m_port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / "prefect-home"),
        "PREFECT_API_URL": f"{prefect_url}/api",
        "PREFECT_UI_URL": prefect_url,
        "PREFECT_UI_API_URL": f"{prefect_url}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "true",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "MLFLOW_TRACKING_URI": mlflow_url,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "AWS_EC2_METADATA_DISABLED": "true",
        "DO_NOT_TRACK": "1",
    }
    log(f"starting prefect server on {prefect_url} and mlflow server on {mlflow_url}")
    prefect = Service.start(
        "prefect server",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(p_port)],
        env, root / "prefect-server.log",
    )  # fmt: skip
    mlflow: Service | None = None
    try:
        mlflow = Service.start(
            "mlflow server",
            [str(BIN / "mlflow"), "server",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", str(root / "mlartifacts"),
             "--host", "127.0.0.1", "--port", str(m_port), "--workers", "1"],
            env, root / "mlflow-server.log",
        )  # fmt: skip
        prefect.wait_http(f"{prefect_url}/api/health", timeout)
        mlflow.wait_http(f"{mlflow_url}/health", timeout)
        stack = Stack(root, prefect, prefect_url, mlflow, mlflow_url, env)
        yield stack
    finally:
        log("stopping the servers")
        if mlflow is not None:
            mlflow.stop()
        prefect.stop(signal.SIGINT)


# --------------------------------------------------------------------------- the demo


@dataclass
class Demo:
    """What the pages show: the run, its flow run, the registered model."""

    experiment_id: str
    run_id: str
    run_name: str
    flow_run_id: str
    flow_run_name: str
    model_name: str
    aliases: dict[str, str]  # alias -> version


def _cache_dir(root: Path, shared: Path | None) -> Path:
    """A cache directory of this run whose ``models``/``data`` are the shared cache's (the
    tiny model is built once), while the registry's downloads (cached by name and version
    only) stay private to this run's fresh MLflow store."""
    cache = root / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    if shared is not None:
        for sub in ("models", "data"):
            (shared / sub).mkdir(parents=True, exist_ok=True)
            link = cache / sub
            if not link.exists():
                link.symlink_to(shared / sub, target_is_directory=True)
    return cache


def _grpoflow(args: list[str], env: dict[str, str], log_path: Path, timeout: float) -> str:
    """Run ``grpoflow ARGS`` in its own process group (its engine processes die with it if
    it runs past ``timeout`` or the script is interrupted); returns its stdout."""
    log(f"grpoflow {' '.join(args)}  (up to {timeout:.0f}s; output in {log_path})")
    with log_path.open("w") as err:
        proc = subprocess.Popen(
            [*GRPOFLOW, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=err, text=True, start_new_session=True,
        )  # fmt: skip
        service = Service(f"grpoflow {args[0]}", proc, log_path)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ScreenshotError(
                f"grpoflow {args[0]} ran past {timeout:.0f}s; see {log_path}"
            ) from exc
        finally:
            service.stop()
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise ScreenshotError(f"grpoflow {args[0]} failed ({proc.returncode}):\n{tail}")
    return out


def run_demo(
    stack: Stack,
    steps: int = 25,
    *,
    second_steps: int = 0,
    extra: list[str] | None = None,
    shared_cache: Path | None = SHARED_CACHE,
    timeout: float = 1800.0,
) -> Demo:
    """A short GRPO run of configs/tiny-cpu.yaml tracked on ``stack`` (its model registered
    as ``candidate``), then the registry evaluation, which makes it ``champion`` too.

    With ``second_steps``, a second, shorter run registers version 2 (the new ``candidate``)
    and the registry evaluation runs again: it promotes version 2 only if it beats version 1
    by the promotion margin, so the registry shows both aliases the way a user meets them.
    ``extra`` overrides go to every command (the test shrinks the evaluation with them)."""
    root = stack.root
    cache = _cache_dir(root, shared_cache)
    common = [
        f"storage.root={root / 'runs'}", f"storage.cache_dir={cache}",
        "tracking.backend=mlflow", f"tracking.uri={stack.mlflow_url}",
        *(extra or []),
    ]  # fmt: skip
    first: dict[str, Any] = {}
    for i, (n, run_name) in enumerate(
        [(steps, "tiny-cpu-demo"), (second_steps, "tiny-cpu-demo-2")]
    ):
        if n <= 0:
            continue
        out = _grpoflow(
            ["train", str(CONFIG), f"train.steps={n}", f"run_name={run_name}", *common,
             "--quiet", "--json"],
            stack.env, root / f"train-{run_name}.log", timeout,
        )  # fmt: skip
        tracking = json.loads(out[out.index("{") :]).get("tracking") or {}
        if "run_id" not in tracking or "registered_model" not in tracking:
            raise ScreenshotError(f"run {run_name} was not tracked and registered: {tracking}")
        first = first or tracking
        _grpoflow(["evaluate", str(CONFIG), *common, "--registry"], stack.env,
                  root / f"evaluate-{i + 1}.log", timeout)  # fmt: skip

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=stack.mlflow_url)
    run = client.get_run(first["run_id"])
    tags = run.data.tags
    name = first["registered_model"]
    demo = Demo(
        experiment_id=run.info.experiment_id,
        run_id=run.info.run_id,
        run_name=run.info.run_name,
        flow_run_id=tags.get("prefect.flow_run_id", ""),
        flow_run_name=tags.get("prefect.flow_run_name", ""),
        model_name=name,
        aliases=dict(client.get_registered_model(name).aliases or {}),
    )
    if not demo.flow_run_id:
        raise ScreenshotError(f"MLflow run {demo.run_id} has no prefect.flow_run_id tag")
    log(f"demo: {demo}")
    return demo


# --------------------------------------------------------------------------- the browser


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page)."""

    def __init__(self, binary: str, root: Path, size: tuple[int, int] = WINDOW) -> None:
        self.binary, self.size = binary, size
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=root))
        self.log_path = root / "chromium.log"
        self.service: Service | None = None
        self._ws: Any = None
        self._id = 0

    def __enter__(self) -> Browser:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 60.0) -> None:
        """Start Chromium on a DevTools port of its choosing and attach to its page."""
        cmd = [
            self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank",
        ]  # fmt: skip
        self.service = Service.start("chromium", cmd, dict(os.environ), self.log_path)
        log(f"waiting up to {timeout:.0f}s for Chromium's DevTools port")
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.service.proc.poll() is not None:
                raise ScreenshotError(f"Chromium exited early:\n{self.service.tail()}")
            if time.monotonic() > deadline:
                raise ScreenshotError(f"Chromium opened no DevTools port in {timeout:.0f}s:\n"
                                      f"{self.service.tail()}")  # fmt: skip
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        targets: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            listing = f"http://127.0.0.1:{port}/json/list"
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(listing, timeout=5) as r,
            ):
                targets = [t for t in json.load(r) if t.get("type") == "page"]
            if targets:
                break
            time.sleep(0.2)
        if not targets:
            raise ScreenshotError(f"Chromium has no page to drive:\n{self.service.tail()}")
        from websockets.sync.client import connect

        self._ws = connect(targets[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        width, height = self.size
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        log(f"Chromium {self.call('Browser.getVersion').get('product', '?')} on port {port}")

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events are skipped)."""
        self._id += 1
        msg_id = self._id
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ScreenshotError(f"DevTools {method} got no answer in {timeout:.0f}s")
            try:
                reply = json.loads(self._ws.recv(timeout=left))
            except TimeoutError:
                continue
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise ScreenshotError(f"DevTools {method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise ScreenshotError(f"page script failed: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def text(self) -> str:
        """The page's visible text."""
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def open(self, url: str) -> None:
        """Navigate to ``url`` (the wait for its content is :meth:`wait_for`)."""
        log(f"opening {url}")
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise ScreenshotError(f"cannot open {url}: {result['errorText']}")

    def wait_for(self, what: str, expression: str, timeout: float = 90.0) -> None:
        """Poll ``expression`` until it is truthy; raise with the page's text if it is not
        within ``timeout``."""
        log(f"waiting up to {timeout:.0f}s for {what}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ScreenshotError):
                if self.evaluate(f"!!({expression})"):
                    log(f"  ... {what}: there")
                    return
            time.sleep(0.5)
        shown = " | ".join(self.text().split())[:1500]
        raise ScreenshotError(f"timed out after {timeout:.0f}s waiting for {what}; the page "
                              f"shows: {shown}")  # fmt: skip

    def screenshot(self, path: Path) -> int:
        """Save the viewport as a PNG (palette-reduced with Pillow when that shrinks it)."""
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        data = _shrink_png(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        log(f"saved {path} ({len(data) // 1024} KB)")
        return len(data)

    def close(self) -> None:
        """Close the connection and stop Chromium (its profile directory goes too)."""
        if self._ws is not None:
            with contextlib.suppress(Exception):
                self._ws.close()
            self._ws = None
        if self.service is not None:
            self.service.stop(timeout=10)
            self.service = None
        shutil.rmtree(self.profile, ignore_errors=True)


def _shrink_png(data: bytes, colors: int = 256) -> bytes:
    try:
        from PIL import Image
    except ImportError:
        return data
    img = Image.open(io.BytesIO(data)).convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
    return out.getvalue() if out.tell() < len(data) else data


# --------------------------------------------------------------------------- the pages


@dataclass
class Page:
    """One screenshot: where, what must be on it, what to do to it, and the file."""

    file: str
    url: str
    texts: list[str]  # the page must show all of these (its text, not its canvas)
    what: str  # what that means, for the log and errors
    prepare: Callable[[Browser, Page], None] | None = None  # then this (filter, zoom)
    drawn: str = "true"  # then this JavaScript expression must become truthy
    drawn_what: str = "the page drawn"
    settle_s: float = 2.0  # then wait this long for animations and late requests


# MLflow's chart search box takes a regular expression over metric keys.
METRIC_FILTER = "^(reward_mean|kl|entropy|response_len_mean|loss|grad_norm)$"
# The Prefect graph opens fitted to the whole run; six wheel steps zoom it in about 6x, to
# a few GRPO steps whose task runs (rollout-step-N, train-step-N, ...) show their names.
GRAPH_ZOOM_STEPS = 6


def _mlflow_view(browser: Browser, page: Page) -> None:
    """MLflow 3 opens in its GenAI view with its Assistant panel open on a first visit:
    switch to the *Model training* view (its sidebar: Experiments, Model registry; the switch
    may navigate away, then the page is opened again) and close the panel."""
    training = (
        "[...document.querySelectorAll('[role=button]')]"
        ".find(e => e.textContent.trim() === 'Model training')"
    )
    browser.evaluate(f"(() => {{ const t = {training}; if (t) t.click(); return !!t; }})()")
    time.sleep(1.0)
    if browser.evaluate("location.href") != page.url:
        browser.open(page.url)
        browser.wait_for(page.what, f"document.body && {_shows(page.texts)}", 60)
    close = "document.querySelector('[data-component-id=\"mlflow.assistant.chat_panel.close\"]')"
    with contextlib.suppress(ScreenshotError):
        browser.wait_for("MLflow's Assistant panel (closed if it opens)", close, timeout=3)
    browser.evaluate(f"(() => {{ const c = {close}; if (c) c.click(); return !!c; }})()")


def _filter_metric_charts(browser: Browser, page: Page) -> None:
    _mlflow_view(browser, page)
    search = "document.querySelector('input[placeholder=\"Search metric charts\"]')"
    browser.wait_for("the metric search box", search, timeout=30)
    browser.evaluate(f"{search}.focus()")
    browser.call("Input.insertText", text=METRIC_FILTER)
    browser.evaluate("document.activeElement.blur()")
    browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=1, y=browser.size[1] - 1)


def _graph_node_pixels(browser: Browser, rect: dict[str, float]) -> int:
    """Pixels of the task graph in Prefect's *Completed* green. The graph is drawn with WebGL,
    so its pixels come from a screenshot of the canvas, not from the DOM."""
    import numpy as np
    from PIL import Image

    clip = {k: rect[k] for k in ("x", "y", "width", "height")} | {"scale": 1}
    data = base64.b64decode(browser.call("Page.captureScreenshot", format="png", clip=clip)["data"])
    px = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    return int(((g > 110) & (g > r + 50) & (g > b + 30)).sum())


def _wait_graph_nodes(
    browser: Browser, rect: dict[str, float], what: str, minimum: int, timeout: float = 90.0
) -> None:
    log(f"waiting up to {timeout:.0f}s for {what}")
    deadline, seen = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        seen = _graph_node_pixels(browser, rect)
        if seen >= minimum:
            log(f"  ... {what}: there ({seen} pixels of completed task runs)")
            return
        time.sleep(1.0)
    raise ScreenshotError(f"timed out after {timeout:.0f}s waiting for {what}: the graph shows "
                          f"{seen} pixels of completed task runs, {minimum} expected")  # fmt: skip


def _zoom_graph(browser: Browser, page: Page) -> None:
    """Wait until the task graph has drawn its task runs, zoom into the middle of the run, and
    wait until the zoomed graph has drawn them again."""
    browser.wait_for("the task graph's canvas", "document.querySelector('canvas')", 60)
    rect = json.loads(
        browser.evaluate("JSON.stringify(document.querySelector('canvas').getBoundingClientRect())")
    )
    _wait_graph_nodes(browser, rect, "the task graph's task runs", minimum=100)
    time.sleep(2.0)  # the graph fits itself to the run, animated
    x, y = rect["x"] + 0.45 * rect["width"], rect["y"] + 0.5 * rect["height"]
    log(f"zooming into the middle of the task graph ({GRAPH_ZOOM_STEPS} wheel steps)")
    for _ in range(GRAPH_ZOOM_STEPS):
        browser.call("Input.dispatchMouseEvent", type="mouseWheel", x=x, y=y, deltaX=0, deltaY=-200)
        time.sleep(0.5)
    browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=1, y=browser.size[1] - 1)
    _wait_graph_nodes(browser, rect, "the zoomed task graph's task runs", minimum=1000)


def pages(stack: Stack, demo: Demo) -> list[Page]:
    """The three pages of the docs for ``demo`` on ``stack``."""
    charts = "document.querySelectorAll('.js-plotly-plot')"
    return [
        Page(
            file="prefect-flow-run.png",
            url=f"{stack.prefect_url}/runs/flow-run/{demo.flow_run_id}",
            texts=[demo.flow_run_name, "Completed"],
            what=f"the flow run {demo.flow_run_name!r}",
            prepare=_zoom_graph,
            drawn="document.querySelectorAll('canvas').length > 0",
            drawn_what="the task graph's canvas",
            settle_s=4.0,
        ),
        Page(
            file="mlflow-run-metrics.png",
            url=(
                f"{stack.mlflow_url}/#/experiments/{demo.experiment_id}/runs/{demo.run_id}"
                "/model-metrics"
            ),  # fmt: skip
            texts=[demo.run_name, "Model metrics"],
            what=f"the run {demo.run_name!r}",
            prepare=_filter_metric_charts,
            drawn=(
                f"{charts}.length === 6 && [...{charts}].every("
                "c => c.querySelector('path.js-line'))"
            ),  # fmt: skip
            drawn_what="six metric charts, each with its line",
        ),
        Page(
            file="mlflow-registered-model.png",
            url=f"{stack.mlflow_url}/#/models/{urllib.parse.quote(demo.model_name)}",
            texts=[demo.model_name, "Aliases", *demo.aliases],
            what=f"the registered model {demo.model_name!r} with aliases {sorted(demo.aliases)}",
            prepare=_mlflow_view,
        ),
    ]


def _shows(texts: list[str]) -> str:
    return " && ".join(f"document.body.innerText.includes({json.dumps(t)})" for t in texts)


def capture(browser: Browser, page: Page, out_dir: Path | None, timeout: float = 120.0) -> str:
    """Open ``page``, wait until it shows its texts, prepare it, wait until it is drawn, and
    save it under ``out_dir`` (if given); returns the page's text."""
    try:
        browser.open(page.url)
        browser.wait_for(page.what, f"document.body && {_shows(page.texts)}", timeout)
        if page.prepare is not None:
            page.prepare(browser, page)
        browser.wait_for(page.drawn_what, page.drawn, timeout)
    except ScreenshotError as exc:
        shot = browser.log_path.parent / f"failed-{page.file}"
        with contextlib.suppress(Exception):
            browser.screenshot(shot)
        raise ScreenshotError(f"{exc}\n(what the page showed then: {shot})") from exc
    time.sleep(page.settle_s)
    if out_dir is not None:
        browser.screenshot(out_dir / page.file)
    return browser.text()


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run everything; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go")
    p.add_argument("--steps", type=int, default=25, help="GRPO steps of the demo run (25)")
    p.add_argument("--second-steps", type=int, default=5,
                   help="GRPO steps of a second run registering version 2 (5; 0: none)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--no-install", action="store_true", help="never apt-get install chromium")
    args = p.parse_args(argv)
    if args.steps < 1 or args.second_steps < 0:
        p.error("--steps must be at least 1 and --second-steps at least 0")

    try:
        binary = ensure_chromium(install=not args.no_install)
    except (ScreenshotError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="grpoflow-screenshots-"))
    log(f"working in {root}")
    keep, saved = args.keep, []
    try:
        with start_stack(root) as stack:
            demo = run_demo(stack, args.steps, second_steps=args.second_steps)
            with Browser(binary, root) as browser:
                for page in pages(stack, demo):
                    capture(browser, page, args.out)
                    saved.append(str(args.out / page.file))
    except ScreenshotError as exc:
        print(f"error: {exc}\n(the logs are under {root})", file=sys.stderr)
        keep = True
        return 1
    except BaseException:
        keep = True
        raise
    finally:
        if keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    log(f"done in {time.monotonic() - _T0:.0f}s: {', '.join(saved)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
