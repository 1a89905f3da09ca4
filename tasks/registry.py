"""The model registry's ``candidate`` and ``champion``: evaluate, compare, promote.

What the scheduled ``evaluate`` flow (``registry=True``) runs against MLflow's model
registry, for the registered model ``model.name``:

1. resolve the versions behind the aliases ``tracking.alias`` (``candidate``, set on every
   new training result) and ``eval.champion_alias`` (``champion``);
2. evaluate each on the config's held-out set, unless that version already carries an
   evaluation on the same set (same data digest and settings: :func:`evaluation_key`), in
   which case the recorded one is used: running the flow twice evaluates nothing twice;
3. record each new evaluation as a nested MLflow run under the version's training run and as
   ``eval.<key>.<metric>`` tags on the model version;
4. :func:`decide`: the candidate becomes champion when there is none, or when it beats the
   champion on ``eval.promotion_metric`` by more than ``eval.promotion_margin``; a tie within
   the margin keeps the champion; a candidate that is already champion is left alone.

MLflow is imported here and in tasks/tracking.py only; ``rl_core`` never imports it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.tracking import (
    KIND_TAG,
    PARENT_TAG,
    _columns,
    _global_tracking_uri,
    eval_metrics,
    metric_name,
    redact,
)

__all__ = [
    "Decision",
    "RegistryVersion",
    "decide",
    "evaluation_key",
    "fetch_registered_model",
    "promote",
    "record_evaluation",
    "recorded_evaluation",
    "registry_client",
    "resolve_aliases",
]

VERSION_TAG = "grpoflow.model_version"
KEY_TAG = "grpoflow.eval_key"
_TASK: dict[str, Any] = {"cache_policy": NO_CACHE, "retries": 2, "retry_delay_seconds": 5}


@dataclass(frozen=True)
class RegistryVersion:
    """One model version behind an alias."""

    name: str
    version: str
    alias: str
    run_id: str | None
    source: str


@dataclass
class Decision:
    """What the comparison concluded, and why (for the artifact and the version tags)."""

    promote: bool
    reason: str
    metric: str
    candidate: float | None = None
    champion: float | None = None
    margin: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


def registry_client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def evaluation_key(eval_digest: str, settings: Mapping[str, Any]) -> str:
    """A short key for "this held-out set, evaluated this way" (data digest + settings)."""
    blob = json.dumps({"data": eval_digest, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def resolve_aliases(client: Any, name: str, aliases: list[str]) -> dict[str, RegistryVersion]:
    """``alias -> version`` for the aliases that exist on registered model ``name``."""
    out: dict[str, RegistryVersion] = {}
    for alias in aliases:
        try:
            mv = client.get_model_version_by_alias(name, alias)
        except Exception as e:  # no such alias (or model): not an error, just absent
            if "RESOURCE_DOES_NOT_EXIST" in str(e) or "not found" in str(e).lower():
                continue
            raise
        out[alias] = RegistryVersion(name, str(mv.version), alias, mv.run_id, mv.source)
    return out


def recorded_evaluation(client: Any, name: str, version: str, key: str) -> dict[str, float] | None:
    """The metrics recorded on ``name`` v``version`` for evaluation ``key``, if any."""
    tags = client.get_model_version(name, version).tags
    prefix = f"eval.{key}."
    found = {k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}
    if "run_id" not in found:  # written last: without it the record is incomplete
        return None
    return {k: float(v) for k, v in found.items() if k != "run_id"}


@task(name="fetch-registered-model", task_run_name="fetch-{name}-v{version}",
      timeout_seconds=1800, **_TASK)  # fmt: skip
def fetch_registered_model(tracking_uri: str, name: str, version: str, cache_dir: str) -> str:
    """``models:/name/version`` as a local Hugging Face directory (cached per version)."""
    import mlflow

    target = Path(cache_dir) / "registry" / name / f"v{version}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return str(target)
    with _global_tracking_uri(tracking_uri):  # the flavor API knows only the global URI
        parts = mlflow.transformers.load_model(
            f"models:/{name}/{version}", return_type="components"
        )
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    parts["model"].save_pretrained(tmp, safe_serialization=True)
    parts["tokenizer"].save_pretrained(tmp)
    (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return str(target)


@task(name="record-evaluation", task_run_name="record-{v.name}-v{v.version}", **_TASK)
def record_evaluation(
    tracking_uri: str, v: RegistryVersion, key: str, result: Mapping[str, Any]
) -> dict[str, float]:
    """A nested run under the version's training run (or a run of its own) and the
    ``eval.<key>.*`` tags on the version; returns the metrics."""
    from mlflow.entities import Metric, RunStatus, RunTag

    client = registry_client(tracking_uri)
    metrics = {metric_name(k): float(val) for k, val in eval_metrics(result, "").items()}
    if result.get("pass_at_k") is not None:  # also under the name eval.promotion_metric uses
        metrics["pass_at_k"] = float(result["pass_at_k"])
    if v.run_id:
        experiment_id = client.get_run(v.run_id).info.experiment_id
    else:
        exp = client.get_experiment_by_name("grpoflow-registry-evaluations")
        experiment_id = exp.experiment_id if exp else client.create_experiment(
            "grpoflow-registry-evaluations"
        )
    tags = {
        KIND_TAG: "registry-evaluation",
        VERSION_TAG: f"{v.name}/{v.version}",
        KEY_TAG: key,
        "grpoflow.alias": v.alias,
    }
    if v.run_id:
        tags[PARENT_TAG] = v.run_id
    run_id = client.create_run(
        experiment_id, run_name=f"registry-eval-{v.name}-v{v.version}-{key}", tags=tags
    ).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, val, now, 0) for k, val in metrics.items()],
        tags=[RunTag("num_examples", str(result.get("num_examples")))],
    )
    if result.get("samples"):
        client.log_table(run_id, _columns(result["samples"]), "samples.json")
    client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FINISHED))
    for k, val in metrics.items():
        client.set_model_version_tag(v.name, v.version, f"eval.{key}.{k}", f"{val:.6g}")
    client.set_model_version_tag(v.name, v.version, f"eval.{key}.run_id", run_id)  # last
    return metrics


def decide(
    candidate: RegistryVersion | None,
    champion: RegistryVersion | None,
    scores: Mapping[str, Mapping[str, float]],
    *,
    metric: str,
    margin: float,
) -> Decision:
    """Promote the candidate? ``scores`` maps a version number to its metrics."""
    if candidate is None:
        return Decision(False, "no candidate version", metric, margin=margin)
    cand = scores[candidate.version].get(metric)
    if cand is None:
        have = sorted(scores[candidate.version])
        raise KeyError(f"eval.promotion_metric={metric!r} is not among the metrics {have}")
    if champion is None:
        return Decision(True, "no champion yet: the first candidate becomes champion", metric,
                        cand, None, margin)  # fmt: skip
    if champion.version == candidate.version:
        return Decision(False, f"v{candidate.version} is already champion", metric, cand, cand,
                        margin)  # fmt: skip
    champ = scores[champion.version][metric]
    if cand > champ + margin:
        return Decision(True, f"candidate {metric} {cand:.4f} beats champion {champ:.4f} by "
                        f"{cand - champ:.4f} > margin {margin}", metric, cand, champ, margin)  # fmt: skip
    return Decision(False, f"candidate {metric} {cand:.4f} does not beat champion {champ:.4f} "
                    f"by more than margin {margin}", metric, cand, champ, margin)  # fmt: skip


@task(name="promote", task_run_name="promote-{v.name}-v{v.version}", **_TASK)
def promote(tracking_uri: str, v: RegistryVersion, champion_alias: str, decision: Decision) -> None:
    """Point ``champion_alias`` at ``v``; the version records when and over whom."""
    client = registry_client(tracking_uri)
    client.set_registered_model_alias(v.name, champion_alias, v.version)
    client.set_model_version_tag(v.name, v.version, "grpoflow.promoted_at",
                                 time.strftime("%Y-%m-%dT%H:%M:%S%z"))  # fmt: skip
    client.set_model_version_tag(v.name, v.version, "grpoflow.promotion", decision.reason)
    get_run_logger().info("registry: %s v%s is now %s (%s)", v.name, v.version,
                          champion_alias, redact(decision.reason))  # fmt: skip


def comparison_markdown(
    name: str,
    versions: Mapping[str, RegistryVersion],
    scores: Mapping[str, Mapping[str, float]],
    cached: Mapping[str, bool],
    decision: Decision,
    key: str,
) -> str:
    """The Prefect artifact: both versions side by side and the decision."""
    metrics = sorted({m for s in scores.values() for m in s})
    head = "| alias | version | " + " | ".join(metrics) + " | evaluated |"
    lines = [f"## {name}: candidate vs champion (eval set {key})", "", head,
             "|" + "---|" * (len(metrics) + 3)]  # fmt: skip
    for alias, v in versions.items():
        vals = " | ".join(f"{scores[v.version].get(m, float('nan')):.4f}" for m in metrics)
        when = "recorded earlier" if cached[v.version] else "now"
        lines.append(f"| {alias} | v{v.version} | {vals} | {when} |")
    verdict = "**promoted**" if decision.promote else "**not promoted**"
    lines += ["", f"Decision on `{decision.metric}` (margin {decision.margin}): {verdict}: "
              f"{decision.reason}."]  # fmt: skip
    return "\n".join(lines) + "\n"
