"""The GRPO training flow.

    prepare data -> fetch model -> bring up planes -> (resume from checkpoint) -> evaluate
    -> for each step: rollout -> reward -> advantages -> log-probs -> train -> sync weights
                      (every k steps: checkpoint, evaluate)
       (rollout.max_staleness = k: the next k steps' rollouts run while this one trains;
        algorithm.dynamic_sampling: more rollout rounds until the groups carry gradient;
        flows/rollouts.py)
    -> checkpoint -> export model -> final evaluation of the exported model (a subflow)

Every verb is a Prefect task (see ``tasks/``); the details live one call down.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.utilities.annotations import opaque
from tqdm.auto import tqdm

from flows._redacted import redacted_flow
from flows.evaluate import evaluate as evaluate_model
from flows.rollouts import Rollouts
from rl_core import storage
from rl_core.checkpoint import CheckpointError, latest_checkpoint
from rl_core.config import load_config
from rl_core.data import PromptSampler
from rl_core.grpo import split_informative_groups, summarize_samples
from rl_core.planes import PlanesHandle, get_planes, tear_down
from rl_core.report import format_eval, format_step, format_summary
from rl_core.rewards import RewardFunctionError
from rl_core.rundir import RunDir
from tasks.checkpoint import restore_checkpoint, save_checkpoint
from tasks.evaluate import artifact_key, evaluate_policy, export_model
from tasks.setup import bring_up, fetch_model, prepare_data
from tasks.step import (
    StepSamples,
    StepTaskError,
    compute_advantages,
    compute_logprobs,
    release_rollout_memory,
    reward,
    sync_weights,
    train,
)
from tasks.tracking import (
    TrackingHandle,
    finish_tracking,
    log_checkpoint,
    log_evaluation,
    log_step,
    sample_rows,
    start_tracking,
    tracking_failed,
)

__all__ = ["grpo_train"]

Resume = Literal["auto", "always", "never"]
_PROGRESS_EVERY_S = 5.0  # the progress artifact is an API call: at most one per 5 s


@redacted_flow(name="grpo-train", log_prints=False, on_failure=[tracking_failed],
               on_crashed=[tracking_failed])
def grpo_train(
    config: str | None = None,
    overrides: list[str] | None = None,
    show_progress: bool = True,
    resume: Resume = "auto",
) -> dict[str, Any]:
    """Train a policy with GRPO as configured by ``config`` (YAML) and ``overrides``.

    ``resume``: ``auto`` continues from the run directory's latest complete checkpoint when
    there is one; ``always`` requires one (and without ``run_name`` picks the newest run of
    this config); ``never`` starts over.
    """
    cfg = load_config(config, overrides or [])
    if cfg.storage.s3_endpoint_url:  # for boto3, MLflow's artifact store and every child
        os.environ.update(storage.s3_env(cfg.storage.s3_endpoint_url))
    run = RunDir(cfg, resume_latest=resume == "always")
    say = _console(show_progress)
    started = time.perf_counter()
    # Under checkpoint.uri each run has its own prefix: keep-last-K and resume stay per run.
    ckpt_root = storage.join(cfg.checkpoint.uri, run.name) if cfg.checkpoint.uri else str(
        run.checkpoint_dir
    )
    resume_from = latest_checkpoint(ckpt_root) if resume != "never" else None
    if resume == "always" and resume_from is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {ckpt_root}")

    data = prepare_data(cfg.data, cfg.storage.cache_dir)
    tracking = start_tracking(cfg, str(run.path), data,
                              resume_from=str(resume_from) if resume_from else None)
    model_path = fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir)
    planes = bring_up(cfg, model_path, data, str(run.path))
    rollouts = _rollouts(planes, cfg)
    start = 1
    if resume_from is not None:
        start = _restore(planes, rollouts, run, resume_from, data.train_digest)
        say(f"resumed from {resume_from}; continuing at step {start}")
    else:
        run.truncate_after(-1)  # a fresh start in an existing directory starts a fresh log
    # A resume on another machine (checkpoints in S3) has no local history: evaluate the
    # restored policy at the checkpoint's step, never as if it were step 0.
    evals = run.read_evals() or [_evaluate(planes, start - 1, run, say, tracking)]

    progress = create_progress_artifact(
        100.0 * (start - 1) / max(cfg.train.steps, 1),
        key=artifact_key("progress", run.name),
        description=f"GRPO steps done of {cfg.train.steps}",
    )
    bar = tqdm(desc="GRPO", unit="step", initial=start - 1, total=cfg.train.steps,
               disable=not show_progress)
    step, restarts, progress_at = start, 0, time.monotonic()
    while step <= cfg.train.steps:
        try:
            scored, metrics = grpo_step(planes, rollouts, step)
        except StepTaskError as exc:
            if isinstance(exc.__cause__, RewardFunctionError):
                # Not the planes' fault: a rebuild would score zeros for K more steps.
                raise RuntimeError(f"GRPO step {exc.step}: {exc.__cause__}") from exc
            # Task retries are spent: rebuild both planes from the latest checkpoint.
            restarts += 1
            if restarts > cfg.train.max_plane_restarts:
                raise RuntimeError(
                    f"GRPO step {exc.step} failed after its task retries and "
                    f"{restarts - 1} plane restart(s) (train.max_plane_restarts): {exc}"
                ) from exc
            latest = latest_checkpoint(ckpt_root)
            say(f"{exc}; rebuilding the planes from {latest or 'the base model'} "
                f"(restart {restarts} of {cfg.train.max_plane_restarts})")
            tear_down(planes)
            planes = bring_up(cfg, model_path, data, str(run.path))
            rollouts = _rollouts(planes, cfg)
            if latest:
                step = _restore(planes, rollouts, run, latest, data.train_digest)
            else:  # no checkpoint yet: start over from step 1, and so do the logs and ledger
                run.truncate_after(0)
                step = 1
            evals = run.read_evals()
            bar.n = step - 1
            continue
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            metrics.update(save_checkpoint(planes, ckpt_root, step, rollouts.state_dict(),
                                           data.train_digest, _run_id(tracking)))
            log_checkpoint(tracking, step, ckpt_root)
        run.log_metrics(step, metrics)
        log_step(tracking, step, metrics, sample_rows(scored.samples, get_planes(planes).tokenizer))
        run.log_samples(step, scored.ledger())
        say(format_step(step, cfg.train.steps, metrics))
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        if step == cfg.train.steps or time.monotonic() - progress_at >= _PROGRESS_EVERY_S:
            update_progress_artifact(progress, 100.0 * step / cfg.train.steps)  # ~20 ms
            progress_at = time.monotonic()
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
            evals.append(_evaluate(planes, step, run, say, tracking))
        step += 1
    bar.close()

    if not (cfg.checkpoint.every and cfg.train.steps % cfg.checkpoint.every == 0):
        save_checkpoint(planes, ckpt_root, cfg.train.steps, rollouts.state_dict(),
                        data.train_digest, _run_id(tracking))
        log_checkpoint(tracking, cfg.train.steps, ckpt_root)
    model_dir = export_model(planes, str(run.model_dir))
    tear_down(planes)
    if evals[-1]["step"] != cfg.train.steps:
        evals.append(_final_evaluation(config, overrides, model_dir, cfg.train.steps, run, say))
        log_evaluation(tracking, cfg.train.steps, evals[-1])
    registered = finish_tracking(tracking, model_dir=model_dir, eval_result=_brief(evals[-1]))
    summary = {
        "run_name": run.name,
        "run_dir": str(run.path),
        "model_dir": model_dir,
        "metrics_path": str(run.metrics_path),
        "checkpoint_dir": ckpt_root,
        "steps": cfg.train.steps,
        "resumed_from_step": start - 1 if resume_from is not None else None,
        "plane_restarts": restarts,
        "seconds": time.perf_counter() - started,
        "data": {"train_digest": data.train_digest, "eval_digest": data.eval_digest},
        "first_eval": _brief(evals[0]),
        "last_eval": _brief(evals[-1]),
        "evals": [_brief(e) for e in evals],
        "tracking": registered,
    }
    run.write_summary(summary)
    say(format_summary(summary))
    return summary


def grpo_step(planes: PlanesHandle, rollouts: Rollouts, step: int) -> tuple[StepSamples, dict]:
    """rollout (or take the one generated ahead) -> (release the engines' memory) -> reward
    -> (dynamic sampling: more rounds) -> advantages -> log-probs -> (submit the rollouts of
    the next steps: they overlap training) -> train -> sync weights (after those rollouts)."""
    cfg = get_planes(planes).config
    started = time.perf_counter()
    samples = rollouts.take(step)
    released = release_rollout_memory(planes, step) if get_planes(planes).time_share else {}
    # opaque(): Prefect resolves the argument but does not walk the thousands of token lists
    # inside it looking for futures (that walk cost ~150 ms per task call on the demo).
    scored = reward(planes, opaque(samples), step)
    if cfg.algorithm.dynamic_sampling:
        scored = _informative_groups(planes, rollouts, scored, step)
    metrics = {**scored.metrics, **released}
    if scored.samples:
        batch = compute_advantages(planes, opaque(scored), step)
        batch, logprob_metrics = compute_logprobs(planes, opaque(batch), step)
        rollouts.prefetch(step)
        metrics.update(logprob_metrics)
        metrics.update(train(planes, opaque(batch), step))
    else:  # dynamic sampling found no group with a gradient: nothing to train on
        rollouts.prefetch(step)
        metrics["train_skipped"] = 1.0
    t0 = time.perf_counter()
    rollouts.drain()
    metrics["time/overlap_wait"] = time.perf_counter() - t0
    metrics.update(sync_weights(planes, step))
    rollouts.done(step)
    metrics["time/step"] = time.perf_counter() - started
    return scored, metrics


def _informative_groups(
    planes: PlanesHandle, rollouts: Rollouts, scored: StepSamples, step: int
) -> StepSamples:
    """DAPO's dynamic sampling: keep the groups whose rewards differ, roll out more prompt
    batches until ``train.prompts_per_step`` such groups exist (or the rounds run out), and
    train on exactly that many; the rest go to the ledger as not trained."""
    cfg = get_planes(planes).config
    n, want = cfg.rollout.n_samples, cfg.train.prompts_per_step * cfg.rollout.n_samples
    generated = list(scored.samples)
    kept, dropped = split_informative_groups(scored.samples, n)
    rounds = 1
    while len(kept) < want and rounds < cfg.algorithm.dynamic_sampling_max_rounds:
        more = reward(planes, opaque(rollouts.extra(step)), step)
        rounds += 1
        generated += more.samples
        k, d = split_informative_groups(more.samples, n)
        kept, dropped = kept + k, dropped + d
    surplus = kept[want:]
    kept = kept[:want]
    tokens = sum(len(s.output_ids) for s in generated) or 1
    metrics = dict(scored.metrics)
    metrics.update(summarize_samples(generated, n))  # the policy's rewards: every sample
    metrics.update(
        {
            "dynamic_sampling_rounds": float(rounds),
            "dynamic_sampling_kept_groups": float(len(kept) // n),
            "dynamic_sampling_zero_var_groups": float(len(dropped) // n),
            "dynamic_sampling_surplus_groups": float(len(surplus) // n),
            # share of generated response tokens kept out of training (no gradient in them)
            "dynamic_sampling_untrained_token_frac": sum(
                len(s.output_ids) for s in dropped + surplus
            ) / tokens,
        }
    )
    return StepSamples(step, kept, metrics, dropped=dropped + surplus)


def _rollouts(planes: PlanesHandle, cfg: Any) -> Rollouts:  # noqa: ANN401
    sampler = PromptSampler(len(get_planes(planes).train_records), cfg.train.prompts_per_step,
                            cfg.seed)  # fmt: skip
    return Rollouts(planes, sampler, cfg.rollout.max_staleness, cfg.train.steps)


def _restore(
    planes: PlanesHandle, rollouts: Rollouts, run: RunDir, path, train_digest: str  # noqa: ANN001
) -> int:
    """Load a checkpoint into the planes and the prompt source; returns the next step."""
    state = restore_checkpoint(planes, str(path), train_digest)
    rollouts.load_state_dict(state.sampler)
    run.truncate_after(state.step)
    return state.step + 1


def _evaluate(planes, step: int, run: RunDir, say, tracking) -> dict[str, Any]:  # noqa: ANN001
    result = evaluate_policy(planes, step)
    run.log_eval(result)
    log_evaluation(tracking, step, result)
    say(format_eval(result))
    return result


def _final_evaluation(
    config: str | None, overrides: list[str] | None, model_dir: str, step: int, run: RunDir, say
) -> dict[str, Any]:  # noqa: ANN001
    """The `evaluate` flow, as a subflow, on the exported model: what users take away is
    what gets measured, loaded by a fresh engine from its Hugging Face files."""
    result = evaluate_model(
        config=config, overrides=overrides, model=model_dir, work_dir=str(run.path / "final-eval")
    )
    result.update(step=step, weight_version=step)
    run.log_eval(result)
    say(format_eval(result))
    return result


def _run_id(tracking: TrackingHandle | None) -> str | None:
    return tracking.run_id if tracking else None


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
