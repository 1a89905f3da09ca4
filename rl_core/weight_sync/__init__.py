"""Weight sync: the trainer's weights to the rollout plane, versioned and verified.

Every caller (each GRPO step, a resume, a restarted engine's re-broadcast) moves weights
through :func:`sync_weights`, the one sequence::

    stage (the trainer writes, puts or prepares them; the checksum is taken there)
    -> pause every engine, abort what is in flight, flush the cache
    -> load (the transport: disk, object store, broadcast, in-process tensors)
    -> verify (every engine reports the new weight_version and the trainer's checksum)
    -> weight_version = version  (the one place the plane's version changes)
    -> resume (always, also when a step above failed)

Silent non-sync is the most common weight-sync bug in RL frameworks: a sync that does not
deliver the trainer's weights fails loudly here, and a sample made by any other version is
refused by the plane. The transports live in :mod:`.transports` and :mod:`.broadcast`, the
trainer side in :mod:`.source`, the checksum in :mod:`.checksum`.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import time
from typing import Any

from rl_core.weight_sync.checksum import WeightSyncError, weights_checksum

__all__ = ["WeightSyncError", "served_version", "sync_weights", "weights_checksum"]


def sync_weights(trainer: Any, plane: Any, transport: Any, version: int) -> dict[str, float]:
    """Move ``plane`` to ``trainer``'s weights as ``version`` (the sequence above)."""
    t0 = time.perf_counter()
    staged = transport.stage(trainer, version)
    t1 = time.perf_counter()
    with plane.paused() as engines:
        transport.load(staged, engines, version)
        plane.verify(version, staged.checksum)
        plane.weight_version = version
    done = time.perf_counter()
    return {"sync_seconds": done - t0, "sync_stage_seconds": t1 - t0,
            "sync_paused_seconds": done - t1, "sync_bytes": float(staged.nbytes)}


def served_version(label: object) -> int:
    """The weight version an engine's label names (``meta_info.weight_version``): the
    engines' initial label (``default``) is the base model they were started on, version 0
    (a restarted engine is re-synced before it serves)."""
    text = str(label) if label is not None else ""
    return int(text) if text.isdigit() else 0
