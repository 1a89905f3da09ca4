"""The evaluation flow: greedy pass@1 and sampled pass@k of a model on a held-out set.

    prepare data -> fetch model -> bring up a rollout engine -> evaluate

``registry=True`` (the scheduled evaluation, docs/deployments.md): resolve candidate and
champion -> evaluate each not yet evaluated on this set -> record -> decide -> promote.
``model`` may also be a registry URI, ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows._redacted import redacted_flow
from rl_core.config import ExperimentConfig, load_config
from rl_core.planes import tear_down
from rl_core.preflight import preflight
from rl_core.report import format_eval
from rl_core.rewards import answer_kind
from tasks.evaluate import artifact_key, evaluate_policy
from tasks.setup import bring_up, fetch_model, prepare_data

__all__ = ["evaluate", "registry_evaluation_key"]


@redacted_flow(name="evaluate")
def evaluate(config: str | None = None, overrides: list[str] | None = None,
             model: str | None = None, work_dir: str | None = None, registry: bool = False,
             step: int = 0) -> dict[str, Any]:
    """Evaluate ``model`` (default: ``model.path``) on the config's eval set; ``work_dir`` holds
    the engines' logs. ``registry=True``: evaluate ``model.name``'s candidate and champion and
    promote the candidate when better (docs/deployments.md). ``step``: the model's training step."""
    if registry:
        return _evaluate_registry(config, overrides or [], work_dir)
    if model and model.startswith("models:/"):
        model = _registered_model_dir(load_config(config, overrides or []), model)
    extra = [f"model.path={model}"] if model else []
    cfg = load_config(config, [*(overrides or []), *extra])
    preflight(cfg, model=False)
    data = prepare_data(cfg.data, cfg.storage.cache_dir, answer_kind(cfg.reward))
    model_path = fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir)
    preflight(cfg, model_path=model_path, data=False)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work_dir = work_dir or str(Path(cfg.storage.root) / "evaluations" / f"{cfg.name}-{stamp}")
    planes = bring_up(cfg, model_path, data, work_dir, with_trainer=False)
    try:
        result = evaluate_policy(planes, step)
    finally:
        tear_down(planes)
    result.update(model=model_path, weight_version=step)
    get_run_logger().info(format_eval(result))
    return result


def registry_evaluation_key(cfg: ExperimentConfig, eval_digest: str) -> str:
    """The key a version's evaluation on this held-out set is recorded under: the same set,
    sampled and rewarded the same way, is never evaluated twice."""
    from tasks.tracking.registry import evaluation_key

    e, r = cfg.eval, cfg.reward
    return evaluation_key(eval_digest, {
        "num_examples": e.num_examples, "pass_k": e.pass_k, "pass_k_examples": e.pass_k_examples,
        "temperature": e.temperature, "max_new_tokens": e.max_new_tokens, "seed": cfg.seed,
        "reward": r.fn, "pass_threshold": r.pass_threshold,
    })


def _tracking_uri(cfg: ExperimentConfig) -> str:
    """The store the training runs register into: ``tracking.uri``, ``MLFLOW_TRACKING_URI``,
    else the project's (``tracking.store=project``: ``<storage.root>/mlflow.db``)."""
    from tasks.tracking import project_store

    uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    project = project_store(cfg)
    if not uri and project is not None and project.is_file():
        return f"sqlite:///{project}"
    if not uri:
        raise ValueError(
            "evaluating registered models needs the tracking store the training runs register "
            f"into: {f'no run has tracked into the project store {project} yet' if project else 'tracking.store=run names no single store'}; or set "
            "tracking.uri (e.g. tracking.uri=http://127.0.0.1:5000 or "
            "sqlite:///runs/<run>/mlflow.db for tracking.store=run) or MLFLOW_TRACKING_URI"
        )
    return uri


def _registered_model_dir(cfg: ExperimentConfig, uri: str) -> str:
    """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` as a local Hugging Face directory."""
    from tasks.tracking.registry import fetch_registered_model, registry_client, resolve_aliases

    tracking_uri = _tracking_uri(cfg)
    ref = uri.removeprefix("models:/")
    if "@" in ref:
        name, alias = ref.split("@", 1)
        found = resolve_aliases(registry_client(tracking_uri), name, [alias])
        if alias not in found:
            raise ValueError(f"model={uri}: registered model {name!r} has no alias {alias!r}")
        version = found[alias].version
    else:
        name, _, version = ref.partition("/")
    return fetch_registered_model(tracking_uri, name, version, cfg.storage.cache_dir)


def _evaluate_registry(
    config: str | None, overrides: list[str], work_dir: str | None
) -> dict[str, Any]:
    from tasks.tracking.registry import (
        comparison_markdown,
        decide,
        fetch_registered_model,
        promote,
        record_evaluation,
        recorded_evaluation,
        registry_client,
        resolve_aliases,
    )

    log = get_run_logger()
    cfg = load_config(config, overrides)
    uri = _tracking_uri(cfg)
    client = registry_client(uri)
    name, cand_alias, champ_alias = cfg.model.name, cfg.tracking.alias, cfg.eval.champion_alias
    versions = resolve_aliases(client, name, [cand_alias, champ_alias])
    summary: dict[str, Any] = {"registered_model": name, "versions": {}, "promoted": False}
    if not versions:
        log.info("registry: %s has neither %r nor %r: nothing to evaluate", name, cand_alias,
                 champ_alias)
        summary["reason"] = "nothing registered"
        return summary
    data = prepare_data(cfg.data, cfg.storage.cache_dir, answer_kind(cfg.reward))
    e = cfg.eval
    key = registry_evaluation_key(cfg, data.eval_digest)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(work_dir or Path(cfg.storage.root) / "evaluations" / f"registry-{stamp}")
    scores: dict[str, dict[str, float]] = {}
    cached: dict[str, bool] = {}
    for v in {v.version: v for v in versions.values()}.values():
        recorded = recorded_evaluation(client, name, v.version, key)
        cached[v.version] = recorded is not None
        if recorded is None:
            path = fetch_registered_model(uri, name, v.version, cfg.storage.cache_dir)
            result = evaluate(config=config, overrides=overrides, model=path,
                              work_dir=str(base / f"v{v.version}"))
            recorded = record_evaluation(uri, v, key, result)
        scores[v.version] = recorded
        log.info("registry: %s v%s (%s): %s", name, v.version, v.alias,
                 "recorded earlier" if cached[v.version] else "evaluated now")
    decision = decide(versions.get(cand_alias), versions.get(champ_alias), scores,
                      metric=e.promotion_metric, margin=e.promotion_margin)
    if decision.promote:
        promote(uri, versions[cand_alias], champ_alias, decision)
    log.info("registry: %s", decision.reason)
    create_markdown_artifact(comparison_markdown(name, versions, scores, cached, decision, key),
                             key=artifact_key("registry", name),
                             description=f"{name}: candidate vs champion")
    summary.update(
        versions={a: v.version for a, v in versions.items()},
        scores=scores,
        evaluated_now=[ver for ver, c in cached.items() if not c],
        promoted=decision.promote,
        reason=decision.reason,
        eval_key=key,
    )
    return summary
