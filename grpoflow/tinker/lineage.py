"""MLflow lineage of the Tinker-compatible service: :class:`MlflowLineage`, the service's
tracker (:class:`grpoflow.tinker.backend.LineageTracker`).

Each training client (model id = training run id) is one MLflow run in ``experiment``: params
(base model, LoRA rank, seed, train flags, the tenant's name; ``resumed_from`` for a client
created from a checkpoint), tags linking it to the service (``tinker.training_run_id``,
``tinker.session_id``, ``tinker.tenant``, ``tinker.checkpoints``, session tags and user
metadata, redacted), the metrics of every call (the backend's ``loss:sum``, ``tokens:sum``,
``grad_norm:mean``, ``learning_rate:mean`` as ``loss_sum`` ...; the service's timings as
``forward_backward/seconds``, ``optim_step/queue_seconds`` ...). Every named checkpoint is
logged as artifacts ``checkpoints/<weights|sampler_weights>/<name>/`` with its ``tinker://``
path as the tag ``checkpoint/<kind>/<name>``; every named sampler-weights save also becomes a
version of the registered model ``tinker-<tenant>-<run>`` (its ``tinker.path`` tag says which).
The run ends FINISHED with its session, KILLED when the service stops; runs a killed service
left RUNNING (same ``root``) are marked KILLED by the next one.

Nothing here waits for MLflow: calls only queue records, which one thread sends through the
project's outbox (:class:`tasks.tracking.outbox.Outbox`: kept through outages, 1-30 s backoff,
one warning per outage, never logging unredacted). A request never fails for tracking.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.secrets import MASK, is_secret_name, redact
from tasks.tracking.handle import KIND_TAG, metric_name
from tasks.tracking.outbox import Outbox, bound_mlflow_http

__all__ = ["MlflowLineage", "registered_name", "resolve_store"]

log = logging.getLogger(__name__)

BATCH = 1000  # MLflow's limit of metrics per log_batch
RUN_TAG, INSTANCE_TAG, ROOT_TAG = ("tinker.training_run_id", "grpoflow.tinker.instance",
                                   "grpoflow.tinker.root")
OP_TAG = "grpoflow.tinker.op"  # on a model version: the record it came from (no duplicates)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def registered_name(tenant: str, run: str) -> str:
    """The registered model of ``run``'s sampler weights: ``tinker-<tenant>-<run>``, with
    what MLflow refuses in a name (``/``, ``:``, ...) as ``-``."""
    return _UNSAFE.sub("-", f"tinker-{tenant}-{run}")[:250]


def resolve_store(uri: str | None, storage_root: str) -> tuple[str, str | None]:
    """``(tracking_uri, artifact_location)`` as every grpoflow command resolves them
    (:func:`tasks.tracking.resolve_tracking_uri`): ``uri``, else ``MLFLOW_TRACKING_URI``, else
    the project store ``<storage_root>/mlflow.db`` with ``mlartifacts/`` beside it."""
    from rl_core.config import ExperimentConfig
    from tasks.tracking.run import resolve_tracking_uri

    cfg = ExperimentConfig.model_validate({"tracking": {"uri": uri},
                                           "storage": {"root": storage_root}})
    return resolve_tracking_uri(cfg, storage_root)


@dataclass
class Op:
    """One queued record: ``kind`` start, metrics, checkpoint or end, of training run ``run``
    (or ``open``: find the experiment, end an earlier service's runs)."""

    kind: str
    run: str
    data: dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class MlflowLineage(Outbox[list[Op]]):
    """The service's tracker (see the module docstring). ``uri`` None: resolved on first use
    (:func:`resolve_store` with ``storage_root``); ``root``: the service's checkpoint root (runs
    of an earlier, killed service on the same root are ended); ``checkpoint_artifacts``: upload
    checkpoints; ``register_sampler_weights``: a model version per named sampler save (needs
    the upload); ``flush_timeout_s``: how long :meth:`close` waits for the queue;
    ``max_records``: queued records kept while MLflow is away (the oldest metrics go first)."""

    thread_name = "grpoflow-tinker-lineage"

    def __init__(self, uri: str | None = None, experiment: str = "grpoflow-tinker", *,
                 storage_root: str = "runs", root: str | Path | None = None,
                 checkpoint_artifacts: bool = True, register_sampler_weights: bool = True,
                 flush_timeout_s: float = 10.0, max_records: int = 100_000) -> None:
        super().__init__(uri or "")
        bound_mlflow_http()
        self.experiment, self.storage_root = experiment, storage_root
        self.root = None if root is None else str(Path(root).expanduser().resolve())
        self.checkpoint_artifacts = checkpoint_artifacts
        self.register_sampler_weights = register_sampler_weights and checkpoint_artifacts
        self.flush_timeout_s, self.max_records = flush_timeout_s, max_records
        self.instance = uuid.uuid4().hex[:16]  # this process's runs (a retried start finds its run)
        self._ops: deque[Op] = deque()
        self._dropped = 0  # records dropped for the bound, not yet reported
        self._closing = False
        self._client: Any = None
        self._artifact_location: str | None = None
        self._experiment_id: str | None = None
        self.runs: dict[str, str] = {}  # training run id -> MLflow run id (sender thread)
        self._about: dict[str, dict[str, str]] = {}  # training run id -> tenant, base model

    # ------------------------------------------------------------------ the tracker interface
    def open(self) -> None:
        """Queue a first contact (the experiment, and the end of the runs an earlier, killed
        service on the same root left RUNNING), instead of waiting for a training client."""
        self._put(Op("open", "", {}))

    def start_run(self, run_id: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        self._put(Op("start", run_id, {"params": dict(params), "tags": dict(tags)}))

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(run_id, step, {metric_name(k): v for k, v in metrics.items()})

    def log_call(self, run_id: str, op: str, step: int, info: Mapping[str, float]) -> None:
        self._metrics(run_id, step, {metric_name(f"{op}/{k}"): v for k, v in info.items()})

    def log_checkpoint(self, run_id: str, kind: str, name: str, path: Path,
                       tinker_path: str) -> None:
        self._put(Op("checkpoint", run_id, {"kind": kind, "name": name,
                                            "path": str(path), "tinker_path": tinker_path}))

    def end_run(self, run_id: str, status: str) -> None:
        self._put(Op("end", run_id, {"status": status}))

    def close(self) -> None:
        """Send what is queued (at most ``flush_timeout_s``), then stop; what is left is
        dropped, and said so. Later calls are ignored."""
        if self._closing:
            return
        self._closing = True
        with self._changed:
            busy = bool(self._ops) or self.inflight is not None
        if busy and not self.flush(self.flush_timeout_s):
            with self._changed:
                left = len(self._ops)
            self.say(f"lineage: {left} records did not reach MLflow at {self.uri} within "
                     f"{self.flush_timeout_s:g}s (flush_timeout_s); dropped")
        self.stop()

    def _metrics(self, run_id: str, step: int, values: Mapping[str, Any]) -> None:
        clean = {k: float(v) for k, v in values.items()
                 if isinstance(v, int | float) and v == v and abs(v) != float("inf")}
        if clean:
            self._put(Op("metrics", run_id, {"step": int(step), "values": clean,
                                             "ms": int(time.time() * 1000)}))

    def _put(self, op: Op) -> None:
        if self._closing:
            return
        with self._changed:
            self._ops.append(op)
            while len(self._ops) > self.max_records:  # drop the oldest metrics, else the oldest
                victim = next((o for o in self._ops if o.kind == "metrics"), self._ops[0])
                self._ops.remove(victim)
                self._dropped += 1
            self._changed.notify_all()
        self.ensure_thread()

    # ------------------------------------------------------------------ the outbox's hooks
    def _queued_locked(self) -> int:
        return len(self._ops)

    def _take_locked(self) -> list[Op]:
        unit = [self._ops.popleft()]
        if unit[0].kind == "metrics":  # consecutive metrics of one run: one log_batch
            n = len(unit[0].data["values"])
            while (self._ops and self._ops[0].kind == "metrics" and self._ops[0].run == unit[0].run
                   and n + len(self._ops[0].data["values"]) <= BATCH):
                n += len(self._ops[0].data["values"])
                unit.append(self._ops.popleft())
        return unit

    def _put_back_locked(self, item: list[Op]) -> None:
        self._ops.extendleft(reversed(item))

    def _send(self, item: list[Op]) -> None:
        op = item[0]
        if op.kind == "open":
            self._experiment_id_()
            return
        if op.kind == "start":
            self._send_start(op)
            return
        run_id = self.runs.get(op.run)
        if run_id is None:  # its start was refused, or it ended: nothing to attach it to
            log.debug("lineage: no MLflow run for %s; %s dropped", op.run, op.kind)
            return
        client = self._mlflow()
        if op.kind == "metrics":
            from mlflow.entities import Metric

            client.log_batch(run_id, synchronous=True, metrics=[
                Metric(k, v, o.data["ms"], o.data["step"])
                for o in item for k, v in o.data["values"].items()])
        elif op.kind == "checkpoint":
            self._send_checkpoint(run_id, op)
        elif op.kind == "end":
            client.set_terminated(run_id, status=op.data["status"])
            self.runs.pop(op.run, None)

    def _after_failure(self) -> None:
        with self._changed:
            n, self._dropped = self._dropped, 0
        if n:
            self.say(f"lineage: dropped the {n} oldest unsent records (max_records)")

    def _on_refused(self, item: list[Op], what: str) -> None:
        self.say(f"lineage: MLflow at {self.uri} refused the {item[0].kind} record of "
                 f"{item[0].run} ({what}); dropped")

    def _on_outage(self, what: str, queued: int) -> None:
        self.say(f"lineage: MLflow at {self.uri} is unreachable ({what}); requests go on, "
                 f"{queued} records are kept and sent when it answers again")

    def _on_back(self, seconds: float, queued: int) -> None:
        self.say(f"lineage: MLflow at {self.uri} answers again after {seconds:.0f}s; sending "
                 f"{queued} records kept meanwhile", logging.INFO)

    def say(self, msg: str, level: int = logging.WARNING) -> None:
        log.log(level, redact(msg))

    # ------------------------------------------------------------------ sending
    def _mlflow(self) -> Any:  # noqa: ANN401 - an MlflowClient, made on the sender thread
        if self._client is None:
            from mlflow import MlflowClient

            self.uri, self._artifact_location = resolve_store(self.uri or None,
                                                              self.storage_root)
            self._client = MlflowClient(self.uri, registry_uri=self.uri)
        return self._client

    def _experiment_id_(self) -> str:
        if self._experiment_id is not None:
            return self._experiment_id
        client = self._mlflow()
        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            experiment_id = exp.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(
                    self.experiment, artifact_location=self._artifact_location)
            except Exception:  # another process made it meanwhile
                if (exp := client.get_experiment_by_name(self.experiment)) is None:
                    raise
                experiment_id = exp.experiment_id
        self._experiment_id = str(experiment_id)
        self._end_stale_runs()
        return self._experiment_id

    def _end_stale_runs(self) -> None:
        """The runs an earlier service on the same root left RUNNING (it was killed) end
        KILLED: their training clients are gone."""
        if self.root is None:
            return
        try:
            stale = self._client.search_runs(
                [self._experiment_id], max_results=1000,
                filter_string=f"attributes.status = 'RUNNING' and tags.`{ROOT_TAG}` = "
                              f"'{self.root}' and tags.`{INSTANCE_TAG}` != '{self.instance}'")
            for run in stale:
                self._client.set_tag(run.info.run_id, "grpoflow.tinker.ended",
                                     "the service stopped without ending it")
                self._client.set_terminated(run.info.run_id, status="KILLED")
        except Exception as exc:  # the root holds a quote, or a server without search
            self.say(f"lineage: runs of an earlier service not ended ({type(exc).__name__}: "
                     f"{str(exc)[:200]})")

    def _find_run(self, experiment_id: str, run: str, instance: str | None) -> str | None:
        """The MLflow run of training run ``run`` (made by ``instance``, or by any)."""
        where = f"tags.`{RUN_TAG}` = '{run}'"
        if instance is not None:
            where += f" and tags.`{INSTANCE_TAG}` = '{instance}'"
        found = self._client.search_runs([experiment_id], filter_string=where, max_results=1,
                                         order_by=["attributes.start_time DESC"])
        return found[0].info.run_id if found else None

    def _send_start(self, op: Op) -> None:
        from mlflow.entities import Param, RunTag

        experiment_id, client = self._experiment_id_(), self._mlflow()
        params = op.data["params"]
        tags = {str(k): MASK if is_secret_name(str(k).rsplit(".", 1)[-1]) else redact(v)
                for k, v in op.data["tags"].items()}  # metadata named like a secret: masked
        tags |= {RUN_TAG: op.run, INSTANCE_TAG: self.instance, KIND_TAG: "tinker-training"}
        if self.root is not None:
            tags[ROOT_TAG] = self.root
        parent = str(params.get("resumed_from") or "").split("/")[2:3]  # tinker://<run>/...
        if parent and (previous := self._find_run(experiment_id, parent[0], None)):
            tags["grpoflow.tinker.resumed_from_mlflow_run"] = previous
        # a retried start whose first attempt reached the server finds that run again
        run_id = self._find_run(experiment_id, op.run, self.instance)
        if run_id is None:
            run_id = client.create_run(experiment_id, run_name=op.run,
                                       tags={RUN_TAG: op.run, INSTANCE_TAG: self.instance}
                                       ).info.run_id
        client.log_batch(run_id, params=[Param(metric_name(k), redact(v)[:6000])
                                         for k, v in params.items()],
                         tags=[RunTag(metric_name(k), v[:8000]) for k, v in tags.items()])
        self.runs[op.run] = run_id
        self._about[op.run] = {"tenant": str(params.get("tenant", "")),
                               "base_model": str(params.get("base_model", ""))}

    def _send_checkpoint(self, run_id: str, op: Op) -> None:
        from mlflow.entities import RunTag

        client, d = self._mlflow(), op.data
        kind, name, tinker_path, path = d["kind"], d["name"], d["tinker_path"], Path(d["path"])
        where = f"checkpoints/{kind}/{name}"
        uploaded = False
        value = tinker_path
        if not path.is_dir():  # deleted (or expired) before it could be sent
            value += " (deleted before it was logged)"
        elif self.checkpoint_artifacts:
            client.log_artifacts(run_id, str(path), where)
            uploaded = True
        client.log_batch(run_id, tags=[RunTag(metric_name(f"checkpoint/{kind}/{name}"), value),
                                       RunTag(f"checkpoint/latest_{kind}", value)])
        if uploaded and kind == "sampler_weights" and self.register_sampler_weights:
            self._register(run_id, op, where)

    def _register(self, run_id: str, op: Op, where: str) -> None:
        client, about = self._mlflow(), self._about.get(op.run, {})
        name = registered_name(about.get("tenant", "unknown"), op.run)
        try:
            client.create_registered_model(
                name, description=f"Sampler weights (LoRA adapters) of Tinker training run "
                                  f"{op.run}, saved through grpoflow serve-tinker.")
        except Exception as exc:
            if "ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
                raise
        if any(v.tags.get(OP_TAG) == op.id for v in client.search_model_versions(
                f"name = '{name}'")):
            return  # a retry whose first attempt registered it
        client.create_model_version(
            name, source=f"runs:/{run_id}/{where}", run_id=run_id,
            description=f"{op.data['tinker_path']}: a PEFT LoRA adapter of "
                        f"{about.get('base_model', '?')}",
            tags={"tinker.path": op.data["tinker_path"], RUN_TAG: op.run,
                  "tinker.tenant": about.get("tenant", ""),
                  "tinker.base_model": about.get("base_model", ""), OP_TAG: op.id})
