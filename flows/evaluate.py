"""The evaluation flow: greedy pass@1 and sampled pass@k of a model on a held-out set.

    prepare data -> fetch model -> bring up a rollout engine -> evaluate

``registry=True`` (the scheduled evaluation, docs/deployments.md): resolve candidate and
champion -> evaluate each not yet evaluated on this set -> record -> decide -> promote.
``registered_like="tinker-%"`` (the scheduled evaluation of Tinker tenants' sampler weights,
docs/tinker.md): the newest version of each registered model so named -> evaluate each not
yet evaluated on this set -> record (no aliases, no promotion).
``model`` may also be a registry URI, ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``.

A registered version is a logged Hugging Face model (a training run's) or a PEFT LoRA adapter
(a Tinker tenant's ``save_weights_for_sampler``): the adapter is merged onto the config's
``model.path``, the base model it was trained on, and then evaluated like any other.
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

LATEST = "latest"  # the alias recorded with a version evaluated as its model's newest


@redacted_flow(name="evaluate")
def evaluate(config: str | None = None, overrides: list[str] | None = None,
             model: str | None = None, work_dir: str | None = None, registry: bool = False,
             step: int = 0, registered_like: str | None = None) -> dict[str, Any]:
    """Evaluate ``model`` (default: ``model.path``) on the config's eval set; ``work_dir`` holds
    the engines' logs. ``registry=True``: evaluate ``model.name``'s candidate and champion and
    promote the candidate when better (docs/deployments.md). ``registered_like``: evaluate the
    newest version of each registered model whose name matches this SQL LIKE pattern (e.g.
    ``tinker-%``: Tinker tenants' sampler weights) and record it on the version.
    ``step``: the model's training step."""
    if registry:
        return _evaluate_registry(config, overrides or [], work_dir)
    if registered_like:
        return _evaluate_latest(config, overrides or [], work_dir, registered_like)
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


def _fetch_version(cfg: ExperimentConfig, tracking_uri: str, name: str, version: str) -> str:
    """Registered ``name`` v``version`` as a local Hugging Face directory: a logged model as
    it is; a PEFT adapter merged onto the config's base model (``model.path``)."""
    from tasks.evaluate import adapter_version, fetch_adapter_version
    from tasks.tracking.registry import fetch_registered_model, registry_client

    client = registry_client(tracking_uri)
    source = client.get_model_version(name, version).source
    if adapter_version(client, source):
        base = fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir)
        get_run_logger().info("%s v%s is a LoRA adapter: merged onto model.path %s (%s)", name,
                              version, cfg.model.path, base)
        return fetch_adapter_version(tracking_uri, name, version, source, base,
                                     cfg.storage.cache_dir)
    return fetch_registered_model(tracking_uri, name, version, cfg.storage.cache_dir)


def _registered_model_dir(cfg: ExperimentConfig, uri: str) -> str:
    """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` as a local Hugging Face directory."""
    from tasks.tracking.registry import registry_client, resolve_aliases

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
    return _fetch_version(cfg, tracking_uri, name, version)


def _score_version(cfg: ExperimentConfig, config: str | None, overrides: list[str], uri: str,
                   client: Any, v: Any, key: str, work: Path) -> tuple[dict[str, float], bool]:  # noqa: ANN401
    """Version ``v``'s scores on held-out set ``key``: recorded earlier, or fetched, evaluated
    in ``work`` and recorded now; (scores, evaluated now)."""
    from tasks.tracking.registry import record_evaluation, recorded_evaluation

    recorded = recorded_evaluation(client, v.name, v.version, key)
    if recorded is not None:
        return recorded, False
    path = _fetch_version(cfg, uri, v.name, v.version)
    result = evaluate(config=config, overrides=overrides, model=path, work_dir=str(work))
    return record_evaluation(uri, v, key, result), True


def _evaluate_registry(
    config: str | None, overrides: list[str], work_dir: str | None
) -> dict[str, Any]:
    from tasks.tracking.registry import (
        comparison_markdown,
        decide,
        promote,
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
        recorded, now = _score_version(cfg, config, overrides, uri, client, v, key,
                                       base / f"v{v.version}")
        cached[v.version] = not now
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


def _evaluate_latest(config: str | None, overrides: list[str], work_dir: str | None,
                     pattern: str) -> dict[str, Any]:
    """The newest version of each registered model named like ``pattern``, each evaluated once
    per held-out set (recorded as the registry evaluation records it: a nested run under the
    version's run and ``eval.<key>.*`` tags on the version)."""
    from tasks.tracking.registry import (
        RegistryVersion,
        registry_client,
    )

    log = get_run_logger()
    cfg = load_config(config, overrides)
    uri = _tracking_uri(cfg)
    client = registry_client(uri)
    like = pattern.replace("'", "''")
    names = sorted(m.name for m in client.search_registered_models(
        filter_string=f"name LIKE '{like}'", max_results=1000))
    summary: dict[str, Any] = {"registered_like": pattern, "versions": {}, "scores": {},
                               "evaluated_now": []}
    if not names:
        log.info("registry: no registered model is named like %r: nothing to evaluate", pattern)
        return summary
    data = prepare_data(cfg.data, cfg.storage.cache_dir, answer_kind(cfg.reward))
    key = registry_evaluation_key(cfg, data.eval_digest)
    base = Path(work_dir or Path(cfg.storage.root) / "evaluations"
                / f"registered-{time.strftime('%Y%m%d-%H%M%S')}")
    rows, failed = [], {}
    for name in names:
        quoted = name.replace("'", "''")
        found = client.search_model_versions(f"name = '{quoted}'")
        if not found:
            continue  # registered, no version yet
        mv = max(found, key=lambda m: int(m.version))
        v = RegistryVersion(name, str(mv.version), LATEST, mv.run_id, mv.source)
        ref = f"{name}/{v.version}"
        try:  # one tenant's unusable version costs that version only
            recorded, now = _score_version(cfg, config, overrides, uri, client, v, key,
                                           base / f"{name}-v{v.version}")
        except Exception as exc:  # noqa: BLE001 - reported below, the run fails
            failed[ref] = f"{type(exc).__name__}: {exc}"[:500]
            log.error("registry: %s v%s not evaluated: %s", name, v.version, failed[ref])
            rows.append(f"| {name} | {v.version} | failed: {failed[ref][:200]} |")
            continue
        if now:
            summary["evaluated_now"].append(ref)
        summary["versions"][name] = v.version
        summary["scores"][ref] = recorded
        log.info("registry: %s v%s: %s (%s)", name, v.version, _format_scores(recorded),
                 "evaluated now" if ref in summary["evaluated_now"] else "recorded earlier")
        rows.append(f"| {name} | {v.version} | {_format_scores(recorded)} |")
    create_markdown_artifact(
        "\n".join([f"# Registered models like `{pattern}`: newest versions (eval key {key})",
                    "", "| model | version | scores |", "|---|---|---|", *rows]),
        key=artifact_key("registered", pattern), description=f"newest versions of {pattern}")
    summary["eval_key"] = key
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} registered versions like {pattern!r} "
                           f"could not be evaluated (the others are recorded): {failed}")
    return summary


def _format_scores(scores: dict[str, float]) -> str:
    """``pass_at_1=0.25, ...`` (the pass@ metrics first)."""
    order = sorted(scores, key=lambda k: (not k.startswith("pass_at"), k))
    return ", ".join(f"{k}={scores[k]:.4g}" for k in order[:6])
