"""What every part of :mod:`tasks.tracking` shares: the :class:`TrackingHandle` the flow
carries, MLflow-safe metric names, the tag names, bounded retries and logging that redacts.

Never imports MLflow; never logs a line that has not been through :func:`rl_core.secrets.redact`.
"""

from __future__ import annotations

import logging
import numbers
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

from prefect import get_run_logger
from prefect.cache_policies import NO_CACHE

from rl_core.secrets import redact

T = TypeVar("T")
TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE, "log_prints": False}
RUN_NAME_TAG, KIND_TAG, STEP_TAG = "grpoflow.run_name", "grpoflow.kind", "grpoflow.step"
PARENT_TAG = "mlflow.parentRunId"
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- ]")
_log = logging.getLogger("tasks.tracking")


def metric_name(key: str) -> str:
    """A metric/param/tag key MLflow accepts: ``@`` becomes ``_at_`` (``pass@4`` ->
    ``pass_at_4``), other characters outside ``[A-Za-z0-9_.-/ ]`` become ``_``, and the
    name is a normalised relative path (MLflow treats names as file paths)."""
    name = _BAD_NAME_CHARS.sub("_", str(key).replace("@", "_at_"))
    return "/".join(p for p in name.split("/") if p not in ("", ".", ".."))[:250] or "_"


def eval_metrics(result: Mapping[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """An evaluation result (``rl_core.evaluation.EvalResult.to_dict()``) as metrics."""
    keys = ("pass_at_1", "response_len_mean", "truncation_rate", "seconds", "num_examples")
    out = {f"{prefix}{k}": result.get(k) for k in keys}
    if result.get("pass_at_k") is not None:
        out[f"{prefix}pass_at_{result.get('k')}"] = result["pass_at_k"]
    out.update({f"{prefix}{k}": v for k, v in (result.get("episodes") or {}).items()})
    out.update({f"{prefix}reward/{k}": v for k, v in (result.get("rewards") or {}).items()})
    return {k: float(v) for k, v in out.items() if isinstance(v, numbers.Real)}


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
        return (f"TrackingHandle(uri={redact(self.tracking_uri)!r}, experiment="
                f"{self.experiment_id}, run={self.run_id}, name={self.run_name!r})")

    def samples_due(self, step: int) -> bool:
        return (every := self.samples_every) > 0 and (step % every == 0 or step == self.total_steps)

    def run_url(self) -> str | None:
        """The run's page in the MLflow UI, when the tracking URI is a server; a link, so
        without the URI's user-info rather than with it masked."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return None
        p = urlparse(self.tracking_uri)
        base = f"{p.scheme}://{p.netloc.rsplit('@', 1)[-1]}{p.path}".rstrip("/")
        return f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger (it reaches the UI), or this package's outside a run."""
    try:
        return get_run_logger()
    except Exception:  # outside a flow or task run
        return _log


def warn(msg: str) -> None:
    logger().warning(redact(msg))


def info(msg: str) -> None:
    logger().info(redact(msg))


def retrying(what: str, fn: Callable[[], T], attempts: int = 3,
             delays: Sequence[float] = (2, 8)) -> T:
    """``fn()`` with bounded retries (network blips); the last failure is raised."""
    for i in range(attempts - 1):
        try:
            return fn()
        except Exception as exc:
            delay = delays[min(i, len(delays) - 1)]
            warn(f"tracking: {what} failed ({type(exc).__name__}: {exc}); retrying in {delay}s")
            time.sleep(delay)
    return fn()
