"""The MLflow run's lifecycle: open it (or re-attach on resume) with params, tags and dataset
inputs; close it (curve, registered model, status); the flow hook that marks it FAILED. One
experiment per config name (or ``tracking.experiment``), one run per training run. Starting and
registering fail loudly after retries (docs/tracking.md, 'When tracking fails'). Never writes an
unredacted param, tag or error, and never chains MLflow's exception (it holds the raw URI).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from rl_core import storage
from rl_core.cluster.platform import detect_platform
from rl_core.config import ExperimentConfig, flatten
from rl_core.secrets import redact, redact_config
from tasks.setup import PreparedData
from tasks.tracking.artifacts import log_curve
from tasks.tracking.handle import (
    KIND_TAG,
    RUN_NAME_TAG,
    TASK_OPTIONS,
    TrackingHandle,
    info,
    metric_name,
    warn,
)
from tasks.tracking.sender import bound_mlflow_http, drop_tracker, tracker_for, trackers_of_flow_run
from tasks.tracking.traces import close_traces

__all__ = ["finish_tracking", "resolve_tracking_uri", "start_tracking", "tracking_failed"]

PARAM_BATCH = 100  # MLflow's limit of params, and of tags, per log_batch


def project_store(cfg: ExperimentConfig) -> Path | None:
    """The project's SQLite store, ``<storage.root>/mlflow.db`` (``tracking.store=project``
    with a local root), whether it exists yet or not; else None."""
    if cfg.tracking.store != "project" or "://" in cfg.storage.root:
        return None
    return Path(cfg.storage.root).expanduser().resolve() / "mlflow.db"


def resolve_tracking_uri(cfg: ExperimentConfig, run_dir: str | Path) -> tuple[str, str | None]:
    """``(tracking_uri, artifact_location)``: ``tracking.uri``, else ``MLFLOW_TRACKING_URI``,
    else SQLite in ``storage.root`` (``tracking.store=project``; a remote root: the run
    directory) or in the run directory, whose new experiments keep their artifacts beside it
    (not in ``./mlruns`` of the process's directory); on a server (None) the server decides."""
    if not (uri := cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        db = project_store(cfg) or Path(run_dir).resolve() / "mlflow.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db}"
    if uri.startswith("sqlite:///"):
        return uri, (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return uri, None


def _git(*args: str) -> str | None:
    """``git args`` in the repository this code runs from; bounded to a few seconds."""
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[2],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _run_tags(cfg: ExperimentConfig, run_name: str) -> dict[str, str]:
    from prefect.runtime import flow_run

    tags = {RUN_NAME_TAG: run_name, KIND_TAG: "training", "grpoflow.config": cfg.name}
    if flow_run.id:
        tags["prefect.flow_run_id"], tags["prefect.flow_run_name"] = flow_run.id, flow_run.name
        ui = os.environ.get("PREFECT_UI_URL")
        if url := flow_run.ui_url or (ui and f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}"):
            tags["prefect.flow_run_url"] = url
    if commit := _git("rev-parse", "HEAD"):
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        tags["mlflow.source.git.commit"] = commit
        tags["grpoflow.git_dirty"] = "none" if dirty is None else str(bool(dirty)).lower()
    try:
        p = detect_platform()
        tags.update({"grpoflow.platform": p.kind, "grpoflow.device_count": p.device_count,
                     "grpoflow.devices": ", ".join(p.device_names) or f"{p.cpu_count} CPU cores",
                     "grpoflow.torch": p.torch_version or "", "grpoflow.python": p.python_version})
    except Exception as exc:  # never fail a run for a description of the machine
        tags["grpoflow.platform"] = f"unknown ({type(exc).__name__})"
    return {k: redact(v) for k, v in tags.items() if v is not None}


def _dataset_inputs(cfg: ExperimentConfig, data: PreparedData) -> list[Any]:
    """The prepared train and eval sets as MLflow dataset inputs (metadata only)."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types import ColSpec, Schema

    schema = Schema([ColSpec("string", c) for c in ("id", "question", "answer")])
    splits = (("training", data.source, cfg.data.train_split, data.train_path,
               data.train_digest, data.num_train),
              ("evaluation", cfg.data.eval_source or data.source, cfg.data.eval_split,
               data.eval_path, data.eval_digest, data.num_eval))
    out = []
    for context, source, split, path, digest, count in splits:
        source = redact(source)
        short = Path((urlparse(source).path if "://" in source else source).rstrip("/")).name
        ds = MetaDataset(_dataset_source(source, cfg, split), digest=digest[:32], schema=schema,
                         name=metric_name(f"{short or source}-{split}")[:500])
        tags = [InputTag("mlflow.data.context", context), InputTag("grpoflow.digest", digest),
                InputTag("grpoflow.records", str(count)),
                InputTag("grpoflow.snapshot", redact(path)[:500])]
        out.append(DatasetInput(ds._to_mlflow_entity(), tags))
    return out


def _dataset_source(source: str, cfg: ExperimentConfig, split: str) -> Any:
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if source == "synthetic":
        knobs = {k: list(v) if isinstance(v, tuple) else v
                 for k, v in cfg.data.synthetic_knobs().items()}
        return CodeDatasetSource({"generator": "rl_core.data.synthetic", "split": split, **knobs})
    if "://" in source or Path(source).exists() or source.endswith((".jsonl", ".parquet")):
        try:
            return resolve_dataset_source(source)
        except Exception:
            return CodeDatasetSource({"uri": source, "split": split})
    return HuggingFaceDatasetSource(path=source, config_name=cfg.data.subset, split=split)


def _run_to_resume(client: Any, experiment_id: str, run_name: str, run_id: str | None) -> Any:
    """The live run ``run_id``, else the newest training run tagged ``run_name``, else None."""
    if run_id is None and "'" not in run_name:  # a quote is not expressible in a filter
        found = client.search_runs(
            [experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
            filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}' and "
                          f"tags.`{KIND_TAG}` = 'training'")
        run_id = found[0].info.run_id if found else None
    try:
        run = client.get_run(run_id) if run_id else None
    except Exception:
        return None
    return run if run is not None and run.info.lifecycle_stage == "active" else None


def _link_artifact(h: TrackingHandle, where: str) -> None:
    """A Prefect artifact linking to the MLflow run (for a local store: the `mlflow ui` command)."""
    from tasks.evaluate import artifact_key  # it imports the planes

    desc, key = f"MLflow run {h.run_id}", artifact_key("mlflow", h.run_name or h.run_id)
    try:
        if h.run_url():
            create_link_artifact(link=where, link_text=desc, key=key, description=desc)
        else:
            create_markdown_artifact(key=key, description=desc, markdown=f"**{desc}** "
                                     f"(experiment {h.experiment_id}): `{where}`")
    except Exception as exc:  # the link is a convenience; tracking itself worked
        warn(f"tracking: no Prefect link artifact ({type(exc).__name__}: {exc})")


@task(name="start-tracking", timeout_seconds=300, retries=2, retry_delay_seconds=[5, 20],
      **TASK_OPTIONS)
def start_tracking(cfg: ExperimentConfig, run_dir: str, data: PreparedData | None = None,
                   resume_from: str | None = None,
                   resume_run_id: str | None = None) -> TrackingHandle | None:
    """Open this training run's MLflow run (``None`` when tracking is off), or on resume
    (``resume_from``, ``resume_run_id``) re-attach to the one the checkpoint or run name points to;
    tags, redacted config as params and ``config.yaml``, datasets, system metrics monitor."""
    if cfg.tracking.backend == "none":
        return None
    from mlflow import MlflowClient
    from mlflow.entities import Param, RunStatus, RunTag

    bound_mlflow_http()
    uri, artifact_location = resolve_tracking_uri(cfg, run_dir)
    run_name, exp_name = Path(run_dir).name, cfg.tracking.experiment or cfg.name
    try:
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(exp_name)
        experiment_id = exp.experiment_id if exp is not None else client.create_experiment(
            exp_name, artifact_location=artifact_location)
    except Exception as exc:
        # ``from None``: MLflow's own exception holds the URI as given (password included),
        # and Prefect logs a failure's whole chain; its useful part is in the message, redacted.
        raise RuntimeError(
            f"MLflow at {redact(uri)} is not usable ({type(exc).__name__}: "
            f"{redact(str(exc))[:300]}); check tracking.uri / MLFLOW_TRACKING_URI, or set "
            "tracking.backend=none") from None

    run_id, resume_step = None, None
    if resume_from or resume_run_id:
        try:  # the checkpoint's state.json (local or s3://) carries the step and the run id
            state = json.loads(storage.read_bytes(storage.join(resume_from, "state.json")))
        except Exception:  # none given, or unreadable
            state = {}
        resume_step = state.get("step")
        previous = _run_to_resume(client, experiment_id, run_name,
                                  resume_run_id or state.get("tracking_run_id"))
        if previous is None:
            warn(f"tracking: no MLflow run to resume for {run_name}; starting a new one")
        else:
            run_id, experiment_id = previous.info.run_id, previous.info.experiment_id
    if resumed := run_id is not None:
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    else:
        run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
    try:
        tags = _run_tags(cfg, run_name)
        if resume_step is not None:
            tags["grpoflow.resumed_from_step"] = str(resume_step)
        params = {k: v if isinstance(v, str) else json.dumps(v)
                  for k, v in redact_config(flatten(cfg)).items()}
        existing = client.get_run(run_id).data.params if resumed else {}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v[:6000])
        if changed:
            warn(f"tracking: resumed with changed config values (kept the originals): {changed}")
            tags["grpoflow.params_changed_on_resume"] = ", ".join(changed)[:8000]
        run_tags = [RunTag(metric_name(k), v) for k, v in tags.items()]
        new = [Param(metric_name(k), v) for k, v in params.items() if k not in existing]
        for i in range(0, max(len(run_tags), len(new)), PARAM_BATCH):
            client.log_batch(run_id, params=new[i : i + PARAM_BATCH],
                             tags=run_tags[i : i + PARAM_BATCH])
        if not resumed:
            client.log_dict(run_id, redact_config(cfg.model_dump(mode="json")), "config.yaml")
            if data is not None:
                client.log_inputs(run_id, datasets=_dataset_inputs(cfg, data))
    except BaseException:
        if not resumed:  # a retry of this task must not leave a half-made run behind
            client.delete_run(run_id)
        raise

    t = cfg.tracking
    handle = TrackingHandle(
        uri, str(experiment_id), run_id, run_name, cfg.model.name, cfg.train.steps,
        samples_every=t.samples_every, samples_rows=t.samples_rows, register=t.register_model,
        alias=t.alias, checkpoint_artifacts=t.checkpoint_artifacts, resumed=resumed,
        flow_run_id=tags.get("prefect.flow_run_id"), run_dir=str(Path(run_dir).resolve()),
        flush_timeout_s=t.flush_timeout_s)
    stale = drop_tracker(run_id)  # a run re-opened in the same process gets a fresh tracker
    tracker = tracker_for(handle)
    if stale is not None:  # what it could not send yet goes out with the new one
        tracker.adopt(*stale.detach())
    if t.system_metrics:
        tracker.start_system_metrics(t.system_metrics_interval_s, resumed)
    where = handle.run_url() or f"{redact(uri)} (mlflow ui --backend-store-uri {redact(uri)})"
    _link_artifact(handle, where)
    info(f"tracking: {'re-attached to' if resumed else 'started'} MLflow run {run_id} in "
         f"experiment {exp_name!r}: {where}")
    return handle


@task(name="finish-tracking", timeout_seconds=3600, **TASK_OPTIONS)
def finish_tracking(handle: TrackingHandle | None, *, status: str = "FINISHED",
                    model_dir: str | None = None, eval_result: dict[str, Any] | None = None,
                    model_name: str | None = None) -> dict[str, Any]:
    """Close the run: the reward curve, the registered model (given ``model_dir``; its failures
    raise and mark the run FAILED), the end ``status``. Queued metrics get
    ``tracking.flush_timeout_s``, the rest go to the unsent-metrics file. Returns run id, curve,
    registration and :meth:`Tracker.end`'s report."""
    if handle is None:
        return {}
    from tasks.tracking.registry import register_model

    tracker, out = tracker_for(handle), {"run_id": handle.run_id}
    try:
        tracker.drain()
        try:
            out["curve"] = log_curve(tracker)
        except Exception as exc:
            warn(f"tracking: reward curve not logged ({type(exc).__name__}: {exc})")
        if model_dir and handle.register and status == "FINISHED":
            out.update(register_model(tracker, model_dir, eval_result or {}, model_name))
    except BaseException as exc:
        _end_quietly(handle.run_id, "FAILED")
        if not isinstance(exc, Exception):
            raise
        # ``from None``: MLflow's errors can hold the tracking URI as given (password included)
        raise RuntimeError(f"tracking: registering the model of run {handle.run_id} failed "
                           f"({type(exc).__name__}: {redact(str(exc))[:500]})") from None
    if (unsent_traces := close_traces(handle, timeout=min(handle.flush_timeout_s, 30))):
        out["unsent_traces"] = unsent_traces
    out.update(tracker.end(status))
    drop_tracker(handle.run_id)
    outages = (f" after {out['tracking_outages']} tracking outage(s) of "
               f"{out['tracking_outage_seconds']:.0f}s in all" if out["tracking_outages"] else "")
    unsent = f"; unsent values in {out['unsent_file']}" if "unsent_file" in out else ""
    info(f"tracking: run {handle.run_id} ended {status}{outages}{unsent}")
    return out


def _end_quietly(run_id: str, status: str) -> None:
    try:
        if (tracker := drop_tracker(run_id)) is not None:
            tracker.end(status)
    except Exception as exc:
        warn(f"tracking: could not mark run {run_id} {status}: {exc}")


def tracking_failed(flow: Any, flow_run: Any, state: Any) -> None:
    """A Prefect ``on_failure`` / ``on_crashed`` flow hook: ends this flow run's MLflow runs
    as FAILED (they would otherwise stay RUNNING forever in the UI)."""
    for t in trackers_of_flow_run(str(getattr(flow_run, "id", ""))):
        _end_quietly(t.handle.run_id, "FAILED")
