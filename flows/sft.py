"""The SFT flow: supervised fine-tuning whose exported model ``grpo_train`` takes as is.

    fetch model -> prepare data (data.teacher: the teacher's samples) -> start trainer
    -> (resume) -> evaluate -> repeat: train a chunk of steps (every k: checkpoint, evaluate)
    -> checkpoint -> export model -> final evaluation -> register the model

Verbs are Prefect tasks (``tasks/sft.py``, ``tasks/tracking``), the math is
:mod:`rl_core.training.sft`; run directory, resume and MLflow run are the GRPO flow's
(:class:`flows.run.Run`). GRPO and the scheduled evaluation take it from there (docs/sft.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Literal

from prefect.settings import get_current_settings

from flows._redacted import redacted_flow
from flows.run import Run, yield_cpu_to_the_step
from rl_core import storage
from rl_core.sft import TINY_INIT, SFTConfig, load_sft_config
from rl_core.training.sft import SFTHandle, close_session
from tasks.setup import fetch_model
from tasks.sft import (
    PreparedData,
    bare_tiny_model,
    evaluate_sft,
    export_sft_model,
    prepare_sft_data,
    restore_sft_checkpoint,
    save_sft_checkpoint,
    start_sft,
    train_steps,
)
from tasks.tracking import finish_tracking, log_checkpoint, log_evaluation, log_step, start_tracking

__all__ = ["format_sft_eval", "format_sft_step", "sft_train"]


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
    cfg = load_sft_config(config, overrides or [])
    if cfg.storage.s3_endpoint_url:  # for boto3 and MLflow's artifact store
        os.environ.update(storage.s3_env(cfg.storage.s3_endpoint_url))
    if get_current_settings().api.url is None:
        yield_cpu_to_the_step()
    run = Run(cfg, resume, show_progress)
    model_path = (bare_tiny_model(cfg.model, cfg.data, cfg.storage.cache_dir)
                  if cfg.model.path == TINY_INIT
                  else fetch_model(cfg.model, cfg.data.grpo_data(), cfg.storage.cache_dir))
    data = prepare_sft_data(cfg.data, cfg.storage.cache_dir, model_path, cfg.model,
                            cfg.train.num_threads)  # model first: data.teacher renders with it
    tracking = start_tracking(cfg, str(run.dir.path), resume_from=run.resume_from)
    session = start_sft(cfg, model_path, data)
    try:
        step = _resume(run, session, data)
        evals = run.dir.read_evals() or [_evaluate(run, session, step, tracking)]
        while step < cfg.train.steps:
            last = _chunk_end(cfg, step)
            done = train_steps(session, step + 1, last, cfg.train.step_timeout_s)
            for n, metrics in enumerate(done, start=step + 1):
                run.record_step(n, metrics, None, tracking, None,
                                line=format_sft_step(n, cfg.train.steps, metrics))
            step = last
            if _due(cfg.checkpoint.every, step):
                save_sft_checkpoint(session, run.ckpt_root, step, data.train_digest,
                                    tracking and tracking.run_id)
                log_checkpoint(tracking, step, run.ckpt_root)
            if _due(cfg.eval.every, step) and step != cfg.train.steps:
                evals.append(_evaluate(run, session, step, tracking))
        run.close_progress()
        if not _due(cfg.checkpoint.every, cfg.train.steps):
            save_sft_checkpoint(session, run.ckpt_root, cfg.train.steps, data.train_digest,
                                tracking and tracking.run_id)
            log_checkpoint(tracking, cfg.train.steps, run.ckpt_root)
        model_dir = export_sft_model(session, str(run.dir.model_dir))
        if evals[-1]["step"] != cfg.train.steps:
            evals.append(_evaluate(run, session, cfg.train.steps, tracking))
    finally:  # a failure, Ctrl-C or SIGTERM included: the model and optimizer go
        close_session(session)
    registered = finish_tracking(tracking, model_dir=model_dir, eval_result=Run.brief(evals[-1]))
    return _finish(run, cfg, model_dir, data, evals, registered)


def _due(every: int, step: int) -> bool:
    return bool(every) and step % every == 0


def _chunk_end(cfg: SFTConfig, step: int) -> int:
    """The last step of the next task run: ``train.steps_per_task`` on, or the next step at
    which an evaluation or a checkpoint falls, or the end."""
    last = min(cfg.train.steps, step + cfg.train.steps_per_task)
    for every in (cfg.eval.every, cfg.checkpoint.every):
        if every:
            last = min(last, (step // every + 1) * every)
    return last


def _resume(run: Run, session: SFTHandle, data: PreparedData) -> int:
    """The step the run stands at: 0, or the checkpoint's (restored into the session)."""
    if run.resume_from is None:
        run.dir.truncate_after(-1)  # a fresh start: fresh logs
        return 0
    step = restore_sft_checkpoint(session, run.resume_from, data.train_digest)
    run.dir.truncate_after(step)
    run.resumed_from_step = step
    run.say(f"resumed from {run.resume_from}; continuing at step {step + 1}")
    return step


def _evaluate(run: Run, session: SFTHandle, step: int, tracking: Any) -> dict[str, Any]:
    result = evaluate_sft(session, step)
    run.dir.log_eval(result)
    run.say(format_sft_eval(result))
    log_step(tracking, step, {"eval/loss": result["loss"]})
    log_evaluation(tracking, step, result)
    return result


def format_sft_step(step: int, total: int, m: Mapping[str, float]) -> str:
    """``step  12/300 | loss 2.345 | lr 1.0e-03 | grad 1.23 | 554 tok | 2042 tok/s | 0.55s``"""
    return (f"step {step:>{len(str(total))}}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.1e} "
            f"| grad {m['grad_norm']:.2f} | {m['tokens']:.0f} tok | pad {m['pad_fraction']:.2f} "
            f"| {m['tokens_per_s']:.0f} tok/s | {m['time/train']:.2f}s")


def format_sft_eval(r: Mapping[str, Any]) -> str:
    """``eval @ step 100: loss 0.8123 | greedy accuracy 0.420 (n=100) | len 12.3``"""
    line = f"eval @ step {r['step']}: loss {r['loss']:.4f} (n={r['num_examples']})"
    if r.get("pass_at_1") is not None:
        line += (f" | greedy accuracy {r['pass_at_1']:.3f} (n={r['accuracy_examples']}) | "
                 f"len {r['response_len_mean']:.1f} | trunc {r['truncation_rate']:.3f}")
    return line


def _finish(run: Run, cfg: SFTConfig, model_dir: str, data: PreparedData,
            evals: list[dict[str, Any]], registered: Any) -> dict[str, Any]:  # noqa: ANN401
    """The run's summary: written to ``summary.json``, printed, returned by the flow."""
    first, last = Run.brief(evals[0]), Run.brief(evals[-1])
    summary = {
        "run_name": run.dir.name, "run_dir": str(run.dir.path), "model_dir": model_dir,
        "metrics_path": str(run.dir.metrics_path), "checkpoint_dir": run.ckpt_root,
        "steps": cfg.train.steps, "resumed_from_step": run.resumed_from_step,
        "seconds": time.perf_counter() - run.started_at,
        "data": {"train_digest": data.train_digest, "eval_digest": data.eval_digest,
                 "num_train": data.num_train, "num_eval": data.num_eval},
        "first_eval": first, "last_eval": last, "evals": [Run.brief(e) for e in evals],
        "tracking": registered,
    }
    run.dir.write_summary(summary)
    lines = ["", "=" * 72,
             f"run {run.dir.name} finished {cfg.train.steps} SFT steps in "
             f"{summary['seconds']:.0f}s",
             f"held-out loss: {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
             f"(step {last['step']})"]
    if first.get("pass_at_1") is not None and last.get("pass_at_1") is not None:
        lines.append(f"held-out greedy accuracy: {first['pass_at_1']:.3f} -> "
                     f"{last['pass_at_1']:.3f} (n={last['accuracy_examples']})")
    lines += [f"run directory:  {run.dir.path}",
              f"final model:    {model_dir} (Hugging Face format)",
              f"then GRPO:      grpoflow train <GRPO config> model.path={model_dir}",
              "=" * 72]
    run.say("\n".join(lines))
    return summary
