"""The GRPO training flow, read top to bottom like the pipeline it runs.

    prepare data -> fetch model -> bring up planes -> (resume) -> evaluate
    -> for each step: rollout -> reward -> advantages -> log-probs -> train -> sync weights
                      (every k steps: checkpoint, evaluate)
    -> checkpoint -> export model -> final evaluation (a subflow) -> register the model

Every verb is a Prefect task (``tasks/``) or an ``rl_core`` call; how rollouts are scheduled is
``flows/schedule.py``. A step whose task retries are spent rebuilds both planes from the latest
checkpoint (``train.max_plane_restarts``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from prefect.utilities.annotations import opaque

from flows._redacted import redacted_flow
from flows.evaluate import evaluate as evaluate_model
from flows.run import Run
from flows.schedule import Schedule, schedule_for
from rl_core.config import load_config
from rl_core.planes import PlanesHandle, get_planes, tear_down
from rl_core.preflight import preflight
from rl_core.rewards import answer_kind
from rl_core.rundir import read_control
from tasks.checkpoint import restore_checkpoint, save_checkpoint
from tasks.evaluate import evaluate_policy, export_model
from tasks.setup import bring_up, fetch_model, prepare_data
from tasks.step import (
    StepSamples,
    compute_advantages,
    compute_logprobs,
    needs_logprobs,
    release_rollout_memory,
    reward,
    score_advantages,
    sync_weights,
    train,
)
from tasks.tracking import finish_tracking, log_evaluation, start_tracking

log = logging.getLogger(__name__)

__all__ = ["GRPOPlanes", "grpo_step", "grpo_train"]


@redacted_flow(name="grpo-train", log_prints=False, on_failure=[Run.failed],
               on_crashed=[Run.failed])
def grpo_train(
    config: str | None = None,
    overrides: list[str] | None = None,
    show_progress: bool = True,
    resume: Literal["auto", "always", "never"] = "auto",
) -> dict[str, Any]:
    """Train a policy with GRPO as configured by ``config`` (YAML) and ``overrides``. ``resume``:
    ``auto`` continues from the run's latest complete checkpoint if any; ``always`` requires one
    (without ``run_name``: the config's newest run); ``never`` starts over."""
    run = Run.open(config, overrides, resume, show_progress)
    cfg = run.cfg
    data = prepare_data(cfg.data, cfg.storage.cache_dir, answer_kind(cfg.reward))
    tracking = start_tracking(cfg, str(run.dir.path), data, resume_from=run.resume_from)
    model_path = fetch_model(cfg.model, cfg.data, cfg.storage.cache_dir)
    preflight(cfg, model_path=model_path, data=False)  # the model checks, on the fetched model
    model_dir, evals, restarts = run.train(GRPOPlanes(run, model_path, data), tracking)
    if evals[-1]["step"] != cfg.train.steps:  # what users take away is what gets measured
        evals.append(run.log_eval(evaluate_model(
            config=config, overrides=final_eval_overrides(cfg, config, overrides), model=model_dir,
            work_dir=str(run.dir.path / "final-eval"), step=cfg.train.steps)))
        log_evaluation(tracking, cfg.train.steps, evals[-1])
    registered = finish_tracking(tracking, model_dir=model_dir, eval_result=run.brief(evals[-1]))
    return run.finish(model_dir, data, evals, registered, restarts)


class GRPOPlanes:
    """GRPO as :meth:`flows.run.Run.train` drives it: both planes and the rollout schedule,
    brought up (again) from a checkpoint; one step per call."""

    kind, last_eval_here = "GRPO", False

    def __init__(self, run: Run, model_path: str, data: Any) -> None:  # noqa: ANN401
        self.run, self.model_path, self.data = run, model_path, data
        self.planes: PlanesHandle | None = None

    def start(self, checkpoint: str | None) -> int:
        self.planes = bring_up(self.run.cfg, self.model_path, self.data, str(self.run.dir.path))
        self.schedule = schedule_for(self.planes)
        self.tokenizer = get_planes(self.planes).tokenizer
        if checkpoint is None:
            return 0
        state, buffer = restore_checkpoint(self.planes, checkpoint, self.data.train_digest)
        self.schedule.load_state_dict(state.sampler, buffer)
        return state.step

    def steps(self, first: int, stop: int) -> list[tuple[dict[str, float], StepSamples]]:
        engines = self.apply_control()
        scored, metrics = grpo_step(self.planes, self.schedule, first)
        return [({**metrics, **engines}, scored)]

    def apply_control(self) -> dict[str, float]:
        """The run's control file (``grpoflow scale``): a new ``rollout.num_engines`` starts
        engines joining, or the newest draining, in the background; the engines in service."""
        plane = get_planes(self.planes).rollout
        if not hasattr(plane, "scale_to"):
            return {}
        want = read_control(self.run.dir.path).get("rollout.num_engines")
        if isinstance(want, int) and want >= 1 and want != plane.scale_target:
            log.warning("control file: rollout.num_engines %d -> %d", plane.scale_target, want)
            plane.scale_to(want)
        elif want is not None and not (isinstance(want, int) and want >= 1):
            log.warning("control file: rollout.num_engines=%r ignored (an integer >= 1)", want)
        return {"rollout_engines": float(len(plane.pool.in_service_urls())),
                "rollout_scale_errors": float(plane.scale_errors)}

    def checkpoint(self, step: int, run_id: str | None, final: bool) -> dict[str, float]:
        buffer = None if final else opaque(self.schedule.buffer())
        return save_checkpoint(self.planes, self.run.ckpt_root, step, self.schedule.state_dict(),
                               self.data.train_digest, run_id, buffer)

    def evaluate(self, step: int) -> dict[str, Any]:
        return evaluate_policy(self.planes, step)

    def export(self, out_dir: str) -> str:
        return export_model(self.planes, out_dir)

    def close(self) -> None:
        if self.planes is not None:
            tear_down(self.planes)
            self.planes = None


# What the final evaluation of a run on embedded CPU engines changes: one in-process engine.
IN_PROCESS_EVAL = ["rollout.engine=local", "rollout.num_engines=1", "cluster.mode=local",
                   "rollout.weight_sync=auto"]  # fmt: skip


def final_eval_overrides(cfg: Any, config: str | None, overrides: list[str] | None) -> list[str]:
    """The final evaluation's overrides. A run on embedded CPU engines evaluates on the in-process
    engine (same engine core and greedy decoding, so the same answers, nothing to start again);
    agent runs, and configs the in-process engine cannot run, keep their HTTP engines."""
    base = list(overrides or [])
    if cfg.rollout.engine != "embedded" or cfg.agent.enabled:
        return base
    try:
        load_config(config, [*base, *IN_PROCESS_EVAL])
    except ValueError:
        return base
    return [*base, *IN_PROCESS_EVAL]


def grpo_step(planes: PlanesHandle, schedule: Schedule, step: int) -> tuple[StepSamples, dict]:
    """rollout (or take the one generated ahead) -> (release the engines' memory) -> reward
    -> (dynamic sampling: more rounds) -> advantages -> log-probs -> (submit the rollouts of
    the next steps: they overlap training) -> train -> sync weights (after those rollouts)."""
    p = get_planes(planes)
    started = time.perf_counter()
    samples = schedule.take(step)
    released = release_rollout_memory(planes, step) if p.time_share else {}
    # opaque(): Prefect resolves the argument but does not walk the thousands of token lists
    # inside it looking for futures (that walk cost ~150 ms per task call on the demo).
    scored = reward(planes, opaque(samples), step)
    scored = score_advantages(planes, scored, step)  # e.g. the teacher's log-probs
    scored = schedule.informative(scored, step)  # dynamic sampling may roll out more
    metrics = {**scored.metrics, **released}
    if scored.samples:
        batch = compute_advantages(planes, scored)
        if needs_logprobs(planes):
            batch, logprob_metrics = compute_logprobs(planes, opaque(batch), step)
            metrics.update(logprob_metrics)
        schedule.prefetch(step)
        metrics.update(train(planes, opaque(batch), step))
    else:  # dynamic sampling found no group with a gradient: nothing to train on
        schedule.prefetch(step)
        metrics["train_skipped"] = 1.0
    t0 = time.perf_counter()
    schedule.drain()
    metrics["time/overlap_wait"] = time.perf_counter() - t0
    metrics.update(sync_weights(planes, step))
    metrics.update(schedule.done(step))
    metrics["time/step"] = time.perf_counter() - started
    return scored, metrics
