"""The metrics sender: per-step metrics and samples tables leave the training loop through a
:class:`Tracker`'s queue, which a daemon thread (``grpoflow-mlflow-sender``) sends, keeping
them through outages; what is left at the end goes to the unsent-metrics file, which
:func:`replay_unsent` sends later (limits, backoff: docs/tracking.md, 'When the server goes
away'). Never blocks the caller on the server, never raises from queueing, never logs
unredacted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_core.secrets import redact
from tasks.tracking.handle import TrackingHandle, logger, metric_name

__all__ = ["Tracker", "bound_mlflow_http", "drop_tracker", "replay_unsent", "tracker_for"]

Table = tuple[str, dict[str, list[Any]]]  # (artifact file, columns)
MAX_PENDING, MAX_TABLES = 200_000, 50  # metric values, tables kept while the server is away
BATCH = 1000  # MLflow's limit of metrics per log_batch
RETRY_DELAYS = (1.0, 30.0)  # the sender's backoff after a failed send: 1 s doubling to 30 s
# MLflow's REST client takes ~4 min per call to a dead server; ours unless the environment
# sets them: 3 retries after 0, 2, 4 s, 60 s per connect/read (docs/tracking.md).
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
UNSENT_FILE = "mlflow-unsent-metrics.jsonl"  # in the run directory
OUTAGES_TAG, OUTAGE_SECONDS_TAG = "grpoflow.tracking.outages", "grpoflow.tracking.outage_seconds"
OUTAGE_METRIC = "tracking/outage_s"  # one value per outage, at the step it ended
SENDER = "grpoflow-mlflow-sender"


def bound_mlflow_http() -> dict[str, str]:
    """Bounded retries for MLflow's HTTP client (it reads these per request) unless the
    environment sets them; returns the values in force."""
    return {key: os.environ.setdefault(key, value) for key, value in MLFLOW_HTTP_DEFAULTS.items()}


class Tracker:
    """An ``MlflowClient`` bound to one run, its send queue and sender thread, the system
    metrics monitor, and the end of the run. One per run per process (:func:`tracker_for`)."""

    def __init__(self, handle: TrackingHandle) -> None:
        from mlflow import MlflowClient

        bound_mlflow_http()
        self.handle, self.client = handle, MlflowClient(handle.tracking_uri)
        # mlflow.entities.Metric lists: queued, being sent, refused by the server (for the file)
        self.pending, self.inflight, self.rejected = [], [], []
        self.tables, self.table_inflight = [], None  # samples tables: queued, being sent
        self.failing_since: float | None = None  # wall time the current outage was noticed
        self.outages, self.outage_seconds, self.last_step = 0, 0.0, 0
        self.monitor, self._monitor_interval = None, None  # and its interval while it should run
        self._changed = threading.Condition()  # the queue changed / something was sent
        self._retry_at = self._delay = 0.0  # monotonic time of the next attempt; backoff
        self._stop, self._sender, self._drained = False, None, None  # drained: the final flush
        self._log = logger()  # the run's logger reaches the Prefect UI from the sender too

    def _say(self, msg: str, level: int = logging.WARNING) -> None:
        self._log.log(level, redact(msg))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Queue the numeric ``metrics`` at ``step`` for the sender and return at once;
        False while the tracking server is known to be unreachable."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._changed:
            self.pending += [Metric(metric_name(k), float(v), now, int(step))
                             for k, v in metrics.items() if isinstance(v, numbers.Real)]
            self.last_step = max(self.last_step, int(step))
            dropped = self._trim()
            self._changed.notify_all()
        self._dropped(dropped)
        self._ensure_sender()
        return self.failing_since is None

    def log_table(self, artifact_file: str, columns: dict[str, list[Any]]) -> None:
        """Queue a table (``MlflowClient.log_table``); the newest ``MAX_TABLES`` are kept."""
        with self._changed:
            self.tables.append((artifact_file, columns))
            dropped = [t[0] for t in self.tables[:-MAX_TABLES]]
            del self.tables[:-MAX_TABLES]
            self._changed.notify_all()
        if dropped:
            self._say(f"tracking: dropped unsent tables {dropped}")
        self._ensure_sender()

    def _trim(self) -> int:
        del self.pending[: (dropped := max(len(self.pending) - MAX_PENDING, 0))]
        return dropped

    def _dropped(self, n: int) -> None:
        if n:
            self._say(f"tracking: dropped the {n} oldest unsent metric values")

    def flush(self, timeout: float | None = None) -> bool:
        """Have the sender try now (not after its backoff) and wait until everything queued
        is sent, at most ``timeout`` seconds (default ``tracking.flush_timeout_s``; failed
        sends meanwhile are retried after 1 s, 2 s, 4 s, ...). Returns whether all went."""
        self._ensure_sender()
        timeout = self.handle.flush_timeout_s if timeout is None else timeout
        with self._changed:
            self._retry_at, self._delay = 0.0, 0.0
            self._changed.notify_all()
            return self._changed.wait_for(lambda: not (self.pending or self.inflight or self.tables
                                                       or self.table_inflight), timeout)

    def drain(self) -> bool:
        """:meth:`flush` with the end-of-run bound, waited once: after a drain that ran out
        of time, later ones (the failure hook after a failed finish) do not wait again."""
        self._drained = self.flush(0.0 if self._drained is False else None)
        return self._drained

    def _ensure_sender(self) -> None:
        # urllib3 warns at every retry, the sender once per outage (addFilter adds it once)
        logging.getLogger("urllib3.connectionpool").addFilter(_not_from_sender)
        with self._changed:
            if not self._stop and (self._sender is None or not self._sender.is_alive()):
                self._sender = threading.Thread(target=self._send_loop, name=SENDER, daemon=True)
                self._sender.start()

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                while not self._stop and (wait := self._retry_at - time.monotonic()
                                          if self.pending or self.tables else 5) > 0:
                    self._changed.wait(wait)
                if self._stop:
                    return
                self.inflight = chunk = self.pending[:BATCH]  # metrics first, then a table
                del self.pending[: len(chunk)]
                self.table_inflight = table = None if chunk else self.tables.pop(0)
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

    def _failed(self, exc: Exception, chunk: list[Any], table: Table | None, began: float) -> None:
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
                self._delay = min(max(2 * self._delay, RETRY_DELAYS[0]), RETRY_DELAYS[1])
                self._retry_at = time.monotonic() + self._delay
                if self.failing_since is None:
                    self.failing_since, new_outage = began, True
            queued = len(self.pending) + len(self.tables)
            self._changed.notify_all()
        uri = self.handle.tracking_uri
        if refused and table is not None:
            self._say(f"tracking: table {table[0]} not logged ({what})")
        elif refused:
            self._say(f"tracking: {uri} refused {len(chunk)} metric values ({what}); they go to "
                      f"{UNSENT_FILE} at the end of the run")
        elif new_outage:
            self._say(f"tracking: MLflow at {uri} is unreachable ({what}); training goes on, "
                      f"{queued} queued values are kept and sent when it answers again "
                      f"(retrying every {RETRY_DELAYS[0]:.0f}-{RETRY_DELAYS[1]:.0f}s)")
        self._dropped(dropped)

    def _sent(self) -> None:
        with self._changed:
            self.inflight, self.table_inflight, self._delay, self._retry_at = [], None, 0.0, 0.0
            began, self.failing_since = self.failing_since, None
            if began is not None:
                seconds = time.time() - began
                self.outages, self.outage_seconds = self.outages + 1, self.outage_seconds + seconds
            queued = len(self.pending) + len(self.tables)
            self._changed.notify_all()
        if began is None:
            return
        self._say(f"tracking: metrics reach {self.handle.tracking_uri} again after {seconds:.0f}s "
                  f"(outage {self.outages}); sending the {queued} values kept meanwhile",
                  logging.INFO)
        from mlflow.entities import Metric

        try:  # the outages so far as tags on the run, and this one as tracking/outage_s
            self.client.log_batch(
                self.handle.run_id, tags=_outage_tags(self.outages, self.outage_seconds),
                metrics=[Metric(OUTAGE_METRIC, seconds, int(time.time() * 1000), self.last_step)])
        except Exception as exc:
            self._say(f"tracking: outage not recorded on the run ({exc})")
        self._restart_monitor()

    def start_system_metrics(self, interval_s: float, resume: bool) -> None:
        try:
            import psutil  # noqa: F401  (the monitor needs it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError as exc:
            self._say(f"tracking: system metrics off ({exc}; install psutil)")
            return
        self._monitor_interval = interval_s
        self.monitor = SystemMetricsMonitor(self.handle.run_id, sampling_interval=interval_s,
                                            resume_logging=resume,
                                            tracking_uri=self.handle.tracking_uri)
        self.monitor.start()

    def _restart_monitor(self) -> None:
        """A new monitor after an outage (MLflow's stops for good when the server is away)."""
        thread = getattr(self.monitor, "_process", None)
        if self._stop or self._monitor_interval is None or thread is None or thread.is_alive():
            return
        try:
            self.start_system_metrics(self._monitor_interval, resume=True)
        except Exception as exc:
            self._say(f"tracking: system metrics not restarted ({exc})")

    def stop_system_metrics(self) -> None:
        self._monitor_interval = None
        if self.monitor is not None:
            try:
                self.monitor.finish()
            except Exception as exc:
                self._say(f"tracking: system metrics monitor did not stop cleanly: {exc}")
            self.monitor = None

    def detach(self) -> tuple[list[Any], list[Table]]:
        """Stop the sender and the monitor; returns what was not sent (metrics, tables)."""
        self.stop_system_metrics()
        with self._changed:
            self._stop = True
            self._changed.notify_all()
            metrics = [*self.inflight, *self.pending, *self.rejected]
            return metrics, [*([self.table_inflight] if self.table_inflight else []), *self.tables]

    def adopt(self, metrics: list[Any], tables: list[Table]) -> None:
        """Queue what an earlier tracker of the same run left unsent."""
        with self._changed:
            self.pending[:0], self.tables[:0] = metrics, tables
            self._changed.notify_all()
        if metrics or tables:
            self._ensure_sender()

    def end(self, status: str) -> dict[str, Any]:
        """End the run (see the module docstring); never raises for an unreachable server.
        Returns ``tracking_outages``, ``tracking_outage_seconds``, and ``unsent_file``,
        ``unsent_values``, ``unsent_tables`` when a file was written."""
        self.stop_system_metrics()
        self.drain()
        ongoing, (metrics, tables) = self.failing_since, self.detach()
        outages, seconds = self.outages, self.outage_seconds
        if ongoing is not None:  # still down: count this outage up to now
            outages, seconds = outages + 1, seconds + time.time() - ongoing
        report = {"tracking_outages": outages, "tracking_outage_seconds": round(seconds, 1)}
        terminated = False
        try:
            if outages:
                self.client.log_batch(self.handle.run_id, tags=_outage_tags(outages, seconds))
            self.client.set_terminated(self.handle.run_id, status=status)
            terminated = True
        except Exception as exc:
            self._say(f"tracking: could not mark run {self.handle.run_id} {status} "
                      f"({type(exc).__name__}: {str(exc)[:200]})")
        if not (metrics or tables) and terminated:
            return report
        if path := self._write_unsent(metrics, tables, None if terminated else status, report):
            report.update(unsent_file=str(path), unsent_values=len(metrics),
                          unsent_tables=len(tables))
            self._say(f"tracking: {len(metrics)} metric values and {len(tables)} tables did not "
                      f"reach {self.handle.tracking_uri} within tracking.flush_timeout_s="
                      f"{self.handle.flush_timeout_s:g}s"
                      + ("" if terminated else f" (nor the run's status {status})")
                      + f"; written to {path}. Send them when the server is back: "
                      f"grpoflow tracking replay {path}")
        return report

    def _write_unsent(self, metrics: list[Any], tables: list[Table], status: str | None,
                      report: Mapping[str, Any]) -> Path | None:
        """Append the unsent values to the run directory's unsent-metrics file (JSON lines:
        one ``run`` header, then ``metric`` and ``table`` records)."""
        h = self.handle
        path = Path(h.run_dir or ".").resolve() / UNSENT_FILE
        lines: list[dict[str, Any]] = [
            {"kind": "run", "run_id": h.run_id, "run_name": h.run_name,
             "tracking_uri": redact(h.tracking_uri), "status": status,
             "outages": report["tracking_outages"],
             "outage_seconds": report["tracking_outage_seconds"], "written_at": time.time()},
            *({"kind": "metric", "run_id": h.run_id, "key": m.key, "value": m.value,
               "step": m.step, "timestamp": m.timestamp} for m in metrics),
            *({"kind": "table", "run_id": h.run_id, "artifact_file": name, "table": columns}
              for name, columns in tables),
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(line, default=str) + "\n" for line in lines)
        except OSError as exc:
            self._say(f"tracking: could not write {path} ({exc}); {len(metrics)} metric values "
                      f"and {len(tables)} tables of run {h.run_id} are lost", logging.ERROR)
            return None
        return path


def _not_from_sender(record: logging.LogRecord) -> bool:
    return record.threadName != SENDER


def _refused(exc: Exception) -> bool:
    """Whether the server answered and refused (a 4xx other than 408/429, or bad data):
    sending the same again would not help."""
    code = 0
    with contextlib.suppress(Exception):  # an MLflow RestException has the HTTP status
        code = int(exc.get_http_status_code())  # type: ignore[attr-defined]
    return isinstance(exc, ValueError | TypeError) or (400 <= code < 500 and code not in (408, 429))


def _outage_tags(outages: int, seconds: float) -> list[Any]:
    from mlflow.entities import RunTag

    return [RunTag(OUTAGES_TAG, str(outages)), RunTag(OUTAGE_SECONDS_TAG, f"{seconds:.1f}")]


_TRACKERS: dict[str, Tracker] = {}
_TRACKERS_LOCK = threading.Lock()


def tracker_for(handle: TrackingHandle) -> Tracker:
    """The process's :class:`Tracker` for ``handle`` (created on first use)."""
    with _TRACKERS_LOCK:
        return _TRACKERS.get(handle.run_id) or _TRACKERS.setdefault(handle.run_id, Tracker(handle))


def drop_tracker(run_id: str) -> Tracker | None:
    """Forget the process's tracker of ``run_id`` (its run ended or is re-opened)."""
    with _TRACKERS_LOCK:
        return _TRACKERS.pop(run_id, None)


def trackers_of_flow_run(flow_run_id: str) -> list[Tracker]:
    with _TRACKERS_LOCK:
        return [t for t in _TRACKERS.values() if t.handle.flow_run_id == flow_run_id]


def replay_unsent(path: str | Path, tracking_uri: str | None = None) -> dict[str, int]:
    """Send an unsent-metrics file to ``tracking_uri`` (default ``MLFLOW_TRACKING_URI``, else
    the file's): its values not yet in the run (same key, step, timestamp and value; a second
    replay sends nothing), tables, outage tags and ``grpoflow.tracking.replayed``; a run left
    ``RUNNING`` ends with the recorded status. Returns counts."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag

    bound_mlflow_http()
    runs: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            if not line.strip():
                continue
            rec = json.loads(line)
            run = runs.setdefault(rec["run_id"], {"metrics": [], "tables": [], "header": {}})
            if (kind := rec.get("kind", "metric")) == "run":
                run["header"] = rec
            else:
                run[kind + "s"].append((rec["artifact_file"], rec["table"])
                                       if kind == "table" else rec)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not an unsent-metrics record ({exc})") from exc
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or next(
        (r["header"].get("tracking_uri") for r in runs.values() if r["header"]), None)
    if not uri:
        raise ValueError(f"{path}: no tracking URI; pass one (or set MLFLOW_TRACKING_URI)")
    client = MlflowClient(uri)
    out = {"runs": len(runs), "metrics": 0, "skipped": 0, "tables": 0}
    for run_id, run in runs.items():
        have: dict[str, set[tuple[int, int, str]]] = {}
        new = []
        for m in run["metrics"]:
            if (key := m["key"]) not in have:
                have[key] = {(x.step, x.timestamp, repr(float(x.value)))
                             for x in client.get_metric_history(run_id, key)}
            mark = (int(m["step"]), int(m["timestamp"]), repr(float(m["value"])))
            if mark in have[key]:
                out["skipped"] += 1
                continue
            have[key].add(mark)
            new.append(Metric(key, float(m["value"]), mark[1], mark[0]))
        for i in range(0, len(new), BATCH):
            client.log_batch(run_id, metrics=new[i : i + BATCH], synchronous=True)
        for name, columns in run["tables"]:
            client.log_table(run_id, columns, name)
        out["metrics"] += len(new)
        out["tables"] += len(run["tables"])
        header = run["header"]
        tags = [RunTag("grpoflow.tracking.replayed", f"{Path(path).name}: {len(new)} values")]
        if header.get("outages"):
            tags += _outage_tags(int(header["outages"]), float(header.get("outage_seconds", 0)))
        client.log_batch(run_id, tags=tags)
        if header.get("status") and client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=header["status"])
    return out
