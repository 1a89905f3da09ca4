"""The metrics sender: per-step metrics and samples tables leave the training loop through a
:class:`Tracker`'s queue, which a daemon thread (``grpoflow-mlflow-sender``) sends, keeping
them through outages; what is left at the end goes to the unsent-metrics file, which
:func:`replay_unsent` sends later (limits, backoff: docs/tracking.md, 'When the server goes
away'). Never blocks the caller on the server, never raises from queueing, never logs
unredacted.
"""

from __future__ import annotations

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
from tasks.tracking.handle import TrackingHandle, metric_name
from tasks.tracking.images import portable, prepare_in_background, restore, send_table
from tasks.tracking.outbox import RETRY_DELAYS, Outbox, bound_mlflow_http

__all__ = ["Tracker", "bound_mlflow_http", "drop_tracker", "replay_unsent", "tracker_for"]

Table = tuple[str, dict[str, list[Any]]]  # (artifact file, columns)
Unit = tuple[list[Any], Table | None]  # what one send carries: metrics, or else a table
MAX_PENDING, MAX_TABLES = 200_000, 50  # metric values, tables kept while the server is away
BATCH = 1000  # MLflow's limit of metrics per log_batch
UNSENT_FILE = "mlflow-unsent-metrics.jsonl"  # in the run directory
OUTAGES_TAG, OUTAGE_SECONDS_TAG = "grpoflow.tracking.outages", "grpoflow.tracking.outage_seconds"
OUTAGE_METRIC = "tracking/outage_s"  # one value per outage, at the step it ended
SENDER = "grpoflow-mlflow-sender"


class Tracker(Outbox[Unit]):
    """An ``MlflowClient`` bound to one run, its outbox of metrics and tables, the system
    metrics monitor, and the end of the run. One per run per process (:func:`tracker_for`)."""

    thread_name = SENDER

    def __init__(self, handle: TrackingHandle) -> None:
        from mlflow import MlflowClient

        super().__init__(handle.tracking_uri)
        bound_mlflow_http()
        self.handle, self.client = handle, MlflowClient(handle.tracking_uri)
        # mlflow.entities.Metric lists: queued, refused by the server (for the file)
        self.pending, self.rejected, self.tables = [], [], []  # tables: queued
        self.last_step, self._dropped_n = 0, 0
        self.monitor, self._monitor_interval = None, None  # and its interval while it should run
        self._drained = None  # the final flush's outcome

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Queue the numeric ``metrics`` at ``step`` for the sender and return at once;
        False while the tracking server is known to be unreachable."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._changed:
            self.pending += [Metric(metric_name(k), float(v), now, int(step))
                             for k, v in metrics.items() if isinstance(v, numbers.Real)]
            self.last_step = max(self.last_step, int(step))
            self._trim_locked()
            self._changed.notify_all()
        self._after_failure()
        self.ensure_thread()
        return self.failing_since is None

    def log_table(self, artifact_file: str, columns: dict[str, list[Any]]) -> None:
        """Queue a table (``MlflowClient.log_table``; image cells: ``images.send_table``);
        the newest ``MAX_TABLES`` are kept. Its thumbnails are made on a thread of their own."""
        prepare_in_background(columns)
        with self._changed:
            self.tables.append((artifact_file, columns))
            dropped = [t[0] for t in self.tables[:-MAX_TABLES]]
            del self.tables[:-MAX_TABLES]
            self._changed.notify_all()
        if dropped:
            self.say(f"tracking: dropped unsent tables {dropped}")
        self.ensure_thread()

    def _trim_locked(self) -> None:
        del self.pending[: (dropped := max(len(self.pending) - MAX_PENDING, 0))]
        self._dropped_n += dropped

    def _after_failure(self) -> None:
        with self._changed:
            n, self._dropped_n = self._dropped_n, 0
        if n:
            self.say(f"tracking: dropped the {n} oldest unsent metric values")

    # the outbox's units: up to BATCH metric values, else the oldest table
    def _queued_locked(self) -> int:
        return len(self.pending) + len(self.tables)

    def _take_locked(self) -> Unit:
        chunk = self.pending[:BATCH]
        del self.pending[: len(chunk)]
        return chunk, (None if chunk else self.tables.pop(0))

    def _send(self, item: Unit) -> None:
        chunk, table = item
        if table is None:
            self.client.log_batch(self.handle.run_id, metrics=chunk, synchronous=True)
        else:
            send_table(self.client, self.handle.run_id, table[0], table[1])

    def _put_back_locked(self, item: Unit) -> None:
        chunk, table = item
        self.pending[:0] = chunk
        if table is not None:
            self.tables.insert(0, table)
        self._trim_locked()

    def _refuse_locked(self, item: Unit) -> None:
        self.rejected += item[0]

    def _on_refused(self, item: Unit, what: str) -> None:
        chunk, table = item
        if table is not None:
            self.say(f"tracking: table {table[0]} not logged ({what})")
        else:
            self.say(f"tracking: {self.uri} refused {len(chunk)} metric values ({what}); they go "
                     f"to {UNSENT_FILE} at the end of the run")  # fmt: skip

    def _on_outage(self, what: str, queued: int) -> None:
        self.say(f"tracking: MLflow at {self.uri} is unreachable ({what}); training goes on, "
                 f"{queued} queued values are kept and sent when it answers again "
                 f"(retrying every {RETRY_DELAYS[0]:.0f}-{RETRY_DELAYS[1]:.0f}s)")

    def _on_back(self, seconds: float, queued: int) -> None:
        self.say(f"tracking: metrics reach {self.uri} again after {seconds:.0f}s "
                 f"(outage {self.outages}); sending the {queued} values kept meanwhile",
                 logging.INFO)
        from mlflow.entities import Metric

        try:  # the outages so far as tags on the run, and this one as tracking/outage_s
            self.client.log_batch(
                self.handle.run_id, tags=_outage_tags(self.outages, self.outage_seconds),
                metrics=[Metric(OUTAGE_METRIC, seconds, int(time.time() * 1000), self.last_step)])
        except Exception as exc:
            self.say(f"tracking: outage not recorded on the run ({exc})")
        self._restart_monitor()

    def flush(self, timeout: float | None = None) -> bool:
        """:meth:`Outbox.flush`, by default within ``tracking.flush_timeout_s``."""
        return super().flush(self.handle.flush_timeout_s if timeout is None else timeout)

    def drain(self) -> bool:
        """:meth:`flush` with the end-of-run bound, waited once: after a drain that ran out
        of time, later ones (the failure hook after a failed finish) do not wait again."""
        self._drained = self.flush(0.0 if self._drained is False else None)
        return self._drained

    def start_system_metrics(self, interval_s: float, resume: bool) -> None:
        try:
            import psutil  # noqa: F401  (the monitor needs it)
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError as exc:
            self.say(f"tracking: system metrics off ({exc}; install psutil)")
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
            self.say(f"tracking: system metrics not restarted ({exc})")

    def stop_system_metrics(self) -> None:
        self._monitor_interval = None
        if self.monitor is not None:
            try:
                self.monitor.finish()
            except Exception as exc:
                self.say(f"tracking: system metrics monitor did not stop cleanly: {exc}")
            self.monitor = None

    def detach(self) -> tuple[list[Any], list[Table]]:
        """Stop the sender and the monitor; returns what was not sent (metrics, tables)."""
        self.stop_system_metrics()
        self.stop()
        with self._changed:
            chunk, table = self.inflight or ([], None)
            return [*chunk, *self.pending, *self.rejected], [*([table] if table else []),
                                                             *self.tables]

    def adopt(self, metrics: list[Any], tables: list[Table]) -> None:
        """Queue what an earlier tracker of the same run left unsent."""
        with self._changed:
            self.pending[:0], self.tables[:0] = metrics, tables
            self._changed.notify_all()
        if metrics or tables:
            self.ensure_thread()

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
            self.say(f"tracking: could not mark run {self.handle.run_id} {status} "
                      f"({type(exc).__name__}: {str(exc)[:200]})")
        if not (metrics or tables) and terminated:
            return report
        if path := self._write_unsent(metrics, tables, None if terminated else status, report):
            report.update(unsent_file=str(path), unsent_values=len(metrics),
                          unsent_tables=len(tables))
            self.say(f"tracking: {len(metrics)} metric values and {len(tables)} tables did not "
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
            *({"kind": "table", "run_id": h.run_id, "artifact_file": name,
               "table": portable(columns)} for name, columns in tables),
        ]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(line, default=str) + "\n" for line in lines)
        except OSError as exc:
            self.say(f"tracking: could not write {path} ({exc}); {len(metrics)} metric values "
                      f"and {len(tables)} tables of run {h.run_id} are lost", logging.ERROR)
            return None
        return path


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
            send_table(client, run_id, name, restore(columns))
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
