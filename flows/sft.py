"""The SFT flow: supervised fine-tuning whose exported model ``grpo_train`` takes as is.

    fetch model -> prepare data (data.teacher: the teacher's samples) -> start trainer
    -> the one loop of ``flows/run.py`` (resume, evaluate, chunks of steps with checkpoints
    and evaluations) -> export model -> final evaluation -> register the model

Verbs are Prefect tasks (``tasks/sft.py``, ``tasks/tracking``), the step is GRPO's training
step on demonstrations (:mod:`rl_core.training.sft`); run directory, resume, MLflow run and
summary are the GRPO flow's (:class:`flows.run.Run`). docs/sft.md.
"""

from __future__ import annotations

from typing import Any, Literal

from flows._redacted import redacted_flow
from flows.run import Run
from rl_core.sft import TINY_INIT, load_sft_config
from rl_core.sft_images import check_vision_model
from rl_core.training.sft import SFTHandle, close_session, get_session
from tasks.setup import PreparedData, fetch_model
from tasks.sft import (
    bare_tiny_model,
    evaluate_sft,
    export_sft_model,
    prepare_sft_data,
    restore_sft_checkpoint,
    save_sft_checkpoint,
    start_sft,
    train_steps,
)
from tasks.tracking import finish_tracking, start_tracking

__all__ = ["SFTRun", "sft_train"]


@redacted_flow(name="sft-train", log_prints=False, on_failure=[Run.failed],
               on_crashed=[Run.failed])
def sft_train(
    config: str | None = None,
    overrides: list[str] | None = None,
    show_progress: bool = True,
    resume: Literal["auto", "always", "never"] = "auto",
) -> dict[str, Any]:
    """Fine-tune ``model.path`` on the demonstrations of ``data`` as configured by ``config``
    (an SFT YAML, e.g. configs/sft-tiny-cpu.yaml) and ``overrides``; ``resume`` as for
    ``grpo_train`` (auto: from the run directory's latest complete checkpoint, if any)."""
    run = Run.open(config, overrides, resume, show_progress, load=load_sft_config)
    cfg = run.cfg
    model_path = (bare_tiny_model(cfg.model, cfg.data, cfg.storage.cache_dir)
                  if cfg.model.path == TINY_INIT
                  else fetch_model(cfg.model, cfg.data.grpo_data(), cfg.storage.cache_dir))
    check_vision_model(model_path, cfg.data.image_field)  # images on a text model: refused now
    data = prepare_sft_data(cfg.data, cfg.storage.cache_dir, model_path, cfg.model,
                            cfg.train.num_threads)  # model first: data.teacher renders with it
    tracking = start_tracking(cfg, str(run.dir.path), resume_from=run.resume_from)
    model_dir, evals, _ = run.train(SFTRun(cfg, model_path, data, run.ckpt_root), tracking)
    registered = finish_tracking(tracking, model_dir=model_dir, eval_result=Run.brief(evals[-1]))
    return run.finish(model_dir, data, evals, registered, 0, kind="SFT")


class SFTRun:
    """SFT as :meth:`flows.run.Run.train` drives it: the session (model, optimizer, sampler)
    in this process, ``train.steps_per_task`` steps per task run; the last evaluation here."""

    kind, last_eval_here, tokenizer = "SFT", True, None

    def __init__(self, cfg: Any, model_path: str, data: PreparedData, ckpt_root: str) -> None:  # noqa: ANN401
        self.cfg, self.model_path, self.data, self.root = cfg, model_path, data, ckpt_root
        self.session: SFTHandle | None = None

    def start(self, checkpoint: str | None) -> int:
        self.session = start_sft(self.cfg, self.model_path, self.data)
        self.tokenizer = get_session(self.session).tokenizer
        if checkpoint is None:
            return 0
        return restore_sft_checkpoint(self.session, checkpoint, self.data.train_digest)

    def steps(self, first: int, stop: int) -> list[tuple[dict[str, float], None]]:
        last = min(stop, first + self.cfg.train.steps_per_task - 1)
        done = train_steps(self.session, first, last, self.cfg.train.step_timeout_s)
        return [(metrics, None) for metrics in done]

    def checkpoint(self, step: int, run_id: str | None, final: bool) -> dict[str, float]:
        return save_sft_checkpoint(self.session, self.root, step, self.data.train_digest, run_id)

    def evaluate(self, step: int) -> dict[str, Any]:
        return evaluate_sft(self.session, step)

    def export(self, out_dir: str) -> str:
        return export_sft_model(self.session, out_dir)

    def close(self) -> None:  # the model and optimizer go
        if self.session is not None:
            close_session(self.session)
            self.session = None
