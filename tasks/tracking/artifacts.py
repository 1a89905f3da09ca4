"""What a run records besides its params: per-step metrics and samples tables (queued for
the sender), checkpoints (artifacts, or a reference to object storage), evaluations as nested
runs, and the reward/accuracy curve. Each task takes ``None`` for the handle (tracking off)
and does nothing; none fails the flow (what MLflow cannot take is warned about and skipped).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import task

from rl_core import storage
from rl_core.checkpoint import step_dir_name
from rl_core.secrets import redact
from tasks.tracking.handle import (
    KIND_TAG,
    PARENT_TAG,
    RUN_NAME_TAG,
    STEP_TAG,
    TASK_OPTIONS,
    TrackingHandle,
    eval_metrics,
    metric_name,
    retrying,
    warn,
)
from tasks.tracking.images import send_table, with_images
from tasks.tracking.sender import Tracker, tracker_for

__all__ = ["columns", "log_checkpoint", "log_curve", "log_evaluation", "log_step", "sample_rows"]


def log_step(handle: TrackingHandle | None, step: int, metrics: Mapping[str, Any],
             samples: Sequence[Mapping[str, Any]] | None = None) -> bool:
    """Queue one step's metrics (and every ``samples_every`` steps and at the last, a samples
    table ``samples/step-NNNNNN.json``, its rows' images in ``samples/step-NNNNNN/``) for
    the sender. Not a task: returns at once, never raises; False while the server is known to
    be unreachable."""
    if handle is None:
        return True
    healthy = (tracker := tracker_for(handle)).log_metrics(step, metrics)
    if samples and handle.samples_due(step):
        folder = f"samples/{step_dir_name(step)}"
        tracker.log_table(f"{folder}.json",
                          columns(with_images(samples[: handle.samples_rows], folder)))
    return healthy


def columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Rows as the column mapping ``MlflowClient.log_table`` takes."""
    return {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}


def sample_rows(samples: Sequence[Any], tokenizer: Any = None,
                limit: int = 16) -> list[dict[str, Any]]:
    """Samples-table rows of the first ``limit`` ``rl_core.types.Sample`` objects (whole groups:
    they are contiguous), prompts decoded by ``tokenizer`` when given, then the sample's
    dataset columns (non-text ones as JSON); a sample with images also carries them under
    ``images`` (its own bytes, not copied: :func:`log_step` makes the table's image columns)."""
    from rl_core.data.records import cell_text, cell_texts

    rows = []
    for s in list(samples)[:limit]:
        row = {"uid": s.uid,
               "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=False)
               if tokenizer else s.record_id,
               "completion": s.text, "answer": cell_text(s.answer),
               "reward": float(s.reward), "correct": bool(s.correct),
               "truncated": bool(s.truncated), "tokens": len(s.completion_ids),
               "weight_version": int(s.weight_version)}
        if images := tuple(getattr(s, "images", None) or ()):
            row["images"] = images
        rows.append({**row, **cell_texts(getattr(s, "columns", None) or {}, skip=tuple(row))})
    return rows


@task(name="log-evaluation", task_run_name="log-evaluation-step-{step}", timeout_seconds=300,
      **TASK_OPTIONS)
def log_evaluation(handle: TrackingHandle | None, step: int,
                   result: Mapping[str, Any]) -> str | None:
    """An evaluation as a nested run (``eval-step-N``: metrics, tags, its sample generations
    with their prompts' images, if any) and as ``eval/*`` metrics on the training run at
    ``step``. A redone evaluation of the same step (after a resume) replaces the earlier
    nested run. Returns the nested run's id."""
    if handle is None:
        return None
    from mlflow.entities import Metric, RunStatus, RunTag

    (tracker := tracker_for(handle)).log_metrics(step, eval_metrics(result))
    client = tracker.client
    try:
        for old in client.search_runs([handle.experiment_id], filter_string=(
                f"tags.`{PARENT_TAG}` = '{handle.run_id}' and tags.`{STEP_TAG}` = '{step}'")):
            client.delete_run(old.info.run_id)
        child = client.create_run(handle.experiment_id, run_name=f"eval-step-{step}", tags={
            PARENT_TAG: handle.run_id, KIND_TAG: "evaluation", STEP_TAG: str(step),
            RUN_NAME_TAG: handle.run_name}).info.run_id
        now = int(time.time() * 1000)
        extra = {"weight_version": result.get("weight_version"), "k": result.get("k")}
        client.log_batch(child, tags=[RunTag(k, str(v)) for k, v in extra.items() if v is not None],
                         metrics=[Metric(metric_name(k), v, now, step)
                                  for k, v in eval_metrics(result, "").items()])
        if result.get("samples"):
            send_table(client, child, "samples.json",
                       columns(with_images(result["samples"], "samples")))
        client.set_terminated(child, status=RunStatus.to_string(RunStatus.FINISHED))
        return child
    except Exception as exc:
        warn(f"tracking: evaluation run of step {step} not logged ({type(exc).__name__}: {exc})")
        return None


@task(name="log-checkpoint", task_run_name="log-checkpoint-step-{step}", timeout_seconds=1800,
      **TASK_OPTIONS)
def log_checkpoint(handle: TrackingHandle | None, step: int, root: str) -> str | None:
    """Record the checkpoint of ``step`` under ``root``: a local one as artifacts
    (``checkpoints/step-NNNNNN/``), one in object storage by its (redacted) URI only, never uploaded
    twice. Tags ``checkpoint/step-NNNNNN`` and ``checkpoint/latest`` point there; returns where."""
    if handle is None:
        return None
    from mlflow.entities import RunTag

    tracker, name = tracker_for(handle), step_dir_name(step)
    target, client = storage.join(root.removeprefix("file://"), name), tracker.client
    try:
        if not storage.is_remote(root) and handle.checkpoint_artifacts:
            retrying(f"logging checkpoint {name}",
                     lambda: client.log_artifacts(handle.run_id, target, f"checkpoints/{name}"),
                     attempts=1 if tracker.failing_since is not None else 3)  # known outage
            target = f"{client.get_run(handle.run_id).info.artifact_uri}/checkpoints/{name}"
        target = redact(target)
        client.log_batch(handle.run_id, tags=[RunTag(f"checkpoint/{name}", target),
                                              RunTag("checkpoint/latest", target)])
        return target
    except Exception as exc:
        warn(f"tracking: checkpoint {name} not recorded ({type(exc).__name__}: {exc})")
        return None


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    """A metric's history, the latest value per step (redone steps after a resume)."""
    latest: dict[int, Any] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in latest or m.timestamp >= latest[m.step].timestamp:
            latest[m.step] = m
    return [(s, latest[s].value) for s in sorted(latest)]


def log_curve(tracker: Tracker) -> str | None:
    """``plots/reward_accuracy.png``: training reward and accuracy per step, greedy eval
    pass@1 at each evaluation; None when there is nothing to draw."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    client, run_id = tracker.client, tracker.handle.run_id
    series = [("reward mean (train)", "reward_mean", {}),
              ("accuracy (train)", "accuracy", {"linestyle": "--"}),
              ("pass@1 (eval, greedy)", "eval/pass_at_1", {"marker": "o"})]
    points = [(label, _history(client, run_id, key), style) for label, key, style in series]
    if not any(p for _, p, _ in points):
        return None
    fig = Figure(figsize=(7, 4), dpi=100, layout="tight")  # saved through Agg, never pyplot
    ax = fig.add_subplot()
    for label, pts, style in points:
        if pts:
            ax.plot(*zip(*pts, strict=True), markersize=4, label=label, **style)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="step", ylim=(0, None), title=f"{tracker.handle.run_name}: reward and accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    client.log_figure(run_id, fig, "plots/reward_accuracy.png")
    return "plots/reward_accuracy.png"
