"""What the training flow keeps about its run besides the planes: the config, the run
directory, where checkpoints go and which one to resume from, the console and the progress
shown in the terminal and the Prefect UI, and the summary written at the end.

The flow calls these helpers between its tasks; none of them is a Prefect task (they are
local bookkeeping, milliseconds each).
"""

from __future__ import annotations

import os
import time
from typing import Any

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
from tasks.tracking import log_step, log_traces, sample_rows, tracking_failed

__all__ = ["Run", "yield_cpu_to_the_step"]

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
    def open(cls, config: str | None, overrides: list[str] | None, resume: str,
             show: bool) -> Run:
        cfg = load_config(config, overrides or [])
        preflight(cfg, model=False)  # deployment runs start here, not at the CLI
        if cfg.storage.s3_endpoint_url:  # for boto3, MLflow's artifact store and every child
            os.environ.update(storage.s3_env(cfg.storage.s3_endpoint_url))
        if get_current_settings().api.url is None:
            yield_cpu_to_the_step()
        return cls(cfg, resume, show)

    def latest_checkpoint(self) -> Any:  # noqa: ANN401
        return latest_checkpoint(self.ckpt_root)

    def say(self, line: str) -> None:
        """To the Prefect run log (the UI) and, above the progress bar, to the terminal."""
        self._log.info(line)
        if self._show:
            tqdm.write(line)

    def record_step(self, step: int, metrics: dict[str, float], scored: Any, tracking: Any,
                    tokenizer: Any, line: str | None = None) -> None:  # noqa: ANN401 - fmt: skip
        """A finished step: metrics (and a GRPO step's ``scored`` samples: ledger, sample
        tables, episode traces) to the run directory and MLflow, ``line`` (default: GRPO's step
        line) to the console, the progress bar and artifact on. SFT steps come here too."""
        steps, kind = self.cfg.train.steps, "GRPO" if scored is not None else "SFT"
        self.dir.log_metrics(step, metrics)
        if scored is None:
            log_step(tracking, step, metrics)
        else:
            log_step(tracking, step, metrics, sample_rows(scored.samples, tokenizer))
            log_traces(tracking, step, scored.samples, self.cfg.tracking.traces_per_step,
                       getattr(scored, "dropped", ()))
            self.dir.log_samples(step, scored.ledger())
        self.say(line or format_step(step, steps, metrics))
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
               registered: Any, restarts: int) -> dict[str, Any]:  # noqa: ANN401 - fmt: skip
        """The run's summary: written to ``summary.json``, printed, returned by the flow."""
        summary = {
            "run_name": self.dir.name, "run_dir": str(self.dir.path), "model_dir": model_dir,
            "metrics_path": str(self.dir.metrics_path), "checkpoint_dir": self.ckpt_root,
            "steps": self.cfg.train.steps, "resumed_from_step": self.resumed_from_step,
            "plane_restarts": restarts, "seconds": time.perf_counter() - self.started_at,
            "data": {"train_digest": data.train_digest, "eval_digest": data.eval_digest},
            "first_eval": self.brief(evals[0]), "last_eval": self.brief(evals[-1]),
            "evals": [self.brief(e) for e in evals], "tracking": registered,
        }
        self.dir.write_summary(summary)
        self.say(format_summary(summary))
        return summary
