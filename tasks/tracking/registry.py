"""The model registry: registering a run's final model (:func:`register_model`, as
``model.name`` with the alias ``tracking.alias``) and the steps of the scheduled candidate /
champion evaluation (docs/deployments.md): resolve the aliases, evaluate each version not yet
evaluated on the same set (:func:`evaluation_key`), record it, :func:`decide`, :func:`promote`.
MLflow is imported here and in :mod:`tasks.tracking` only. Registering fails loudly (a run
whose model did not reach the registry is not done).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.models.vlm import is_vision_checkpoint
from tasks.tracking.artifacts import columns
from tasks.tracking.handle import KIND_TAG, PARENT_TAG, eval_metrics, info, metric_name, retrying
from tasks.tracking.images import send_table, with_images
from tasks.tracking.sender import Tracker

__all__ = ["Decision", "RegistryVersion", "comparison_markdown", "decide", "evaluation_key",
           "fetch_registered_model", "promote", "record_evaluation", "recorded_evaluation",
           "register_model", "registry_client", "resolve_aliases", "trained_by"]

VERSION_TAG, KEY_TAG = "grpoflow.model_version", "grpoflow.eval_key"
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
    prefix, tags = f"eval.{key}.", client.get_model_version(name, version).tags
    found = {k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}
    # run_id is written last: without it the record is incomplete
    return {k: float(v) for k, v in found.items() if k != "run_id"} if "run_id" in found else None


@task(name="fetch-registered-model", task_run_name="fetch-{name}-v{version}",
      timeout_seconds=1800, **_TASK)
def fetch_registered_model(tracking_uri: str, name: str, version: str, cache_dir: str) -> str:
    """``models:/name/version`` as a local Hugging Face directory (cached per version)."""
    import mlflow

    target = Path(cache_dir) / "registry" / name / f"v{version}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return str(target)
    with global_tracking_uri(tracking_uri):  # the flavor API knows only the global URI
        parts = mlflow.transformers.load_model(f"models:/{name}/{version}",
                                               return_type="components")
    (tmp := target.with_name(target.name + ".tmp")).mkdir(parents=True, exist_ok=True)
    parts["model"].save_pretrained(tmp, safe_serialization=True)
    parts["tokenizer"].save_pretrained(tmp)
    (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
    shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier fetch
    tmp.rename(target)
    return str(target)


@task(name="record-evaluation", task_run_name="record-{v.name}-v{v.version}", **_TASK)
def record_evaluation(tracking_uri: str, v: RegistryVersion, key: str,
                      result: Mapping[str, Any]) -> dict[str, float]:
    """A nested run under the version's training run (or a run of its own) and the
    ``eval.<key>.*`` tags on the version; returns the metrics."""
    from mlflow.entities import Metric, RunStatus, RunTag

    client = registry_client(tracking_uri)
    metrics = {metric_name(k): float(val) for k, val in eval_metrics(result, "").items()}
    if result.get("pass_at_k") is not None:  # also under the name eval.promotion_metric uses
        metrics["pass_at_k"] = float(result["pass_at_k"])
    tags = {KIND_TAG: "registry-evaluation", VERSION_TAG: f"{v.name}/{v.version}", KEY_TAG: key,
            "grpoflow.alias": v.alias}
    if v.run_id:
        tags[PARENT_TAG] = v.run_id
        experiment_id = client.get_run(v.run_id).info.experiment_id
    else:
        exp = client.get_experiment_by_name(name := "grpoflow-registry-evaluations")
        experiment_id = exp.experiment_id if exp else client.create_experiment(name)
    run_id = client.create_run(experiment_id, tags=tags,
                               run_name=f"registry-eval-{v.name}-v{v.version}-{key}").info.run_id
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, val, now, 0) for k, val in metrics.items()],
                     tags=[RunTag("num_examples", str(result.get("num_examples")))])
    if result.get("samples"):
        send_table(client, run_id, "samples.json",
                   columns(with_images(result["samples"], "samples")))
    client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FINISHED))
    for k, val in metrics.items():
        client.set_model_version_tag(v.name, v.version, f"eval.{key}.{k}", f"{val:.6g}")
    client.set_model_version_tag(v.name, v.version, f"eval.{key}.run_id", run_id)  # last
    return metrics


def decide(candidate: RegistryVersion | None, champion: RegistryVersion | None,
           scores: Mapping[str, Mapping[str, float]], *, metric: str, margin: float) -> Decision:
    """Promote the candidate? ``scores`` maps a version number to its metrics."""
    if candidate is None:
        return Decision(False, "no candidate version", metric, margin=margin)
    if (cand := scores[candidate.version].get(metric)) is None:
        have = sorted(scores[candidate.version])
        raise KeyError(f"eval.promotion_metric={metric!r} is not among the metrics {have}")
    if champion is None:
        why = "no champion yet: the first candidate becomes champion"
        return Decision(True, why, metric, cand, None, margin)
    if champion.version == candidate.version:
        return Decision(False, f"v{candidate.version} is already champion", metric, cand, cand,
                        margin)
    champ = scores[champion.version][metric]
    if promote := cand > champ + margin:
        why = f"beats champion {champ:.4f} by {cand - champ:.4f} > margin {margin}"
    else:
        why = f"does not beat champion {champ:.4f} by more than margin {margin}"
    return Decision(promote, f"candidate {metric} {cand:.4f} {why}", metric, cand, champ, margin)


@task(name="promote", task_run_name="promote-{v.name}-v{v.version}", **_TASK)
def promote(tracking_uri: str, v: RegistryVersion, champion_alias: str, decision: Decision) -> None:
    """Point ``champion_alias`` at ``v``; the version records when and over whom."""
    client = registry_client(tracking_uri)
    client.set_registered_model_alias(v.name, champion_alias, v.version)
    client.set_model_version_tag(v.name, v.version, "grpoflow.promoted_at",
                                 time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    client.set_model_version_tag(v.name, v.version, "grpoflow.promotion", decision.reason)
    info(f"registry: {v.name} v{v.version} is now {champion_alias} ({decision.reason})")


def comparison_markdown(name: str, versions: Mapping[str, RegistryVersion],
                        scores: Mapping[str, Mapping[str, float]], cached: Mapping[str, bool],
                        decision: Decision, key: str) -> str:
    """The Prefect artifact: both versions side by side and the decision."""
    metrics = sorted({m for s in scores.values() for m in s})
    lines = [f"## {name}: candidate vs champion (eval set {key})", "",
             "| alias | version | " + " | ".join(metrics) + " | evaluated |",
             "|" + "---|" * (len(metrics) + 3)]
    for alias, v in versions.items():
        vals = " | ".join(f"{scores[v.version].get(m, float('nan')):.4f}" for m in metrics)
        when = "recorded earlier" if cached[v.version] else "now"
        lines.append(f"| {alias} | v{v.version} | {vals} | {when} |")
    lines += ["", f"Decision on `{decision.metric}` (margin {decision.margin}): **"
              f"{'promoted' if decision.promote else 'not promoted'}**: {decision.reason}."]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def global_tracking_uri(uri: str) -> Iterator[None]:
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


def pip_requirements() -> list[str]:
    """What loading the logged model needs, pinned to what is installed (MLflow's inference
    costs ~13 s and adds torchvision, which breaks logging where it is not installed)."""
    out = []
    for dist in ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "accelerate"):
        with contextlib.suppress(metadata.PackageNotFoundError):  # 2.13.0+cpu -> 2.13.0: a
            out.append(f"{dist}=={metadata.version(dist).split('+')[0]}")  # label names an index
    return out


def trained_by(params: Mapping[str, str]) -> str:
    """What trained a run, read from its MLflow params: ``SFT`` (an SFT config has no
    ``algorithm`` section), ``on-policy distillation`` (GRPO with a ``teacher.path``) or
    ``GRPO``."""
    if "algorithm.advantage" not in params:
        return "SFT"
    if params.get("teacher.path") not in (None, "", "null", "None"):
        return "on-policy distillation"
    return "GRPO"


def _new_version(tracker: Tracker, name: str, logged: Any, step: int,
                 metrics: dict[str, float], extra_tags: Mapping[str, str], kind: str) -> Any:
    """A new version of registered model ``name`` (created if needed) from the logged model;
    ``kind`` (:func:`trained_by`) heads its description."""
    h, client = tracker.handle, tracker.client
    try:
        client.create_registered_model(
            name, description="Policies trained by grpoflow (Hugging Face format); each "
                              "version's description says how.")
    except Exception as exc:
        if "ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
            raise
    summary = ", ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in metrics.items()
                        if "pass_at" in k)
    return client.create_model_version(
        name, source=logged.model_uri, run_id=h.run_id, run_link=h.run_url(),
        model_id=logged.model_id,
        description=f"{kind} run {h.run_name}, step {step}. Final evaluation: {summary}",
        tags={**{metric_name(k): f"{v:.6g}" for k, v in metrics.items()},
              "grpoflow.run_id": h.run_id, "grpoflow.run_name": h.run_name,
              "grpoflow.step": str(step), **extra_tags})


def register_model(tracker: Tracker, model_dir: str, eval_result: Mapping[str, Any],
                   model_name: str | None) -> dict[str, Any]:
    """Log the HF model in ``model_dir`` on the run (transformers flavor) and register it as
    ``model_name`` (default ``model.name``) with the handle's alias; raises when either fails. The
    version records ``grpoflow.base_model``; a LoRA run's is the merged model, adapter tags and
    ``adapter/`` beside it (docs/lora.md)."""
    import mlflow
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
    from transformers import AutoModelForCausalLM, AutoTokenizer

    h, client = tracker.handle, tracker.client
    name, step = model_name or h.model_name, int(eval_result.get("step", h.total_steps))
    metrics = eval_metrics(eval_result)
    # A vision-language model: MLflow's transformers flavor builds an image-text pipeline
    # through a processor that needs torchvision; its Hugging Face directory is logged as is.
    vision = is_vision_checkpoint(model_dir)
    components = {} if vision else {
        "model": AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto"),
        "tokenizer": AutoTokenizer.from_pretrained(model_dir)}
    text = Schema([ColSpec("string")])
    signature = ModelSignature(inputs=text, outputs=text, params=ParamSchema([
        ParamSpec("max_new_tokens", "long", 64), ParamSpec("do_sample", "boolean", False),
        ParamSpec("temperature", "double", 1.0)]))
    params = client.get_run(h.run_id).data.params
    extra = {"grpoflow.base_model": params.get("model.path", "")}
    adapter = Path(model_dir) / "adapter"
    if (adapter / "adapter_config.json").is_file():
        a = json.loads((adapter / "adapter_config.json").read_text())
        extra.update({"grpoflow.lora.rank": str(a.get("r")),
                      "grpoflow.lora.alpha": str(a.get("lora_alpha")),
                      "grpoflow.lora.target_modules": ",".join(sorted(a.get("target_modules")
                                                                      or []))})
    started = time.perf_counter()
    # The flavor API knows only the global URI and the active run (whose experiment the
    # logged model joins); the registry resolves models:/ URIs through the global URI too.
    with global_tracking_uri(h.tracking_uri), mlflow.start_run(run_id=h.run_id):
        if vision:
            mlflow.log_artifacts(model_dir, artifact_path="model")
            extra["grpoflow.format"] = "huggingface-directory"
            logged = SimpleNamespace(model_uri=f"runs:/{h.run_id}/model", model_id=None)
        else:
            logged = mlflow.transformers.log_model(
                components, name="model", task="text-generation", signature=signature,
                pip_requirements=pip_requirements(), run_id=h.run_id,
                step=step,  # links the run's metrics at this step (the final evaluation) to the model
                metadata={"grpoflow.run_name": h.run_name, "grpoflow.step": step})
        if "grpoflow.lora.rank" in extra:
            mlflow.log_artifacts(str(adapter), artifact_path="adapter")
        seconds = time.perf_counter() - started
        version = retrying(f"registering {name}",
                           lambda: _new_version(tracker, name, logged, step, metrics, extra,
                                                trained_by(params)))
        retrying(f"setting alias {h.alias} on {name} v{version.version}",
                 lambda: client.set_registered_model_alias(name, h.alias, version.version))
    info(f"tracking: model logged in {seconds:.1f}s and registered as {name} v{version.version}"
         f" (models:/{name}@{h.alias})")
    return {"model_uri": logged.model_uri, "registered_model": name,
            "version": str(version.version), "alias_uri": f"models:/{name}@{h.alias}"}
