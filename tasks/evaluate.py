"""Tasks that measure and export the policy: held-out evaluation, final model export."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from rl_core.evaluation import evaluate
from rl_core.models.vlm import copy_processor
from rl_core.planes import PlanesHandle, get_planes
from rl_core.report import eval_markdown

__all__ = ["artifact_key", "evaluate_policy", "export_model"]


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
