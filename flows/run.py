"""The one flow skeleton of GRPO and SFT (:meth:`Run.train`) and what a run keeps besides its
model: the config, the run directory, where checkpoints go and which one to resume from, the
console and the progress in the terminal and the Prefect UI, the summary written at the end.

A flow hands :meth:`Run.train` a :class:`Trainee` (GRPO's planes, SFT's session): resume,
evaluate, steps with checkpoints and evaluations at their cadence, a rebuild from the latest
checkpoint when a step's retries are spent, the last checkpoint, the export. None of these
helpers is a Prefect task (the trainee's verbs are).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import psutil
from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.settings import get_current_settings
from tqdm.auto import tqdm

from rl_core import storage
from rl_core.checkpoint import CheckpointError, latest_checkpoint
from rl_core.config import load_config
from rl_core.preflight import preflight
from rl_core.report import format_eval, format_step, format_summary
from rl_core.rundir import RunDir
from tasks.evaluate import artifact_key
from tasks.step import BUDGET_ERRORS, StepTaskError
from tasks.tracking import (
    log_checkpoint,
    log_evaluation,
    log_step,
    log_traces,
    sample_rows,
    tracking_failed,
)

__all__ = ["Run", "Trainee", "due", "yield_cpu_to_the_step"]


def due(every: int, step: int) -> bool:
    """A cadence (``checkpoint.every``, ``eval.every``; 0: never) falls on ``step``."""
    return bool(every) and step % every == 0


class Trainee(Protocol):
    """What :meth:`Run.train` drives: GRPO's planes (``flows/grpo_train.py``) or SFT's session
    (``flows/sft.py``). Each verb is a Prefect task (or calls them)."""

    kind: str  # "GRPO" or "SFT": the console's step lines and the summary
    tokenizer: Any  # the sample tables' decoding (GRPO)
    last_eval_here: bool  # the last evaluation by the trainee (SFT); GRPO's is a subflow

    def start(self, checkpoint: str | None) -> int:
        """Bring up (again), restored from ``checkpoint`` when given; the last step it holds."""

    def steps(self, first: int, stop: int) -> list[tuple[dict[str, float], Any]]:
        """Steps ``first..`` (at most to ``stop``): each one's metrics and scored samples."""

    def checkpoint(self, step: int, run_id: str | None, final: bool) -> dict[str, float]:
        """A complete checkpoint of ``step``; its metrics."""

    def evaluate(self, step: int) -> dict[str, Any]: ...

    def export(self, out_dir: str) -> str: ...

    def close(self) -> None: ...

EPHEMERAL_API = "prefect.server.api.server:create_app"


def yield_cpu_to_the_step(nice: int = 19, parent: psutil.Process | None = None) -> list[int]:
    """Run the Prefect API server this process started (ephemeral mode) at the lowest CPU
    priority; the pids changed. Its share of the cores stalled the step's thread team at
    every barrier (docs/benchmarks.md); task runs reach it as events nothing waits for."""
    changed = []
    for child in (parent or psutil.Process()).children():
        try:
            if EPHEMERAL_API in child.cmdline():
                child.nice(max(child.nice(), nice))
                changed.append(child.pid)
        except psutil.Error:
            continue  # gone, or not ours to change
    return changed

_PROGRESS_EVERY_S = 5.0  # the progress artifact is an API call: at most one per 5 s


class Run:
    """One training run's bookkeeping (see the module docstring)."""

    failed = staticmethod(tracking_failed)  # the flow's on_failure / on_crashed hook

    def __init__(self, cfg: Any, resume: str, show: bool) -> None:  # noqa: ANN401
        self.cfg = cfg
        self.dir = RunDir(cfg, resume_latest=resume == "always")
        self.started_at = time.perf_counter()
        self.started = False  # planes brought up once (a later bring-up is a rebuild)
        self.resumed_from_step: int | None = None
        # Under checkpoint.uri each run has its own prefix: keep-last-K and resume stay per run.
        self.ckpt_root = (storage.join(cfg.checkpoint.uri, self.dir.name) if cfg.checkpoint.uri
                          else str(self.dir.checkpoint_dir))
        found = latest_checkpoint(self.ckpt_root) if resume != "never" else None
        if resume == "always" and found is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {self.ckpt_root}")
        self.resume_from = str(found) if found is not None else None
        self._log, self._show = get_run_logger(), show
        self._bar: Any = None
        self._progress: Any = None
        self._progress_at = 0.0

    @classmethod
    def open(cls, config: str | None, overrides: list[str] | None, resume: str, show: bool,
             load: Callable[..., Any] = load_config) -> Run:
        cfg = load(config, overrides or [])
        if load is load_config:
            preflight(cfg, model=False)  # deployment runs start here, not at the CLI
        if cfg.storage.s3_endpoint_url:  # for boto3, MLflow's artifact store and every child
            os.environ.update(storage.s3_env(cfg.storage.s3_endpoint_url))
        if get_current_settings().api.url is None:
            yield_cpu_to_the_step()
        return cls(cfg, resume, show)

    def latest_checkpoint(self) -> Any:  # noqa: ANN401
        return latest_checkpoint(self.ckpt_root)

    def train(self, trainee: Trainee, tracking: Any) -> tuple[str, list[dict[str, Any]], int]:
        """The loop both flows run (module docstring); the exported model's directory, the
        evaluations, the plane restarts. The trainee is closed on the way out, a failure,
        Ctrl-C or SIGTERM (Prefect's TerminationSignal) included."""
        cfg, total, restarts = self.cfg, self.cfg.train.steps, 0
        run_id = tracking and tracking.run_id
        try:
            step = self._start(trainee, self.resume_from) + 1
            evals = self._evals_up_to(trainee, step - 1, tracking)
            while step <= total:
                try:
                    done = trainee.steps(step, self._stop(step))
                except StepTaskError as exc:
                    if isinstance(exc.__cause__, BUDGET_ERRORS):  # not the planes' fault
                        raise RuntimeError(f"{trainee.kind} step {exc.step}: {exc.__cause__}"
                                           ) from exc
                    restarts += 1
                    if restarts > cfg.train.max_plane_restarts:
                        raise RuntimeError(
                            f"{trainee.kind} step {exc.step} failed after its task retries and "
                            f"{restarts - 1} plane restart(s) (train.max_plane_restarts): "
                            f"{exc}") from exc
                    trainee.close()
                    latest = self.latest_checkpoint()
                    self.say(f"{exc}; rebuilding the planes from {latest or 'the base model'} "
                             f"(restart {restarts} of {cfg.train.max_plane_restarts})")
                    step = self._start(trainee, latest) + 1
                    evals = self._evals_up_to(trainee, step - 1, tracking)
                    continue
                for n, (metrics, scored) in enumerate(done, start=step):
                    # The step's lines reach the run directory before its checkpoint commits:
                    # a kill between the two resumes from the checkpoint before, which drops
                    # them and redoes the step; the other order lost the step's lines for good.
                    self.dir.log_metrics(n, metrics)
                    if scored is not None:
                        self.dir.log_samples(n, scored.ledger())
                    if due(cfg.checkpoint.every, n):
                        timing = trainee.checkpoint(n, run_id, False)
                        metrics.update(timing)
                        self.dir.amend_metrics(n, timing)
                        log_checkpoint(tracking, n, self.ckpt_root)
                    self.record_step(n, metrics, scored, tracking, trainee)
                    if due(cfg.eval.every, n) and n != total:
                        evals.append(self.evaluate(trainee, n, tracking))
                step += len(done)
            self.close_progress()
            if not due(cfg.checkpoint.every, total):
                trainee.checkpoint(total, run_id, True)
                log_checkpoint(tracking, total, self.ckpt_root)
            model_dir = trainee.export(str(self.dir.model_dir))
            if trainee.last_eval_here and evals[-1]["step"] != total:
                evals.append(self.evaluate(trainee, total, tracking))
            return model_dir, evals, restarts
        finally:
            trainee.close()

    def _evals_up_to(self, trainee: Trainee, step: int, tracking: Any) -> list[dict[str, Any]]:  # noqa: ANN401
        """The evaluations logged up to ``step``, the one due at ``step`` made if it is missing
        (step 0's; or a kill after step's checkpoint and before its evaluation)."""
        evals = self.dir.read_evals()
        missing = not evals or (due(self.cfg.eval.every, step) and step != self.cfg.train.steps
                                and evals[-1]["step"] != step)
        return [*evals, self.evaluate(trainee, step, tracking)] if missing else evals

    def _stop(self, step: int) -> int:
        """The last step before the next checkpoint or evaluation is due (or the end)."""
        stop = self.cfg.train.steps
        for every in (self.cfg.eval.every, self.cfg.checkpoint.every):
            if every:
                stop = min(stop, (step // every + 1) * every if step % every else step)
        return stop

    def _start(self, trainee: Trainee, checkpoint: Any) -> int:  # noqa: ANN401
        """Bring the trainee up from ``checkpoint`` (or fresh); the last step it holds."""
        step = trainee.start(None if checkpoint is None else str(checkpoint))
        if checkpoint is None:
            self.dir.truncate_after(0 if self.started else -1)  # a fresh start: fresh logs
        else:
            self.dir.truncate_after(step)
            if not self.started:
                self.resumed_from_step = step
                self.say(f"resumed from {checkpoint}; continuing at step {step + 1}")
        self.started = True
        return step

    def evaluate(self, trainee: Trainee, step: int, tracking: Any) -> dict[str, Any]:
        """An evaluation of the trainee's current weights, logged everywhere."""
        result = self.log_eval(trainee.evaluate(step))
        if result.get("loss") is not None:
            log_step(tracking, step, {"eval/loss": result["loss"]})
        log_evaluation(tracking, step, result)
        return result

    def say(self, line: str) -> None:
        """To the Prefect run log (the UI) and, above the progress bar, to the terminal."""
        self._log.info(line)
        if self._show:
            tqdm.write(line)

    def record_step(self, step: int, metrics: dict[str, float], scored: Any, tracking: Any,
                    trainee: Trainee) -> None:  # noqa: ANN401
        """A finished step, already in the run directory: metrics (and a GRPO step's
        ``scored`` samples: sample tables, episode traces) to MLflow, its line to the console,
        the progress bar and artifact on."""
        steps, kind = self.cfg.train.steps, trainee.kind
        if scored is None:
            log_step(tracking, step, metrics)
        else:
            log_step(tracking, step, metrics, sample_rows(scored.samples, trainee.tokenizer))
            log_traces(tracking, step, scored.samples, self.cfg.tracking.traces_per_step,
                       getattr(scored, "dropped", ()))
        self.say(format_step(step, steps, metrics, kind))
        if self._bar is None:
            self._bar = tqdm(desc=kind, unit="step", initial=step - 1, total=steps,
                             disable=not self._show)
            self._progress = create_progress_artifact(
                100.0 * (step - 1) / max(steps, 1), key=artifact_key("progress", self.dir.name),
                description=f"{kind} steps done of {steps}")
        self._bar.n = step - 1
        self._bar.update(1)
        if "reward_mean" in metrics:
            self._bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        else:
            self._bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        if step == steps or time.monotonic() - self._progress_at >= _PROGRESS_EVERY_S:
            update_progress_artifact(self._progress, 100.0 * step / steps)  # ~20 ms
            self._progress_at = time.monotonic()

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def log_eval(self, result: dict[str, Any]) -> dict[str, Any]:
        self.dir.log_eval(result)
        self.say(format_eval(result))
        return result

    @staticmethod
    def brief(result: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in result.items() if k != "samples"}

    def finish(self, model_dir: str, data: Any, evals: list[dict[str, Any]],  # noqa: ANN401
               registered: Any, restarts: int, kind: str = "GRPO") -> dict[str, Any]:  # noqa: ANN401 - fmt: skip
        """The run's summary: written to ``summary.json``, printed, returned by the flow."""
        counts = {k: getattr(data, k) for k in ("num_train", "num_eval") if hasattr(data, k)}
        summary = {
            "run_name": self.dir.name, "run_dir": str(self.dir.path), "model_dir": model_dir,
            "metrics_path": str(self.dir.metrics_path), "checkpoint_dir": self.ckpt_root,
            "kind": kind, "steps": self.cfg.train.steps,
            "resumed_from_step": self.resumed_from_step,
            "plane_restarts": restarts, "seconds": time.perf_counter() - self.started_at,
            "data": {"train_digest": data.train_digest, "eval_digest": data.eval_digest,
                     **counts},
            "first_eval": self.brief(evals[0]), "last_eval": self.brief(evals[-1]),
            "evals": [self.brief(e) for e in evals], "tracking": registered,
        }
        self.dir.write_summary(summary)
        self.say(format_summary(summary))
        return summary
