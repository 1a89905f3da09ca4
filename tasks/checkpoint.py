"""Tasks that save and restore a run: periodic checkpoints and resume. A checkpoint holds all a
resumed run needs to continue as if never stopped: weights, optimizer, LR schedule, RNG states,
sampler position, step, weight version, and the rollouts generated ahead (``rollouts.json``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rl_core.checkpoint import CheckpointState, restore_training, save_training
from rl_core.config import config_digest
from rl_core.planes import PlanesHandle, get_planes

__all__ = ["ROLLOUT_BUFFER", "restore_checkpoint", "save_checkpoint"]

ROLLOUT_BUFFER = "rollouts.json"  # the samples generated ahead (flows.schedule.Schedule.buffer)


@task(name="checkpoint", task_run_name="checkpoint-step-{step}", timeout_seconds=1800, retries=2,
      retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def save_checkpoint(planes: PlanesHandle, root: str, step: int, sampler_state: dict[str, Any],
                    train_digest: str, tracking_run_id: str | None = None,
                    rollout_buffer: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Write a complete checkpoint for ``step`` (idempotent: a re-run replaces it)."""
    p = get_planes(planes)
    started = time.perf_counter()

    def ahead(tmp: Path) -> None:
        if rollout_buffer:
            (tmp / ROLLOUT_BUFFER).write_text(json.dumps(rollout_buffer, allow_nan=True))

    state = CheckpointState(step=step, weight_version=p.weight_version, sampler=sampler_state,
                            config_digest=config_digest(p.config), train_digest=train_digest,
                            tracking_run_id=tracking_run_id)
    save_training(root, p.trainer, p.tokenizer, state, keep_last=p.config.checkpoint.keep_last,
                  cache_dir=p.config.storage.cache_dir, extra=ahead)
    return {"time/checkpoint": time.perf_counter() - started}


@task(name="restore-checkpoint", timeout_seconds=1800, cache_policy=NO_CACHE)
def restore_checkpoint(planes: PlanesHandle, path: str, train_digest: str
                       ) -> tuple[CheckpointState, list[dict[str, Any]]]:
    """Load a verified checkpoint into the planes (the engines synced to its weights); returns
    where the run stands and the rollouts it had generated ahead (empty when none)."""
    p = get_planes(planes)
    state, local = restore_training(
        path, p.trainer, config_digest=config_digest(p.config), train_digest=train_digest,
        cache_dir=p.config.storage.cache_dir,
        after_load=lambda s: p.sync_weights(s.weight_version))
    buffer = local / ROLLOUT_BUFFER
    rows = json.loads(buffer.read_text()) if buffer.is_file() else []
    get_run_logger().info("resumed from %s at step %d", path, state.step)
    return state, rows
