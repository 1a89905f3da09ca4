"""The GRPO training flow.

    prepare data -> fetch model -> bring up planes -> evaluate
    -> for each step: rollout -> reward -> advantages -> log-probs -> train -> sync weights
                      (every k steps: evaluate)
    -> final evaluation -> export model

Every verb is a Prefect task (see ``tasks/``); the details live one call down.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from tqdm.auto import tqdm

from rl_core.config import load_config
from rl_core.data import PromptSampler
from rl_core.planes import get_planes, tear_down
from rl_core.report import format_eval, format_step, format_summary
from rl_core.rundir import RunDir
from tasks.evaluate import evaluate_policy, export_model
from tasks.setup import bring_up, fetch_model, prepare_data
from tasks.step import (
    compute_advantages,
    compute_logprobs,
    reward,
    rollout,
    sync_weights,
    train,
)

__all__ = ["grpo_train"]


@flow(name="grpo-train", log_prints=False)
def grpo_train(
    config: str | None = None,
    overrides: list[str] | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Train a policy with GRPO as configured by ``config`` (YAML) and ``overrides``."""
    cfg = load_config(config, overrides or [])
    run = RunDir(cfg)
    say = _console(show_progress)
    started = time.perf_counter()

    data = prepare_data(cfg.data, cfg.storage.cache_dir)
    model_path = fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir)
    planes = bring_up(cfg, model_path, data)
    sampler = PromptSampler(len(get_planes(planes).train_records), cfg.train.prompts_per_step,
                            cfg.seed)
    evals = [_evaluate(planes, 0, run, say)]

    bar = tqdm(range(1, cfg.train.steps + 1), desc="GRPO", unit="step", disable=not show_progress)
    for step in bar:
        samples = rollout(planes, sampler.next_batch(), step)
        scored = reward(planes, samples, step)
        batch = compute_advantages(planes, scored, step)
        batch, logprob_metrics = compute_logprobs(planes, batch, step)
        train_metrics = train(planes, batch, step)
        sync_metrics = sync_weights(planes, step)
        metrics = {**scored.metrics, **logprob_metrics, **train_metrics, **sync_metrics}
        run.log_metrics(step, metrics)
        say(format_step(step, cfg.train.steps, metrics))
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
            evals.append(_evaluate(planes, step, run, say))
    bar.close()

    if cfg.train.steps > 0:
        evals.append(_evaluate(planes, cfg.train.steps, run, say))
    model_dir = export_model(planes, str(run.model_dir))
    tear_down(planes)
    summary = {
        "run_name": run.name,
        "run_dir": str(run.path),
        "model_dir": model_dir,
        "metrics_path": str(run.metrics_path),
        "steps": cfg.train.steps,
        "seconds": time.perf_counter() - started,
        "data": {"train_digest": data.train_digest, "eval_digest": data.eval_digest},
        "first_eval": _brief(evals[0]),
        "last_eval": _brief(evals[-1]),
        "evals": [_brief(e) for e in evals],
    }
    run.write_summary(summary)
    say(format_summary(summary))
    return summary


def _evaluate(planes, step: int, run: RunDir, say) -> dict[str, Any]:  # noqa: ANN001
    result = evaluate_policy(planes, step)
    run.log_eval(result)
    say(format_eval(result))
    return result


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "samples"}


def _console(show: bool):  # noqa: ANN202
    """Lines go to the Prefect run log (the UI) and, above the progress bar, to the terminal."""
    log = get_run_logger()

    def say(line: str) -> None:
        log.info(line)
        if show:
            tqdm.write(line)

    return say

