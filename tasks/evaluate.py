"""Tasks that measure and export the policy: held-out evaluation, final model export, and a
registered PEFT adapter (a Tinker tenant's sampler weights) made a model to evaluate."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rl_core.evaluation import evaluate
from rl_core.models.vlm import copy_processor
from rl_core.planes import PlanesHandle, get_planes
from rl_core.report import eval_markdown

__all__ = ["ADAPTER_CONFIG", "AdapterMismatch", "adapter_version", "artifact_key", "evaluate_policy",
           "export_model", "fetch_adapter_version"]

ADAPTER_CONFIG = "adapter_config.json"


@task(name="evaluate", task_run_name="evaluate-step-{step}", timeout_seconds=1800, retries=1,
      retry_delay_seconds=5, cache_policy=NO_CACHE)
def evaluate_policy(planes: PlanesHandle, step: int) -> dict:
    """Greedy pass@1 and sampled pass@k of the rollout plane's current weights, scored by
    the run's reward function."""
    p = get_planes(planes)
    cfg = p.config
    e = cfg.eval
    result = evaluate(p.rollout, p.eval_records, p.eval_prompts, p.reward_runner,
                      max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens, k=e.pass_k,
                      k_examples=e.pass_k_examples, temperature=e.temperature, seed=cfg.seed,
                      kind=p.kind, pass_threshold=cfg.reward.pass_threshold)
    out = {"step": step, "weight_version": p.weight_version, **result.to_dict()}
    create_markdown_artifact(markdown=eval_markdown(out, f"{cfg.name}: evaluation at step {step}"),
                             key=artifact_key("eval", cfg.name),
                             description=f"held-out evaluation at step {step}")
    return out


def artifact_key(kind: str, name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return f"{kind}-{slug}"[:64]


@task(name="export-model", timeout_seconds=1800, retries=1, cache_policy=NO_CACHE)
def export_model(planes: PlanesHandle, out_dir: str) -> str:
    """Write the trained policy and its tokenizer in Hugging Face format."""
    p = get_planes(planes)
    path = p.trainer.save_pretrained(out_dir)
    p.tokenizer.save_pretrained(path)
    if (source := getattr(p.trainer, "model_path", None)) is not None:  # a VLM's processor
        copy_processor(source, path)
    return str(Path(path))


def adapter_version(client: Any, source: str) -> bool:  # noqa: ANN401 - an MlflowClient
    """Whether a model version's ``source`` is a PEFT adapter directory logged on a run
    (``runs:/<run>/<path>`` holding ``adapter_config.json``: a Tinker tenant's sampler
    weights, grpoflow.tinker.lineage) rather than a logged model."""
    if not source.startswith("runs:/"):
        return False
    run_id, _, path = source.removeprefix("runs:/").partition("/")
    return any(Path(a.path).name == ADAPTER_CONFIG for a in client.list_artifacts(run_id, path))


class AdapterMismatch(ValueError):
    """A registered adapter that does not fit the evaluation's base model (not retried)."""


def _retry_unless_mismatch(task: Any, task_run: Any, state: Any) -> bool:  # noqa: ANN401
    return not isinstance(state.result(raise_on_failure=False), AdapterMismatch)


@task(name="fetch-adapter-version", task_run_name="fetch-{name}-v{version}",
      timeout_seconds=1800, retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE,
      retry_condition_fn=_retry_unless_mismatch)
def fetch_adapter_version(tracking_uri: str, name: str, version: str, source: str,
                          base_dir: str, cache_dir: str) -> str:
    """Registered adapter ``name`` v``version`` merged onto the base model in ``base_dir``
    (the evaluation config's ``model.path``) as a local Hugging Face directory, cached per
    version and base."""
    import mlflow
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tag = hashlib.sha256(str(Path(base_dir).resolve()).encode()).hexdigest()[:8]
    target = Path(cache_dir) / "registry" / name / f"v{version}-on-{tag}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return str(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    download = tmp.with_name(tmp.name + "-adapter")
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    adapter = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(download),
                                                       tracking_uri=tracking_uri))
    try:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        try:
            merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        except (RuntimeError, ValueError, KeyError) as exc:
            raise AdapterMismatch(
                f"{name} v{version} ({source}) is a LoRA adapter that does not fit the base "
                f"model {base_dir} (the evaluation config's model.path: set it to the base the "
                f"adapter was trained on): {exc}") from exc
        # the base's tokenizer, generation config and metadata, then the merged weights
        shutil.copytree(base_dir, tmp, ignore=shutil.ignore_patterns(
            "*.safetensors", "*.bin", "*.index.json", ".complete"))
        merged.save_pretrained(tmp, safe_serialization=True)
        shutil.copytree(adapter, tmp / "adapter")  # what was merged, for the record
    finally:
        shutil.rmtree(download, ignore_errors=True)
    (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
    shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier fetch
    tmp.rename(target)
    return str(target)
