"""Prefect tasks of the SFT flow (``flows/sft.py``): thin, timed calls into :mod:`rl_core.sft`
and :mod:`rl_core.training.sft`, retried where safe. Prepared data is keyed by its inputs'
digest; the model and optimizer stay in the flow's process behind an
:class:`~rl_core.training.sft.SFTHandle`. ``train-steps`` never retries (no optimizer step twice).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rl_core.base_model import build_bare_tiny
from rl_core.config import ModelConfig
from rl_core.planes import sample_teacher_examples
from rl_core.report import eval_markdown
from rl_core.sft import Example, SFTConfig, SFTDataConfig, examples_digest, split_examples
from rl_core.training.sft import (
    SFTHandle,
    get_session,
    start_session,
)
from tasks.evaluate import artifact_key
from tasks.setup import PreparedData, cached_snapshot, source_fingerprint

__all__ = ["bare_tiny_model", "evaluate_sft", "export_sft_model",
           "prepare_sft_data", "restore_sft_checkpoint", "save_sft_checkpoint", "start_sft",
           "train_steps"]


def _data_key(data: SFTDataConfig, student: str | None = None,
              model: ModelConfig | None = None) -> str:
    folder = data.image_field is not None  # rows name image files beside the data file
    inputs: dict[str, Any] = {"config": data.model_dump(mode="json"),
                              "source": source_fingerprint(data.source, folder),
                              "eval_source": source_fingerprint(data.eval_source or data.source,
                                                                folder)}
    if data.teacher.path is not None:  # the teacher's weights, and the prompts it is given
        inputs["teacher"] = source_fingerprint(data.teacher.path)
        inputs["student_tokenizer"] = _tokenizer_fingerprint(student)
        inputs["dtype"] = (model or ModelConfig()).dtype
    blob = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tokenizer_fingerprint(model_dir: str | None) -> str:
    """sha256 of the tokenizer's files in ``model_dir`` (what renders the prompts)."""
    if model_dir is None:
        raise ValueError("data.teacher.path is set, but no student model was given to render "
                         "the prompts with")
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens",
                                               "chat_template", "added_tokens")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _write(examples: list[Example], path: Path) -> str:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(e.to_json() + "\n" for e in examples), encoding="utf-8")
    os.replace(tmp, path)
    return examples_digest(examples)


def read_prepared(path: str) -> list[Example]:
    """The examples :func:`prepare_sft_data` wrote."""
    return [Example.from_json(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()]


def _transient(task: object, task_run: object, state: object) -> bool:
    """Retry what may pass the next time (a network read, S3), not bad rows or a bad config
    (ValueError: DataValidationError, ConfigError): those fail the same way again."""
    failure = state.result(raise_on_failure=False)  # type: ignore[attr-defined]
    return not isinstance(failure, ValueError)


@task(name="prepare-sft-data", timeout_seconds=1800, retries=2, retry_delay_seconds=5,
      retry_condition_fn=_transient)
def prepare_sft_data(data: SFTDataConfig, cache_dir: str, student: str | None = None,
                     model: ModelConfig | None = None,
                     num_threads: int | None = None) -> PreparedData:
    """Any supported source -> validated example snapshots with content digests. With
    ``data.teacher.path``, the training rows' completions are the teacher's samples for
    their prompts, rendered with ``student``'s tokenizer (``model``: its dtype; the counts go
    to ``teacher.json`` beside the snapshot); the held-out rows keep their references."""

    def build(out: Path) -> PreparedData:
        train, held = split_examples(data, cache_dir)
        if data.teacher.path is not None:
            assert student is not None  # _data_key refused it
            train, counts = sample_teacher_examples(train, data, student, cache_dir, out,
                                                    model=model, num_threads=num_threads)
            (out / "teacher.json").write_text(json.dumps(counts, indent=2))
            get_run_logger().info(
                "data: %d of %d teacher samples kept (%d cut at max_new_tokens, %d empty, "
                "%d correct) from %s in %.1fs", counts["kept"], counts["samples"],
                counts["truncated"], counts["empty"], counts["correct"], data.teacher.path,
                counts["seconds"])
        return PreparedData(
            str(out / "train.jsonl"), str(out / "eval.jsonl"), _write(train, out / "train.jsonl"),
            _write(held, out / "eval.jsonl"), len(train), len(held), data.source, cached=False)

    return cached_snapshot(Path(cache_dir) / "sft-data" / _data_key(data, student, model), build,
                           "SFT")


@task(name="build-bare-model", timeout_seconds=1800, retries=1)
def bare_tiny_model(model: ModelConfig, data: SFTDataConfig, cache_dir: str) -> str:
    """``embedded:tiny-init``: the demo's tiny model before any training (built once, cached)."""
    path = build_bare_tiny(model, data, cache_dir)
    get_run_logger().info("model: bare tiny model (random weights) in %s", path)
    return str(path)


@task(name="start-sft", timeout_seconds=1800, cache_policy=NO_CACHE)
def start_sft(cfg: SFTConfig, model_path: str, data: PreparedData) -> SFTHandle:
    """Load the model, tokenize both sets, place the sampler at the start."""
    handle = start_session(cfg, model_path, read_prepared(data.train_path),
                           read_prepared(data.eval_path))
    s = get_session(handle)
    tokens = sum(e.tokens for e in s.train)
    get_run_logger().info(
        "SFT: %d train / %d held-out examples (%d trained tokens, %.1f per example) on %s, "
        "%s parameters trained", len(s.train), len(s.eval), tokens, tokens / len(s.train),
        s.trainer.device, f"{sum(p.numel() for p in s.trainer._trained()):,}")
    return handle


@task(name="train-steps", task_run_name="train-steps-{first}-{last}", timeout_seconds=3600,
      cache_policy=NO_CACHE)
def _train_steps(handle: SFTHandle, first: int, last: int) -> list[dict[str, float]]:
    return get_session(handle).train_steps(first, last)


def train_steps(handle: SFTHandle, first: int, last: int,
                step_timeout_s: float) -> list[dict[str, float]]:
    """Optimizer steps ``first..last`` as one task run, bounded by ``step_timeout_s`` per step
    (``train.step_timeout_s``); never retried: a step is applied once."""
    bound = _train_steps.with_options(timeout_seconds=step_timeout_s * (last - first + 1))
    return bound(handle, first, last)


@task(name="evaluate", task_run_name="evaluate-step-{step}", timeout_seconds=1800, retries=1,
      retry_delay_seconds=5, cache_policy=NO_CACHE)
def evaluate_sft(handle: SFTHandle, step: int) -> dict[str, Any]:
    """Held-out loss, and greedy accuracy where the references end in a number."""
    s = get_session(handle)
    result = s.evaluate(step)
    create_markdown_artifact(markdown=eval_markdown(result, f"{s.config.name}: SFT evaluation "
                                                    f"at step {step}"),
                             key=artifact_key("eval", s.config.name),
                             description=f"held-out evaluation at step {step}")
    return result


@task(name="checkpoint", task_run_name="checkpoint-step-{step}", timeout_seconds=1800, retries=2,
      retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def save_sft_checkpoint(handle: SFTHandle, root: str, step: int, train_digest: str,
                        tracking_run_id: str | None = None) -> dict[str, float]:
    """A complete checkpoint of ``step`` (idempotent: a re-run replaces it)."""
    started = time.perf_counter()
    get_session(handle).save(root, step, train_digest, tracking_run_id)
    return {"time/checkpoint": time.perf_counter() - started}


@task(name="restore-checkpoint", timeout_seconds=1800, cache_policy=NO_CACHE)
def restore_sft_checkpoint(handle: SFTHandle, path: str, train_digest: str) -> int:
    """Load a verified checkpoint; the step it was written at."""
    step = get_session(handle).restore(path, train_digest)
    get_run_logger().info("resumed from %s at step %d", path, step)
    return step


@task(name="export-model", timeout_seconds=1800, retries=1, cache_policy=NO_CACHE)
def export_sft_model(handle: SFTHandle, out_dir: str) -> str:
    """The model and its tokenizer in Hugging Face format (``grpo_train``'s ``model.path``)."""
    return get_session(handle).export(out_dir)
