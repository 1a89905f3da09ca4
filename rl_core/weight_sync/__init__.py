"""Weight sync: the trainer's weights to the rollout plane, versioned and verified.

Every update (each step, a resume, a restarted engine's re-broadcast) is one call of
:func:`sync_weights`: stage (checksum taken) -> pause, abort, flush -> load -> verify (version
and checksum on every engine) -> bump the plane's version (the only place) -> resume, always.
A sync that does not deliver the trainer's weights fails loudly (docs/architecture.md, "The
weight-update sequence"; docs/reliability.md). Transports: :mod:`.transports`,
:mod:`.broadcast`; trainer side: :mod:`.source`; checksum: :mod:`.checksum`.
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
    """The version an engine's label (``meta_info.weight_version``) names; the initial
    ``default`` (any non-number) is the base model, version 0."""
    text = str(label) if label is not None else ""
    return int(text) if text.isdigit() else 0
