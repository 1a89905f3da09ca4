"""Experiment tracking with MLflow, the system of record (run, params, metrics, samples,
checkpoints, evaluations, the registered model). The flow never touches MLflow: it passes a
:class:`TrackingHandle` (``None`` when tracking is off: everything then does nothing) to what
is exported here. Modules and contracts: docs/tracking.md. No secret reaches MLflow; MLflow is
imported here and in :mod:`tasks.tracking.registry` only, never by ``rl_core``.
"""

from tasks.tracking.artifacts import log_checkpoint, log_evaluation, log_step, sample_rows
from tasks.tracking.handle import TrackingHandle, eval_metrics, metric_name
from tasks.tracking.run import (
    finish_tracking,
    project_store,
    resolve_tracking_uri,
    start_tracking,
    tracking_failed,
)
from tasks.tracking.sender import Tracker, bound_mlflow_http, replay_unsent, tracker_for
from tasks.tracking.traces import choose_episodes, close_traces, flush_traces, log_traces

__all__ = [
    "TrackingHandle", "Tracker", "bound_mlflow_http", "choose_episodes", "close_traces",
    "eval_metrics", "finish_tracking", "flush_traces", "log_checkpoint", "log_evaluation",
    "log_step", "log_traces", "metric_name", "project_store", "replay_unsent", "resolve_tracking_uri",
    "sample_rows", "start_tracking", "tracker_for", "tracking_failed",
]
