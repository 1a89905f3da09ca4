"""The evaluation flow: greedy pass@1 and sampled pass@k of a model on a held-out set.

    prepare data -> fetch model -> bring up a rollout engine -> evaluate

Usable on its own (``grpoflow evaluate``) and as a subflow.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from rl_core.config import load_config
from rl_core.planes import tear_down
from rl_core.report import format_eval
from tasks.evaluate import evaluate_policy
from tasks.setup import bring_up, fetch_model, prepare_data

__all__ = ["evaluate"]


@flow(name="evaluate")
def evaluate(
    config: str | None = None,
    overrides: list[str] | None = None,
    model: str | None = None,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (default: the config's ``model.path``) on the config's eval set.

    ``work_dir`` holds the engines' logs (default: ``<storage.root>/evaluations/<name>-<time>``).
    """
    extra = [f"model.path={model}"] if model else []
    cfg = load_config(config, [*(overrides or []), *extra])
    data = prepare_data(cfg.data, cfg.storage.cache_dir)
    model_path = fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work_dir = work_dir or str(Path(cfg.storage.root) / "evaluations" / f"{cfg.name}-{stamp}")
    planes = bring_up(cfg, model_path, data, work_dir, with_trainer=False)
    try:
        result = evaluate_policy(planes, 0)
    finally:
        tear_down(planes)
    result["model"] = model_path
    get_run_logger().info(format_eval(result))
    return result
