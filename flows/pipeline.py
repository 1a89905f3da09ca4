"""The post-training chain as one flow: SFT, then GRPO from its export, then registry evaluation.

    sft-train -> grpo-train (model.path = the SFT export) -> evaluate (registry=True)

Each stage is the subflow that runs it alone, with its own tasks, retries, checkpoints and
MLflow run; this module only wires them together (no math, no MLflow calls, no tasks) and
records what each produced. Stage run names, resume and the shared MLflow store:
docs/deployments.md, 'The post-training chain'.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows._redacted import redacted_flow
from flows.evaluate import evaluate
from flows.grpo_train import grpo_train
from flows.sft import sft_train
from rl_core.config import ConfigError, load_config
from rl_core.preflight import preflight
from rl_core.sft import load_sft_config
from tasks.evaluate import artifact_key

__all__ = ["finished_run", "format_post_train", "post_train"]


@redacted_flow(name="post-train", log_prints=False)
def post_train(
    sft_config: str,
    grpo_config: str,
    sft_overrides: list[str] | None = None,
    grpo_overrides: list[str] | None = None,
    run_name: str | None = None,
    show_progress: bool = True,
    resume: Literal["auto", "never"] = "auto",
) -> dict[str, Any]:
    """SFT (``sft_config`` + ``sft_overrides``), GRPO (``grpo_config`` + ``grpo_overrides``) from
    its export, then the registry evaluation of the GRPO version. ``run_name`` names the chain and
    its stages (default ``post-train-<time>``); ``resume="never"`` reruns every stage afresh."""
    log = get_run_logger()
    name = run_name or f"post-train-{time.strftime('%Y%m%d-%H%M%S')}"
    sft_args = [f"run_name={name}-sft", *(sft_overrides or [])]
    grpo_args = [f"run_name={name}-grpo", *(grpo_overrides or [])]
    if any(o.split("=", 1)[0].strip() == "model.path" for o in grpo_overrides or []):
        raise ConfigError("post-train: the GRPO stage trains from the SFT stage's export; drop "
                          "model.path from the GRPO overrides (set it in the SFT overrides)")
    sft_cfg = load_sft_config(sft_config, sft_args)  # both stages checked before either runs
    grpo_cfg = load_config(grpo_config, [*grpo_args, f"model.path={_run_dir(sft_cfg) / 'model'}"])
    preflight(grpo_cfg, model=False)
    sft_store, grpo_store = _one_store(sft_cfg, grpo_cfg)
    sft_args, grpo_args = [*sft_store, *sft_args], [*grpo_store, *grpo_args]
    log.info(f"post-train {name}: stages {sft_cfg.run_name} (SFT) and {grpo_cfg.run_name} "
             f"(GRPO); run it again with run_name={name} to resume")

    sft, sft_skipped = _stage(sft_train, sft_cfg, resume, config=sft_config,
                              overrides=sft_args, show_progress=show_progress)
    grpo_args.append(f"model.path={sft['model_dir']}")
    grpo, grpo_skipped = _stage(grpo_train, grpo_cfg, resume if sft_skipped else "never",
                                config=grpo_config, overrides=grpo_args,
                                show_progress=show_progress)
    evaluation = (evaluate(config=grpo_config, overrides=grpo_args, registry=True)
                  if (grpo.get("tracking") or {}).get("version") else None)

    summary = {
        "run_name": name,
        "sft": {**_record(sft), "skipped": sft_skipped},
        "grpo": {**_record(grpo), "skipped": grpo_skipped, "base_model": sft["model_dir"]},
        "evaluation": evaluation,
        "accuracy": {"before_sft": sft["first_eval"].get("pass_at_1"),
                     "after_sft": grpo["first_eval"].get("pass_at_1"),
                     "after_rl": grpo["last_eval"].get("pass_at_1")},
    }
    (Path(grpo["run_dir"]) / "post-train.json").write_text(json.dumps(summary, indent=2))
    text = format_post_train(summary)
    create_markdown_artifact(f"```\n{text}\n```\n", key=artifact_key("post-train", name),
                             description=f"post-train {name}: what each stage produced")
    log.info(text)
    return summary


def finished_run(cfg: Any) -> dict[str, Any] | None:  # noqa: ANN401 - SFT or GRPO config
    """The summary of ``cfg``'s run when it finished: ``summary.json`` (written last) for the
    steps ``cfg`` asks for, naming an exported model that is there; else None."""
    try:
        summary = json.loads((_run_dir(cfg) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    model = Path(summary.get("model_dir") or "")
    if summary.get("steps") != cfg.train.steps or not (model / "config.json").is_file() \
            or not any(model.glob("*.safetensors")):
        return None
    return summary


def format_post_train(s: dict[str, Any]) -> str:
    """The chain's closing block: each stage's run, model and registered version; accuracy
    before SFT, after SFT and after GRPO; the registry's decision."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = ["=" * 72, f"post-train {s['run_name']}"]
    for stage in ("sft", "grpo"):
        r = s[stage]
        how = "finished earlier, skipped" if r["skipped"] else (
            f"resumed at step {r['resumed_from_step']}" if r["resumed_from_step"] else "trained")
        steps = f"{r['steps']} step{'' if r['steps'] == 1 else 's'}"
        lines.append(f"{stage.upper():>5}: run {r['run_name']} ({steps}, {how}) -> "
                     f"{r['model_dir']}" + (f" = {r['registered']}" if r["registered"] else ""))
    a = s["accuracy"]
    lines.append(f"held-out greedy accuracy: {pct(a['before_sft'])} before SFT -> "
                 f"{pct(a['after_sft'])} after SFT -> {pct(a['after_rl'])} after GRPO")
    e = s["evaluation"]
    lines.append(f"registry: {e.get('reason', '')}" if e is not None else
                 "registry: nothing registered (tracking off), nothing to evaluate")
    lines.append("=" * 72)
    return "\n".join(lines)


def _run_dir(cfg: Any) -> Path:  # noqa: ANN401
    """Where the stage flow keeps the run (rl_core.rundir.RunDir), without creating it."""
    return Path(cfg.storage.root).expanduser().resolve() / cfg.run_name


def _one_store(sft_cfg: Any, grpo_cfg: Any) -> tuple[list[str], list[str]]:  # noqa: ANN401
    """The SFT and GRPO stages' ``tracking.uri`` overrides that put both in one MLflow store: none
    under ``MLFLOW_TRACKING_URI``; else the GRPO stage's ``tracking.uri`` or the chain's SQLite
    file, for each stage that names no store."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return [], []
    root = Path(grpo_cfg.storage.root).expanduser().resolve()
    uri = [f"tracking.uri={grpo_cfg.tracking.uri or f'sqlite:///{root}/mlflow.db'}"]
    return ([] if sft_cfg.tracking.uri else uri), ([] if grpo_cfg.tracking.uri else uri)


def _stage(flow: Any, cfg: Any, resume: str, **params: Any) -> tuple[dict[str, Any], bool]:  # noqa: ANN401
    """The stage's summary (its finished run's, or what running the flow as a subflow returns)
    and whether it was skipped."""
    if resume == "auto" and (done := finished_run(cfg)) is not None:
        get_run_logger().info(f"{flow.name}: run {cfg.run_name} finished earlier "
                              f"({done['model_dir']}); skipped")
        return done, True
    return flow(resume=resume, **params), False


def _record(summary: dict[str, Any]) -> dict[str, Any]:
    """What the chain keeps of a stage's summary."""
    t = summary.get("tracking") or {}
    return {"run_name": summary["run_name"], "run_dir": summary["run_dir"],
            "model_dir": summary["model_dir"], "steps": summary["steps"],
            "resumed_from_step": summary.get("resumed_from_step"),
            "mlflow_run_id": t.get("run_id"),
            "registered": (f"{t['registered_model']} v{t['version']}" if t.get("version")
                           else None),
            "first_eval": summary["first_eval"], "last_eval": summary["last_eval"]}
