"""Experiment tracking with MLflow: the run, its params, per-step metrics, samples,
checkpoints, evaluations and the registered model.

The flow never touches MLflow: it holds a :class:`TrackingHandle` (small, picklable, or
``None`` when ``tracking.backend`` is ``none``) and passes it to the tasks here. Every task
accepts ``None`` and does nothing, so the flow needs no ``if tracking`` branches.

Where runs go: ``tracking.uri`` from the config, else ``MLFLOW_TRACKING_URI``, else an
embedded SQLite store in the run directory (``<run_dir>/mlflow.db``, artifacts in
``<run_dir>/mlartifacts``). One experiment per config name (or ``tracking.experiment``),
one MLflow run per training run, evaluations as nested runs. A resumed training run
re-attaches to its MLflow run (the id travels in the checkpoint's ``state.json``, else the
run is found by its ``grpoflow.run_name`` tag) and continues the metric history at the
training step; steps redone after a resume appear twice at the same step, the later value
being the one training continued from.

Failure policy. Starting the run fails loudly (retried; a wrong ``tracking.uri`` should stop
a run before it spends GPU hours). Per-step metrics and samples tables never stop or slow
training: ``log_step`` only queues them and a daemon thread (``grpoflow-mlflow-sender``)
sends them; while the server is unreachable it keeps them (up to 200,000 values, 50 tables;
the oldest are dropped with a warning) and retries after 1 s, 2 s, ... up to 30 s, warning
once per outage and saying when the server answers again. An outage is recorded on the run
(tags ``grpoflow.tracking.outages``, ``grpoflow.tracking.outage_seconds``, metric
``tracking/outage_s``). At the end, queued values get ``tracking.flush_timeout_s`` (120 s);
what is still unsent is written to ``<run_dir>/mlflow-unsent-metrics.jsonl``, named in a
warning and in ``finish_tracking``'s result, and :func:`replay_unsent` (``grpoflow tracking
replay FILE``) sends it later. MLflow's own HTTP retries are bounded (:func:`bound_mlflow_http`:
3 retries, 60 s per connect/read, unless the environment sets them), so the calls that stay
synchronous (checkpoint artifacts: one attempt during a known outage; evaluation runs) fail
within seconds against a dead server and warn and move on. The final model registration
fails loudly: a run whose model did not reach the registry is not done.

Secrets never reach MLflow: params, tags, dataset sources, the config artifact, checkpoint
URIs and log lines go through :func:`redact` (``rl_core.storage.redact`` plus the values of
all secret-looking environment variables, ``token=`` parameters and HF tokens) and config
values under keys named like ``*token*``, ``*secret*``, ``*password*``, ``*key*`` are masked.

MLflow is imported here and in tests only; ``rl_core`` never imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rl_core import storage
from rl_core.checkpoint import step_dir_name
from rl_core.config import ExperimentConfig, flatten
from tasks.setup import PreparedData

__all__ = [
    "TrackingHandle",
    "Tracker",
    "bound_mlflow_http",
    "eval_metrics",
    "finish_tracking",
    "log_checkpoint",
    "log_evaluation",
    "log_step",
    "metric_name",
    "redact",
    "redact_config",
    "replay_unsent",
    "resolve_tracking_uri",
    "sample_rows",
    "start_tracking",
    "tracker_for",
    "tracking_failed",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

# Settings that belong in TrackingConfig; read with these defaults until the fields exist.
_DEFAULTS: dict[str, Any] = {
    "samples_every": 10,  # log a samples table every N steps (and at the last step); 0 = off
    "samples_rows": 16,  # rows per samples table (whole groups of the first prompts)
    "system_metrics": True,  # CPU/GPU/memory/disk/network as system/* metrics
    "system_metrics_interval_s": 10.0,
    "register_model": True,  # log the final model and register it under model.name
    "alias": "candidate",  # alias given to each new registered version
    "checkpoint_artifacts": True,  # local checkpoints as artifacts (False: reference only)
}
_MAX_PENDING = 200_000  # metrics kept while the tracking server is unreachable
_BATCH = 1000  # MLflow's limit of metrics per log_batch
_PARAM_BATCH = 100  # MLflow's limit of params + tags per log_batch
_MAX_TABLES = 50  # samples tables kept while the tracking server is unreachable
_RETRY_DELAYS = (1.0, 30.0)  # the sender's backoff after a failed send: 1 s doubling to 30 s
# MLflow's REST client retries a request 7 times with backoff factor 2 and waits up to 120 s
# per connect/read: ~4 minutes per call against a dead server. Ours, unless the environment
# sets them: 3 retries after 0, 2 and 4 s (+ up to 1 s jitter each), 60 s per connect/read
# (the read covers the server's reply to a large artifact upload; raise it for huge models).
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}
UNSENT_FILE = "mlflow-unsent-metrics.jsonl"  # in the run directory
OUTAGES_TAG = "grpoflow.tracking.outages"
OUTAGE_SECONDS_TAG = "grpoflow.tracking.outage_seconds"
OUTAGE_METRIC = "tracking/outage_s"  # one value per outage, at the step it ended
RUN_NAME_TAG = "grpoflow.run_name"
KIND_TAG = "grpoflow.kind"
STEP_TAG = "grpoflow.step"
PARENT_TAG = "mlflow.parentRunId"


# ------------------------------------------------------------------------------ redaction

_MASK = "***"
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s]+@")
_SECRET_WORD = (
    r"[\w\-]*(?:token|secret|passw(?:or)?d|pwd|signature|sig|credential|api_?key|access_?key"
    r"|auth)[\w\-]*"
)
_SECRET_ASSIGN = re.compile(rf"(?i)(\b{_SECRET_WORD}=)[^\s&#,;'\"]+")
_SECRET_KEY_PARTS = ("secret", "password", "passwd", "credential")
_SECRET_KEY_WORDS = {"token", "key", "auth", "apikey", "sig", "signature"}  # not PWD: the cwd


def _is_secret_name(name: str) -> bool:
    """Whether a config key or environment variable name says its value is a secret."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return any(
        w in _SECRET_KEY_WORDS
        or any(part in w for part in _SECRET_KEY_PARTS)
        or w.endswith(("token", "apikey", "accesskey", "secretkey"))
        for w in words
    )


def _env_secrets() -> list[str]:
    values = {v for k, v in os.environ.items() if len(v) >= 6 and _is_secret_name(k)}
    return sorted(values, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with credentials masked: :func:`rl_core.storage.redact` (AWS key ids, the
    standard AWS/HF/MLflow secret variables, ``user:pass@`` in URLs, presigned signatures,
    ``secret_key=``-style assignments), and further the value of *every* environment
    variable whose name looks secret (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``,
    ``*CREDENTIAL*``, ``*AUTH*``), any ``user@`` in URLs, HF tokens, and ``token=``-style
    query parameters and assignments."""
    if not text:
        return text
    for value in _env_secrets():
        text = text.replace(value, _MASK)
    text = storage.redact(text)
    text = _URL_USERINFO.sub(rf"\g<scheme>{_MASK}@", text)
    text = _HF_TOKEN.sub(_MASK, text)
    return _SECRET_ASSIGN.sub(rf"\g<1>{_MASK}", text)


def _redact_value(key: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _redact_value(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_value(key, v) for v in value]
    if isinstance(value, str):
        if value and _is_secret_name(key.rsplit(".", 1)[-1]):
            return _MASK
        return redact(value)
    return value


def redact_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A nested or flat config mapping with secret values masked (by key name and by text)."""
    return {k: _redact_value(str(k), v) for k, v in data.items()}


# ------------------------------------------------------------------------------ naming

_BAD_NAME_CHARS = re.compile(r"[^/\w.\- ]")


def metric_name(key: str) -> str:
    """A metric/param/tag key MLflow accepts: ``@`` becomes ``_at_`` (``pass@4`` ->
    ``pass_at_4``), other characters outside ``[A-Za-z0-9_.-/ ]`` become ``_``, and the
    name is a normalised relative path (MLflow treats names as file paths)."""
    name = _BAD_NAME_CHARS.sub("_", str(key).replace("@", "_at_"))
    parts = [p for p in name.split("/") if p not in ("", ".", "..")]
    return "/".join(parts)[:250] or "_"


def eval_metrics(result: Mapping[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """An evaluation result (``rl_core.evaluation.EvalResult.to_dict()``) as metrics."""
    out = {
        f"{prefix}pass_at_1": result.get("pass_at_1"),
        f"{prefix}response_len_mean": result.get("response_len_mean"),
        f"{prefix}truncation_rate": result.get("truncation_rate"),
        f"{prefix}seconds": result.get("seconds"),
        f"{prefix}num_examples": result.get("num_examples"),
    }
    if result.get("pass_at_k") is not None:
        out[f"{prefix}pass_at_{result.get('k')}"] = result["pass_at_k"]
    return {k: float(v) for k, v in out.items() if _is_number(v)}


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


# ------------------------------------------------------------------------------ handle


@dataclass(frozen=True)
class TrackingHandle:
    """Where a training run is tracked; what the flow passes to the tracking tasks."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    run_name: str
    model_name: str
    total_steps: int
    samples_every: int = 10
    samples_rows: int = 16
    register: bool = True
    alias: str = "candidate"
    checkpoint_artifacts: bool = True
    flow_run_id: str | None = None
    resumed: bool = False
    run_dir: str | None = None  # where the unsent-metrics file goes
    flush_timeout_s: float = 120.0

    def __repr__(self) -> str:  # the URI may carry credentials
        return (
            f"TrackingHandle(uri={redact(self.tracking_uri)!r}, experiment={self.experiment_id}"
            f", run={self.run_id}, name={self.run_name!r})"
        )

    def samples_due(self, step: int) -> bool:
        every = self.samples_every
        return every > 0 and (step % every == 0 or step == self.total_steps)

    def run_url(self) -> str | None:
        """The run's page in the MLflow UI, when the tracking URI is a server."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return None
        base = _URL_USERINFO.sub(r"\g<scheme>", self.tracking_uri).rstrip("/")
        return f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"


class Tracker:
    """An ``MlflowClient`` bound to one run: per-step metrics and samples tables go into a
    queue that a background thread (``grpoflow-mlflow-sender``) sends, so the training loop
    never waits on the tracking server; the system metrics monitor; the end of the run (a
    bounded flush, the unsent-metrics file, the outage record). One per run per process."""

    def __init__(self, handle: TrackingHandle) -> None:
        from mlflow import MlflowClient

        bound_mlflow_http()
        self.handle = handle
        self.client = MlflowClient(handle.tracking_uri)
        self.pending: list[Any] = []  # mlflow.entities.Metric not yet handed to log_batch
        self.inflight: list[Any] = []  # the chunk the sender is sending now
        self.tables: list[tuple[str, dict[str, list[Any]]]] = []  # (artifact file, columns)
        self.table_inflight: tuple[str, dict[str, list[Any]]] | None = None
        self.rejected: list[Any] = []  # metrics the server refused (4xx): kept for the file
        self.failing_since: float | None = None  # wall time the current outage was noticed
        self.outages = 0  # outages that ended (the server answered again)
        self.outage_seconds = 0.0
        self.last_step = 0
        self.monitor: Any = None
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)  # queue changed / something was sent
        self._retry_at = 0.0  # monotonic time of the next attempt after a failure
        self._delay = 0.0
        self._stop = False
        self._sender: threading.Thread | None = None
        self._drained: bool | None = None  # outcome of the end-of-run flush
        self._monitor_interval: float | None = None
        try:  # the flow run's logger reaches the Prefect UI even from the sender thread
            self._log: logging.Logger | logging.LoggerAdapter = get_run_logger()
        except Exception:
            self._log = _log

    # queue ---------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Queue the numeric ``metrics`` at ``step`` for the sender and return at once.
        Returns False while the tracking server is known to be unreachable."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._changed:
            self.pending += [
                Metric(metric_name(k), float(v), now, int(step))
                for k, v in metrics.items()
                if _is_number(v)
            ]
            self.last_step = max(self.last_step, int(step))
            dropped = self._trim()
            self._changed.notify_all()
        if dropped:
            self._say(
                logging.WARNING, f"tracking: dropped the {dropped} oldest unsent metric values"
            )
        self._ensure_sender()
        return self.failing_since is None

    def log_table(self, artifact_file: str, columns: dict[str, list[Any]]) -> None:
        """Queue a table (``MlflowClient.log_table``) for the sender; the newest
        ``_MAX_TABLES`` are kept while the server is unreachable."""
        with self._changed:
            self.tables.append((artifact_file, columns))
            dropped = [t[0] for t in self.tables[:-_MAX_TABLES]]
            del self.tables[:-_MAX_TABLES]
            self._changed.notify_all()
        if dropped:
            self._say(logging.WARNING, f"tracking: dropped unsent tables {dropped}")
        self._ensure_sender()

    def _trim(self) -> int:
        dropped = len(self.pending) - _MAX_PENDING
        if dropped <= 0:
            return 0
        del self.pending[:dropped]
        return dropped

    def flush(self, timeout: float | None = None) -> bool:
        """Have the sender try now (not after its backoff) and wait until everything queued
        is sent, at most ``timeout`` seconds (default ``tracking.flush_timeout_s``). Failed
        sends within the wait are retried after 1 s, 2 s, 4 s, ... Returns whether all went."""
        self._ensure_sender()
        bound = self.handle.flush_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + bound
        with self._changed:
            self._retry_at, self._delay = 0.0, 0.0
            self._changed.notify_all()
            while self.pending or self.inflight or self.tables or self.table_inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 1.0))
            return True

    def drain(self) -> bool:
        """:meth:`flush` with the end-of-run bound, waited once: after a drain that ran out
        of time, later ones (the failure hook after a failed finish) do not wait again."""
        self._drained = self.flush(0.0 if self._drained is False else None)
        return self._drained

    # sender --------------------------------------------------------------------------

    def _ensure_sender(self) -> None:
        _quiet_sender_retries()
        with self.lock:
            if self._stop or (self._sender is not None and self._sender.is_alive()):
                return
            self._sender = threading.Thread(target=self._send_loop, name=_SENDER, daemon=True)
            self._sender.start()

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                while not self._stop and not (
                    (self.pending or self.tables) and time.monotonic() >= self._retry_at
                ):
                    wait = self._retry_at - time.monotonic() if self.pending or self.tables else 5
                    self._changed.wait(max(wait, 0.01))
                if self._stop:
                    return
                chunk, table = self.pending[:_BATCH], None
                if chunk:
                    del self.pending[: len(chunk)]
                    self.inflight = chunk
                else:
                    table = self.table_inflight = self.tables.pop(0)
            started = time.time()
            try:
                if table is None:
                    self.client.log_batch(self.handle.run_id, metrics=chunk, synchronous=True)
                else:
                    self.client.log_table(self.handle.run_id, table[1], table[0])
            except Exception as exc:  # network, server restart, locked SQLite ...
                self._failed(exc, chunk, table, started)
            else:
                self._sent()

    def _failed(
        self, exc: Exception, chunk: list[Any], table: tuple[str, Any] | None, started: float
    ) -> None:
        what = f"{type(exc).__name__}: {redact(str(exc))[:300]}"
        refused, new_outage, dropped = _refused(exc), False, 0
        with self._changed:
            self.inflight, self.table_inflight = [], None
            if refused:  # the server answered: not an outage, retrying would not help
                self.rejected += chunk
            else:
                self.pending[:0] = chunk
                if table is not None:
                    self.tables.insert(0, table)
                dropped = self._trim()
                self._delay = min(max(2 * self._delay, _RETRY_DELAYS[0]), _RETRY_DELAYS[1])
                self._retry_at = time.monotonic() + self._delay
                if self.failing_since is None:
                    self.failing_since, new_outage = started, True
            queued = len(self.pending) + len(self.tables)
            self._changed.notify_all()
        uri = redact(self.handle.tracking_uri)
        if refused and table is not None:
            self._say(logging.WARNING, f"tracking: table {table[0]} not logged ({what})")
        elif refused:
            self._say(
                logging.WARNING,
                f"tracking: {uri} refused {len(chunk)} metric values ({what}); they go to "
                f"{UNSENT_FILE} at the end of the run",
            )
        elif new_outage:
            self._say(
                logging.WARNING,
                f"tracking: MLflow at {uri} is unreachable ({what}); training goes on, "
                f"{queued} queued values are kept and sent when it answers again (retrying "
                f"every {_RETRY_DELAYS[0]:.0f}-{_RETRY_DELAYS[1]:.0f}s)",
            )
        if dropped:
            self._say(
                logging.WARNING, f"tracking: dropped the {dropped} oldest unsent metric values"
            )

    def _sent(self) -> None:
        with self._changed:
            self.inflight, self.table_inflight = [], None
            self._delay, self._retry_at = 0.0, 0.0
            began, self.failing_since = self.failing_since, None
            if began is not None:
                seconds = time.time() - began
                self.outages += 1
                self.outage_seconds += seconds
            queued = len(self.pending) + len(self.tables)
            self._changed.notify_all()
        if began is None:
            return
        self._say(
            logging.INFO,
            f"tracking: metrics reach {redact(self.handle.tracking_uri)} again after "
            f"{seconds:.0f}s (outage {self.outages}); sending the {queued} values kept meanwhile",
        )
        self._record_outage(seconds)
        self._restart_monitor()

    def _record_outage(self, seconds: float) -> None:
        """The outages so far as tags on the run, and this one as ``tracking/outage_s``."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        try:
            self.client.log_batch(
                self.handle.run_id,
                metrics=[Metric(OUTAGE_METRIC, seconds, now, self.last_step)],
                tags=_outage_tags(self.outages, self.outage_seconds),
            )
        except Exception as exc:
            self._say(logging.WARNING, f"tracking: outage not recorded on the run ({exc})")

    def _say(self, level: int, msg: str) -> None:
        self._log.log(level, redact(msg))

    # system metrics ------------------------------------------------------------------

    def start_system_metrics(self, interval_s: float, resume: bool) -> None:
        try:
            import psutil  # noqa: F401  (the monitor needs it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError as exc:
            _warn(f"tracking: system metrics off ({exc}; install psutil)")
            return
        self._monitor_interval = interval_s
        self.monitor = SystemMetricsMonitor(
            self.handle.run_id,
            sampling_interval=interval_s,
            resume_logging=resume,
            tracking_uri=self.handle.tracking_uri,
        )
        self.monitor.start()

    def _restart_monitor(self) -> None:
        """MLflow's monitor stops for good when it cannot reach the server: start a new one
        after an outage."""
        thread = getattr(self.monitor, "_process", None)
        if self._stop or self._monitor_interval is None or thread is None or thread.is_alive():
            return
        try:
            self.start_system_metrics(self._monitor_interval, resume=True)
        except Exception as exc:
            self._say(logging.WARNING, f"tracking: system metrics not restarted ({exc})")

    def stop_system_metrics(self) -> None:
        self._monitor_interval = None
        if self.monitor is not None:
            try:
                self.monitor.finish()
            except Exception as exc:
                _warn(f"tracking: system metrics monitor did not stop cleanly: {exc}")
            self.monitor = None

    # the end -------------------------------------------------------------------------

    def detach(self) -> tuple[list[Any], list[tuple[str, dict[str, list[Any]]]]]:
        """Stop the sender and the monitor; returns what was not sent (metrics, tables)."""
        self.stop_system_metrics()
        with self._changed:
            self._stop = True
            self._changed.notify_all()
            metrics = [*self.inflight, *self.pending, *self.rejected]
            tables = [*([self.table_inflight] if self.table_inflight else []), *self.tables]
        return metrics, tables

    def adopt(self, metrics: list[Any], tables: list[tuple[str, dict[str, list[Any]]]]) -> None:
        """Queue what an earlier tracker of the same run left unsent."""
        with self._changed:
            self.pending[:0] = metrics
            self.tables[:0] = tables
            self._changed.notify_all()
        if metrics or tables:
            self._ensure_sender()

    def end(self, status: str) -> dict[str, Any]:
        """End the run: stop the system metrics, send what is queued within
        ``tracking.flush_timeout_s``, write what is still unsent to
        ``<run_dir>/mlflow-unsent-metrics.jsonl``, record the outages on the run and mark it
        ``status``. Does not raise when the server is unreachable; returns what happened
        (``tracking_outages``, ``tracking_outage_seconds``, and ``unsent_file``,
        ``unsent_values``, ``unsent_tables`` when a file was written)."""
        self.stop_system_metrics()
        self.drain()
        ongoing = self.failing_since
        metrics, tables = self.detach()
        outages, seconds = self.outages, self.outage_seconds
        if ongoing is not None:  # still down: count this outage up to now
            outages, seconds = outages + 1, seconds + time.time() - ongoing
        report: dict[str, Any] = {
            "tracking_outages": outages,
            "tracking_outage_seconds": round(seconds, 1),
        }
        terminated = False
        try:
            if outages:
                self.client.log_batch(self.handle.run_id, tags=_outage_tags(outages, seconds))
            self.client.set_terminated(self.handle.run_id, status=status)
            terminated = True
        except Exception as exc:
            self._say(
                logging.WARNING,
                f"tracking: could not mark run {self.handle.run_id} {status} "
                f"({type(exc).__name__}: {redact(str(exc))[:200]})",
            )
        if metrics or tables or not terminated:
            path = self._write_unsent(
                metrics, tables, None if terminated else status, outages, seconds
            )
            if path is not None:
                report.update(
                    unsent_file=str(path), unsent_values=len(metrics), unsent_tables=len(tables)
                )
                self._say(
                    logging.WARNING,
                    f"tracking: {len(metrics)} metric values and {len(tables)} tables did not "
                    f"reach {redact(self.handle.tracking_uri)} within tracking.flush_timeout_s="
                    f"{self.handle.flush_timeout_s:g}s"
                    + ("" if terminated else f" (nor the run's status {status})")
                    + f"; written to {path}. Send them when the server is back: "
                    f"grpoflow tracking replay {path}",
                )
        return report

    def _write_unsent(
        self,
        metrics: list[Any],
        tables: list[tuple[str, dict[str, list[Any]]]],
        status: str | None,
        outages: int,
        seconds: float,
    ) -> Path | None:
        """Append the unsent values to the run directory's unsent-metrics file (JSON lines:
        one ``run`` header, then ``metric`` and ``table`` records)."""
        h = self.handle
        path = Path(h.run_dir or ".").resolve() / UNSENT_FILE
        header = {
            "kind": "run", "run_id": h.run_id, "run_name": h.run_name,
            "tracking_uri": redact(h.tracking_uri), "status": status, "outages": outages,
            "outage_seconds": round(seconds, 1), "written_at": time.time(),
        }  # fmt: skip
        lines = [header]
        lines += [
            {"kind": "metric", "run_id": h.run_id, "key": m.key, "value": m.value,
             "step": m.step, "timestamp": m.timestamp}
            for m in metrics
        ]  # fmt: skip
        lines += [
            {"kind": "table", "run_id": h.run_id, "artifact_file": name, "table": columns}
            for name, columns in tables
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(line, default=str) + "\n" for line in lines)
        except OSError as exc:
            self._say(
                logging.ERROR,
                f"tracking: could not write {path} ({exc}); {len(metrics)} metric values and "
                f"{len(tables)} tables of run {h.run_id} are lost",
            )
            return None
        return path


_SENDER = "grpoflow-mlflow-sender"


def _not_from_sender(record: logging.LogRecord) -> bool:
    return record.threadName != _SENDER


def _quiet_sender_retries() -> None:
    """urllib3 warns at every retry of every request; the sender warns once per outage."""
    pool = logging.getLogger("urllib3.connectionpool")
    if _not_from_sender not in pool.filters:
        pool.addFilter(_not_from_sender)


def _refused(exc: Exception) -> bool:
    """Whether the server answered and refused (a 4xx other than 408/429, or bad data):
    sending the same again would not help."""
    if isinstance(exc, ValueError | TypeError):
        return True
    status = getattr(exc, "get_http_status_code", None)
    try:
        code = int(status()) if callable(status) else 0
    except Exception:
        return False
    return 400 <= code < 500 and code not in (408, 429)


def _outage_tags(outages: int, seconds: float) -> list[Any]:
    from mlflow.entities import RunTag

    return [RunTag(OUTAGES_TAG, str(outages)), RunTag(OUTAGE_SECONDS_TAG, f"{seconds:.1f}")]


def bound_mlflow_http() -> dict[str, str]:
    """Give MLflow's HTTP client bounded retries unless the environment already sets them
    (MLflow reads these per request); returns the values in force."""
    for key, value in _MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in _MLFLOW_HTTP_DEFAULTS}


def replay_unsent(path: str | Path, tracking_uri: str | None = None) -> dict[str, int]:
    """Send an unsent-metrics file (``<run_dir>/mlflow-unsent-metrics.jsonl``, written when
    MLflow could not be reached at the end of a run) to ``tracking_uri`` (default:
    ``MLFLOW_TRACKING_URI``, else the URI recorded in the file). Values already in the run
    (same key, step, timestamp and value) are skipped, so a second replay sends nothing.
    Also logs the tables, the outage tags (plus ``grpoflow.tracking.replayed``), and ends a
    run the file says was left ``RUNNING`` with its recorded status. Returns counts."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    bound_mlflow_http()
    runs: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            run = runs.setdefault(rec["run_id"], {"metrics": [], "tables": [], "header": {}})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not an unsent-metrics record ({exc})") from exc
        kind = rec.get("kind", "metric")
        if kind == "run":
            run["header"] = rec
        elif kind == "table":
            run["tables"].append((rec["artifact_file"], rec["table"]))
        else:
            run["metrics"].append(rec)
    uri = (
        tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or next((r["header"].get("tracking_uri") for r in runs.values() if r["header"]), None)
    )
    if not uri:
        raise ValueError(f"{path}: no tracking URI; pass one (or set MLFLOW_TRACKING_URI)")
    client = MlflowClient(uri)
    out = {"runs": len(runs), "metrics": 0, "skipped": 0, "tables": 0}
    for run_id, run in runs.items():
        have: dict[str, set[tuple[int, int, str]]] = {}
        new = []
        for m in run["metrics"]:
            if m["key"] not in have:
                have[m["key"]] = {
                    (x.step, x.timestamp, repr(float(x.value)))
                    for x in client.get_metric_history(run_id, m["key"])
                }
            mark = (int(m["step"]), int(m["timestamp"]), repr(float(m["value"])))
            if mark in have[m["key"]]:
                out["skipped"] += 1
                continue
            have[m["key"]].add(mark)
            new.append(Metric(m["key"], float(m["value"]), mark[1], mark[0]))
        for i in range(0, len(new), _BATCH):
            client.log_batch(run_id, metrics=new[i : i + _BATCH], synchronous=True)
        out["metrics"] += len(new)
        for name, columns in run["tables"]:
            client.log_table(run_id, columns, name)
            out["tables"] += 1
        header = run["header"]
        tags = [RunTag("grpoflow.tracking.replayed", f"{Path(path).name}: {len(new)} values")]
        if header.get("outages"):
            tags += _outage_tags(int(header["outages"]), float(header.get("outage_seconds", 0)))
        client.log_batch(run_id, tags=tags)
        if header.get("status") and client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=header["status"])
    return out


_TRACKERS: dict[str, Tracker] = {}
_TRACKERS_LOCK = threading.Lock()


def tracker_for(handle: TrackingHandle) -> Tracker:
    """The process's :class:`Tracker` for ``handle`` (created on first use)."""
    with _TRACKERS_LOCK:
        tracker = _TRACKERS.get(handle.run_id)
        if tracker is None:
            tracker = _TRACKERS[handle.run_id] = Tracker(handle)
        return tracker


# ------------------------------------------------------------------------------ helpers


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except Exception:  # outside a flow or task run
        return _log


def _warn(msg: str) -> None:
    _logger().warning(redact(msg))


def _info(msg: str) -> None:
    _logger().info(redact(msg))


def _retrying(
    what: str, fn: Callable[[], T], attempts: int = 3, delays: Sequence[float] = (2, 8)
) -> T:
    """``fn()`` with bounded retries (network blips); the last failure is raised."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if i == attempts - 1:
                raise
            delay = delays[min(i, len(delays) - 1)]
            _warn(f"tracking: {what} failed ({type(exc).__name__}: {exc}); retrying in {delay}s")
            time.sleep(delay)
    raise AssertionError("unreachable")


def _setting(cfg: ExperimentConfig, name: str) -> Any:
    return getattr(cfg.tracking, name, _DEFAULTS[name])


def resolve_tracking_uri(cfg: ExperimentConfig, run_dir: str | Path) -> tuple[str, str | None]:
    """``(tracking_uri, artifact_location)``: ``tracking.uri``, else ``MLFLOW_TRACKING_URI``,
    else SQLite in the run directory. New experiments in a SQLite store keep their artifacts
    beside the database (``mlartifacts/``), not in ``./mlruns`` of whatever directory the
    process started in; on a server (``None``) the server's artifact root decides."""
    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        return uri, (db.parent / "mlartifacts").as_uri()
    return uri, None


def _git_commit() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the repository this code runs from; bounded to a few seconds."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        if head.returncode != 0:
            return None, None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return head.stdout.strip(), dirty
    except (OSError, subprocess.TimeoutExpired):
        return None, None


def _run_tags(cfg: ExperimentConfig, run_name: str) -> dict[str, str]:
    from prefect.runtime import flow_run

    from rl_core.cluster.platform import detect_platform

    tags = {RUN_NAME_TAG: run_name, KIND_TAG: "training", "grpoflow.config": cfg.name}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_run_name"] = str(flow_run.name)
        url = flow_run.ui_url or (
            f"{os.environ['PREFECT_UI_URL'].rstrip('/')}/runs/flow-run/{flow_run.id}"
            if os.environ.get("PREFECT_UI_URL")
            else None
        )
        if url:
            tags["prefect.flow_run_url"] = str(url)
    commit, dirty = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
        tags["grpoflow.git_dirty"] = str(dirty).lower()
    try:
        p = detect_platform()
        tags.update(
            {
                "grpoflow.platform": p.kind,
                "grpoflow.devices": ", ".join(p.device_names) or f"{p.cpu_count} CPU cores",
                "grpoflow.device_count": str(p.device_count),
                "grpoflow.torch": p.torch_version or "",
                "grpoflow.python": p.python_version,
            }
        )
    except Exception as exc:  # never fail a run for a description of the machine
        tags["grpoflow.platform"] = f"unknown ({type(exc).__name__})"
    return {k: redact(v) for k, v in tags.items() if v is not None}


def _dataset_inputs(cfg: ExperimentConfig, data: PreparedData) -> list[Any]:
    """The prepared train and eval sets as MLflow dataset inputs (metadata only)."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types import ColSpec, Schema

    schema = Schema(
        [ColSpec("string", "id"), ColSpec("string", "question"), ColSpec("string", "answer")]
    )
    splits = (
        (
            "training",
            data.source,
            cfg.data.train_split,
            data.train_path,
            data.train_digest,
            data.num_train,
        ),
        (
            "evaluation",
            cfg.data.eval_source or data.source,
            cfg.data.eval_split,
            data.eval_path,
            data.eval_digest,
            data.num_eval,
        ),
    )
    out = []
    for context, source, split, path, digest, count in splits:
        source = redact(source)
        ds = MetaDataset(
            _dataset_source(source, cfg, split),
            name=metric_name(f"{_short_name(source)}-{split}")[:500],
            digest=digest[:32],
            schema=schema,
        )
        tags = [
            InputTag("mlflow.data.context", context),
            InputTag("grpoflow.digest", digest),
            InputTag("grpoflow.records", str(count)),
            InputTag("grpoflow.snapshot", redact(path)[:500]),
        ]
        out.append(DatasetInput(ds._to_mlflow_entity(), tags))
    return out


def _short_name(source: str) -> str:
    """``gsm8k.jsonl`` for ``https://host/data/gsm8k.jsonl?x=y``, ``gsm8k`` for ``openai/gsm8k``."""
    path = urlparse(source).path if "://" in source else source
    return Path(path.rstrip("/")).name or source


def _dataset_source(source: str, cfg: ExperimentConfig, split: str) -> Any:
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if source == "synthetic":
        knobs = {k: list(v) for k, v in cfg.data.synthetic_knobs().items()}
        return CodeDatasetSource({"generator": "rl_core.data.synthetic", "split": split, **knobs})
    if "://" in source or Path(source).exists() or source.endswith((".jsonl", ".parquet")):
        try:
            return resolve_dataset_source(source)
        except Exception:
            return CodeDatasetSource({"uri": source, "split": split})
    return HuggingFaceDatasetSource(path=source, config_name=cfg.data.subset, split=split)


def _param_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _find_run(client: Any, experiment_id: str, run_name: str) -> str | None:
    if "'" in run_name:  # not expressible in a filter string; the checkpoint has the id
        return None
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}' and tags.`{KIND_TAG}` = 'training'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def _live_run(client: Any, run_id: str) -> Any:
    """The run ``run_id`` if it exists and is not deleted, else None."""
    try:
        run = client.get_run(run_id)
    except Exception:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _checkpoint_state(path: str | None) -> dict[str, Any]:
    """A checkpoint's ``state.json`` (local or ``s3://``), or ``{}`` when unreadable."""
    if not path:
        return {}
    try:
        return json.loads(storage.read_bytes(storage.join(str(path), "state.json")))
    except Exception:
        return {}


# ------------------------------------------------------------------------------ tasks

_TASK = dict(cache_policy=NO_CACHE, log_prints=False)


@task(name="start-tracking", timeout_seconds=300, retries=2, retry_delay_seconds=[5, 20], **_TASK)
def _link_artifact(handle: TrackingHandle, where: str) -> None:
    """The Prefect flow run links to its MLflow run (a link artifact for a server; a
    markdown note with the `mlflow ui` command for a local store)."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    from tasks.evaluate import artifact_key

    key = artifact_key("mlflow", handle.run_name or handle.run_id)
    desc = f"MLflow run {handle.run_id}"
    try:
        if handle.run_url():
            create_link_artifact(link=where, link_text=desc, key=key, description=desc)
        else:
            create_markdown_artifact(
                markdown=f"**{desc}** (experiment {handle.experiment_id}): `{where}`",
                key=key,
                description=desc,
            )
    except Exception as exc:  # the link is a convenience; tracking itself worked
        _warn(f"tracking: no Prefect link artifact ({type(exc).__name__}: {exc})")


def start_tracking(
    cfg: ExperimentConfig,
    run_dir: str,
    data: PreparedData | None = None,
    resume_from: str | None = None,
    resume_run_id: str | None = None,
) -> TrackingHandle | None:
    """Open the MLflow run of this training run (or ``None`` when tracking is off).

    Creates or gets the experiment (``tracking.experiment`` or ``name``); creates the run,
    or, when resuming (``resume_from``: the checkpoint directory, or ``resume_run_id``),
    re-attaches to the run named in the checkpoint or tagged with this run directory's name.
    Tags it with the Prefect flow run (id, UI URL), the git commit and the platform; logs the
    flattened, redacted config as params (and ``config.yaml``), the datasets, and starts the
    system metrics monitor.
    """
    if cfg.tracking.backend == "none":
        return None
    from mlflow import MlflowClient
    from mlflow.entities import Param, RunStatus, RunTag

    bound_mlflow_http()
    uri, artifact_location = resolve_tracking_uri(cfg, run_dir)
    run_name = Path(run_dir).name
    client = MlflowClient(uri)
    exp_name = cfg.tracking.experiment or cfg.name
    try:
        exp = client.get_experiment_by_name(exp_name)
        experiment_id = (
            exp.experiment_id
            if exp is not None
            else client.create_experiment(exp_name, artifact_location=artifact_location)
        )
    except Exception as exc:
        # ``from None``: MLflow's own exception holds the URI as given (password included),
        # and Prefect logs a failure's whole chain; its useful part is in the message, redacted.
        raise RuntimeError(
            f"MLflow at {redact(uri)} is not usable ({type(exc).__name__}: {redact(str(exc))[:300]}); "
            "check tracking.uri / MLFLOW_TRACKING_URI, or set tracking.backend=none"
        ) from None

    run_id = None
    resume_step = None
    if resume_from or resume_run_id:
        state = _checkpoint_state(resume_from)
        resume_step = state.get("step")
        run_id = (
            resume_run_id
            or state.get("tracking_run_id")
            or _find_run(client, experiment_id, run_name)
        )
        previous = _live_run(client, run_id) if run_id else None
        if previous is None:
            _warn(f"tracking: no MLflow run to resume for {run_name}; starting a new one")
            run_id = None
        else:
            experiment_id = previous.info.experiment_id
    resumed = run_id is not None
    if resumed:
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    else:
        run_id = client.create_run(experiment_id, run_name=run_name).info.run_id

    flow_run_id = None
    try:
        tags = _run_tags(cfg, run_name)
        flow_run_id = tags.get("prefect.flow_run_id")
        if resume_step is not None:
            tags["grpoflow.resumed_from_step"] = str(resume_step)
        params = {k: _param_value(v) for k, v in redact_config(flatten(cfg)).items()}
        existing = client.get_run(run_id).data.params if resumed else {}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v[:6000])
        if changed:
            _warn(f"tracking: resumed with changed config values (kept the originals): {changed}")
            tags["grpoflow.params_changed_on_resume"] = ", ".join(changed)[:8000]
        entities = [RunTag(metric_name(k), v) for k, v in tags.items()]
        entities += [Param(metric_name(k), v) for k, v in params.items() if k not in existing]
        for i in range(0, len(entities), _PARAM_BATCH):
            chunk = entities[i : i + _PARAM_BATCH]
            client.log_batch(
                run_id,
                params=[e for e in chunk if isinstance(e, Param)],
                tags=[e for e in chunk if isinstance(e, RunTag)],
            )
        if not resumed:
            client.log_dict(run_id, redact_config(cfg.model_dump(mode="json")), "config.yaml")
            if data is not None:
                client.log_inputs(run_id, datasets=_dataset_inputs(cfg, data))
    except BaseException:
        if not resumed:  # a retry of this task must not leave a half-made run behind
            client.delete_run(run_id)
        raise

    handle = TrackingHandle(
        tracking_uri=uri,
        experiment_id=str(experiment_id),
        run_id=run_id,
        run_name=run_name,
        model_name=cfg.model.name,
        total_steps=cfg.train.steps,
        samples_every=int(_setting(cfg, "samples_every")),
        samples_rows=int(_setting(cfg, "samples_rows")),
        register=bool(_setting(cfg, "register_model")),
        alias=str(_setting(cfg, "alias")),
        checkpoint_artifacts=bool(_setting(cfg, "checkpoint_artifacts")),
        flow_run_id=flow_run_id,
        resumed=resumed,
        run_dir=str(Path(run_dir).resolve()),
        flush_timeout_s=float(getattr(cfg.tracking, "flush_timeout_s", 120.0)),
    )
    with _TRACKERS_LOCK:  # a run re-opened in the same process gets a fresh tracker
        stale = _TRACKERS.pop(run_id, None)
    tracker = tracker_for(handle)
    if stale is not None:  # what it could not send yet goes out with the new one
        tracker.adopt(*stale.detach())
    if _setting(cfg, "system_metrics"):
        tracker.start_system_metrics(float(_setting(cfg, "system_metrics_interval_s")), resumed)
    where = handle.run_url() or f"{redact(uri)} (mlflow ui --backend-store-uri {redact(uri)})"
    _link_artifact(handle, where)
    _info(
        f"tracking: {'re-attached to' if resumed else 'started'} MLflow run {run_id} in "
        f"experiment {exp_name!r}: {where}"
    )
    return handle


@task(name="log-metrics", task_run_name="log-metrics-step-{step}", timeout_seconds=120, **_TASK)
def log_step(
    handle: TrackingHandle | None,
    step: int,
    metrics: Mapping[str, Any],
    samples: Sequence[Mapping[str, Any]] | None = None,
) -> bool:
    """Queue one step's metrics; every ``samples_every`` steps (and at the last step) also
    a table of sample generations, ``samples/step-NNNNNN.json``. Returns at once: the
    tracker's sender thread sends them (usually in one ``log_batch``), keeps them through an
    outage and retries. Never raises. Returns False while the server is known unreachable."""
    if handle is None:
        return True
    tracker = tracker_for(handle)
    healthy = tracker.log_metrics(step, metrics)
    if samples and handle.samples_due(step):
        tracker.log_table(
            f"samples/{step_dir_name(step)}.json", _columns(samples[: handle.samples_rows])
        )
    return healthy


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return {k: [r.get(k) for r in rows] for k in keys}


def sample_rows(
    samples: Sequence[Any], tokenizer: Any = None, limit: int = 16
) -> list[dict[str, Any]]:
    """Rows for the samples table from ``rl_core.grpo.Sample`` objects: the first ``limit``
    samples (whole groups of the first prompts: groups are contiguous), with the prompt
    decoded by ``tokenizer`` when given."""
    rows = []
    for s in list(samples)[:limit]:
        prompt = (
            tokenizer.decode(s.prompt_ids, skip_special_tokens=False) if tokenizer else s.record_id
        )
        rows.append(
            {
                "uid": s.uid,
                "prompt": prompt,
                "completion": s.text,
                "answer": s.answer,
                "reward": float(s.reward),
                "correct": bool(s.correct),
                "truncated": bool(s.truncated),
                "tokens": len(s.output_ids),
                "weight_version": int(s.weight_version),
            }
        )
    return rows


@task(
    name="log-evaluation", task_run_name="log-evaluation-step-{step}", timeout_seconds=300, **_TASK
)
def log_evaluation(
    handle: TrackingHandle | None, step: int, result: Mapping[str, Any]
) -> str | None:
    """An evaluation as a nested run (``eval-step-N``: metrics, tags, its sample generations)
    and as ``eval/*`` metrics on the training run at ``step``. A redone evaluation of the same
    step (after a resume) replaces the earlier nested run. Returns the nested run's id."""
    if handle is None:
        return None
    from mlflow.entities import Metric, RunStatus, RunTag

    tracker = tracker_for(handle)
    tracker.log_metrics(step, eval_metrics(result))
    client = tracker.client
    try:
        for old in client.search_runs(
            [handle.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{handle.run_id}' and tags.`{STEP_TAG}` = '{step}'",
        ):
            client.delete_run(old.info.run_id)
        child = client.create_run(
            handle.experiment_id,
            run_name=f"eval-step-{step}",
            tags={
                PARENT_TAG: handle.run_id,
                KIND_TAG: "evaluation",
                STEP_TAG: str(step),
                RUN_NAME_TAG: handle.run_name,
            },
        ).info.run_id
        now = int(time.time() * 1000)
        metrics = [
            Metric(metric_name(k), v, now, step) for k, v in eval_metrics(result, "").items()
        ]
        extra = {"weight_version": result.get("weight_version"), "k": result.get("k")}
        tags = [RunTag(k, str(v)) for k, v in extra.items() if v is not None]
        client.log_batch(child, metrics=metrics, tags=tags)
        if result.get("samples"):
            client.log_table(child, _columns(result["samples"]), "samples.json")
        client.set_terminated(child, status=RunStatus.to_string(RunStatus.FINISHED))
        return child
    except Exception as exc:
        _warn(f"tracking: evaluation run of step {step} not logged ({type(exc).__name__}: {exc})")
        return None


@task(
    name="log-checkpoint", task_run_name="log-checkpoint-step-{step}", timeout_seconds=1800, **_TASK
)
def log_checkpoint(handle: TrackingHandle | None, step: int, root: str) -> str | None:
    """Record the checkpoint of ``step`` under ``root``: a local one is logged as artifacts
    (``checkpoints/step-NNNNNN/``); one in object storage (``s3://`` ...) is referenced by
    its URI only (tags ``checkpoint/step-NNNNNN`` and ``checkpoint/latest``), never
    uploaded twice. Returns where MLflow points to; warns instead of raising."""
    if handle is None:
        return None
    from mlflow.entities import RunTag

    tracker = tracker_for(handle)
    name = step_dir_name(step)
    remote = storage.is_remote(root)
    uri = storage.join(root.removeprefix("file://"), name)
    try:
        if not remote and handle.checkpoint_artifacts:
            _retrying(
                f"logging checkpoint {name}",
                lambda: tracker.client.log_artifacts(handle.run_id, uri, f"checkpoints/{name}"),
                attempts=1 if tracker.failing_since is not None else 3,  # known outage
            )
            target = f"{_artifact_uri(tracker)}/checkpoints/{name}"
        else:
            target = uri
        tags = [
            RunTag(f"checkpoint/{name}", redact(target)),
            RunTag("checkpoint/latest", redact(target)),
        ]
        tracker.client.log_batch(handle.run_id, tags=tags)
        return redact(target)
    except Exception as exc:
        _warn(f"tracking: checkpoint {name} not recorded ({type(exc).__name__}: {exc})")
        return None


def _artifact_uri(tracker: Tracker) -> str:
    return tracker.client.get_run(tracker.handle.run_id).info.artifact_uri


@task(name="finish-tracking", timeout_seconds=3600, **_TASK)
def finish_tracking(
    handle: TrackingHandle | None,
    *,
    status: str = "FINISHED",
    model_dir: str | None = None,
    eval_result: Mapping[str, Any] | None = None,
    model_name: str | None = None,
) -> dict[str, Any]:
    """Close the training run: the reward/accuracy curve (``plots/reward_accuracy.png``),
    then, given ``model_dir``, the final model in Hugging Face format (transformers flavor),
    registered as ``model_name`` (default ``model.name``) with alias ``candidate``, the final
    evaluation's metrics as version tags and the run linked; then the run ends with
    ``status``. Registration failures raise (the run is then marked FAILED).

    Queued metrics get ``tracking.flush_timeout_s`` to reach the server; what does not is
    written to ``<run_dir>/mlflow-unsent-metrics.jsonl`` (see :func:`replay_unsent`). The
    result says so: ``tracking_outages``, ``tracking_outage_seconds`` and, when a file was
    written, ``unsent_file``, ``unsent_values``, ``unsent_tables``."""
    if handle is None:
        return {}
    tracker = tracker_for(handle)
    out: dict[str, Any] = {"run_id": handle.run_id}
    try:
        tracker.drain()
        try:
            out["curve"] = _log_curve(tracker)
        except Exception as exc:
            _warn(f"tracking: reward curve not logged ({type(exc).__name__}: {exc})")
        if model_dir and handle.register and status == "FINISHED":
            out.update(_register_model(tracker, model_dir, eval_result or {}, model_name))
    except BaseException:
        _end_quietly(tracker, "FAILED")
        raise
    out.update(tracker.end(status))
    with _TRACKERS_LOCK:
        _TRACKERS.pop(handle.run_id, None)
    outages = (
        f" after {out['tracking_outages']} tracking outage(s) of "
        f"{out['tracking_outage_seconds']:.0f}s in all"
        if out["tracking_outages"]
        else ""
    )
    unsent = f"; unsent values in {out['unsent_file']}" if "unsent_file" in out else ""
    _info(f"tracking: run {handle.run_id} ended {status}{outages}{unsent}")
    return out


def _end_quietly(tracker: Tracker, status: str) -> None:
    try:
        tracker.end(status)
    except Exception as exc:
        _warn(f"tracking: could not mark run {tracker.handle.run_id} {status}: {exc}")
    with _TRACKERS_LOCK:
        _TRACKERS.pop(tracker.handle.run_id, None)


def tracking_failed(flow: Any, flow_run: Any, state: Any) -> None:
    """A Prefect ``on_failure`` / ``on_crashed`` flow hook: ends this flow run's MLflow runs
    as FAILED (they would otherwise stay RUNNING forever in the UI)."""
    fid = str(getattr(flow_run, "id", ""))
    with _TRACKERS_LOCK:
        mine = [t for t in _TRACKERS.values() if t.handle.flow_run_id == fid]
    for t in mine:
        _end_quietly(t, "FAILED")


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    """A metric's history, the latest value per step (redone steps after a resume)."""
    latest: dict[int, Any] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in latest or m.timestamp >= latest[m.step].timestamp:
            latest[m.step] = m
    return [(s, latest[s].value) for s in sorted(latest)]


def _log_curve(tracker: Tracker) -> str | None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    client, run_id = tracker.client, tracker.handle.run_id
    series = {
        "reward mean (train)": _history(client, run_id, "reward_mean"),
        "accuracy (train)": _history(client, run_id, "accuracy"),
        "pass@1 (eval, greedy)": _history(client, run_id, "eval/pass_at_1"),
    }
    if not any(series.values()):
        return None
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"reward": {}, "accuracy": {"linestyle": "--"}, "pass@1": {"marker": "o"}}
    for (label, points), style in zip(series.items(), styles.values(), strict=True):
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, markersize=4, label=label, **style)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{tracker.handle.run_name}: reward and accuracy")
    fig.tight_layout()
    path = "plots/reward_accuracy.png"
    client.log_figure(run_id, fig, path)
    return path


def _pip_requirements() -> list[str]:
    """What loading the logged model needs, pinned to what is installed (MLflow's inference
    costs ~13 s and adds torchvision, which breaks logging where it is not installed)."""
    out = []
    for dist in ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "accelerate"):
        try:
            # 2.13.0+cpu -> 2.13.0: a local version label names a wheel index, not PyPI
            out.append(f"{dist}=={metadata.version(dist).split('+')[0]}")
        except metadata.PackageNotFoundError:
            continue
    return out


@contextlib.contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's global tracking URI at ``uri`` for a while. ``set_tracking_uri`` also
    writes ``MLFLOW_TRACKING_URI`` (for subprocesses), so what is restored is that variable
    as it was: unset stays unset, or the next run would silently track to ``./mlflow.db``."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)


def _new_version(
    tracker: Tracker, name: str, info: Any, step: int, metrics: dict[str, float]
) -> Any:
    """A new version of registered model ``name`` (created if needed) from the logged model."""
    h, client = tracker.handle, tracker.client
    try:
        client.create_registered_model(
            name, description="GRPO policies trained by grpoflow (Hugging Face format)."
        )
    except Exception as exc:
        if "ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
            raise
    summary = ", ".join(
        f"{k.removeprefix('eval/')}={v:.4f}" for k, v in metrics.items() if "pass_at" in k
    )
    return client.create_model_version(
        name,
        source=info.model_uri,
        run_id=h.run_id,
        run_link=h.run_url(),
        model_id=info.model_id,
        description=f"GRPO run {h.run_name}, step {step}. Final evaluation: {summary}",
        tags={
            **{metric_name(k): f"{v:.6g}" for k, v in metrics.items()},
            "grpoflow.run_id": h.run_id,
            "grpoflow.run_name": h.run_name,
            "grpoflow.step": str(step),
        },
    )


def _register_model(
    tracker: Tracker, model_dir: str, eval_result: Mapping[str, Any], model_name: str | None
) -> dict[str, Any]:
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
    from transformers import AutoModelForCausalLM, AutoTokenizer

    h, client = tracker.handle, tracker.client
    name = model_name or h.model_name
    step = int(eval_result.get("step", h.total_steps))
    metrics = eval_metrics(eval_result)
    components = {
        "model": AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto"),
        "tokenizer": AutoTokenizer.from_pretrained(model_dir),
    }
    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [
                ParamSpec("max_new_tokens", "long", 64),
                ParamSpec("do_sample", "boolean", False),
                ParamSpec("temperature", "double", 1.0),
            ]
        ),
    )
    started = time.perf_counter()
    # The flavor API knows only the global URI and the active run (whose experiment the
    # logged model joins); the registry resolves models:/ URIs through the global URI too.
    with _global_tracking_uri(h.tracking_uri), mlflow.start_run(run_id=h.run_id):
        info = mlflow.transformers.log_model(
            components,
            name="model",
            task="text-generation",
            signature=signature,
            pip_requirements=_pip_requirements(),
            run_id=h.run_id,
            step=step,  # links the run's metrics at this step (the final evaluation) to the model
            metadata={"grpoflow.run_name": h.run_name, "grpoflow.step": step},
        )
        logged = time.perf_counter() - started
        version = _retrying(
            f"registering {name}", lambda: _new_version(tracker, name, info, step, metrics)
        )
        _retrying(
            f"setting alias {h.alias} on {name} v{version.version}",
            lambda: client.set_registered_model_alias(name, h.alias, version.version),
        )
    _info(
        f"tracking: model logged in {logged:.1f}s and registered as {name} v{version.version} "
        f"(models:/{name}@{h.alias})"
    )
    return {
        "model_uri": info.model_uri,
        "registered_model": name,
        "version": str(version.version),
        "alias_uri": f"models:/{name}@{h.alias}",
    }
