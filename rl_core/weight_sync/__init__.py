"""Weight sync: the trainer's weights to the rollout plane, versioned and verified.

Every update (each step, a resume, a restarted engine's re-broadcast) is one call of
:func:`sync_weights`: stage (checksum taken) -> hold new generation -> pause, abort, flush ->
load -> verify (version and checksum on every engine) -> resume -> probe (each engine's
behaviour against the trainer's, :mod:`.probe`) -> bump the plane's version (the only place)
-> let generation go on. A probe that fails reloads once, then rebuilds the failing engines; a
sync that does not deliver the trainer's weights fails loudly and generation stays held
(docs/weight-sync.md; docs/reliability.md). Transports: :mod:`.transports`, :mod:`.broadcast`;
trainer side: :mod:`.source`; checksum: :mod:`.checksum`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from rl_core.weight_sync.checksum import WeightSyncError, weights_checksum
from rl_core.weight_sync.probe import ProbeMismatch, WeightProbe

__all__ = ["WeightSyncError", "served_version", "sync_weights", "weights_checksum"]

log = logging.getLogger(__name__)


def sync_weights(trainer: Any, plane: Any, transport: Any, version: int,
                 probe: WeightProbe | None = None) -> dict[str, float]:
    """Move ``plane`` to ``trainer``'s weights as ``version`` (the sequence above)."""
    t0 = time.perf_counter()
    staged = transport.stage(trainer, version)
    t1 = time.perf_counter()
    metrics: dict[str, float] = {}
    holding = getattr(plane, "updating", contextlib.nullcontext)
    with holding():
        for load in (1, 2):
            with plane.paused() as engines:
                transport.load(staged, engines, version)
                plane.verify(version, staged.checksum)
            if probe is None:
                break
            try:
                metrics = probe.check(trainer, plane, version)
                break
            except ProbeMismatch as e:
                log.error("%s (load %d of 2)", e, load)
                if load == 2:  # reloaded and still wrong: those engines start afresh
                    plane.weight_version = version  # what a rebuilt engine is brought to
                    plane.rebuild(e.engines)
                    metrics = probe.check(trainer, plane, version)
                    metrics["sync/probe_rebuilt_engines"] = float(len(e.engines))
        if probe is not None:
            metrics["sync/probe_reloads"] = float(load - 1)
        plane.weight_version = version
    done = time.perf_counter()
    return {"sync_seconds": done - t0, "sync_stage_seconds": t1 - t0,
            "sync_paused_seconds": done - t1, "sync_bytes": float(staged.nbytes),
            **staged.metrics, **metrics}


def served_version(label: object) -> int:
    """The version an engine's label (``meta_info.weight_version``) names; the initial
    ``default`` (any non-number) is the base model, version 0."""
    text = str(label) if label is not None else ""
    return int(text) if text.isdigit() else 0
