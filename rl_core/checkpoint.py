"""Checkpoints that are complete or invisible: written aside, committed by a manifest last.

Layout of one checkpoint (``<dir>/step-000020/``)::

    model/              the policy in HF format (safetensors, tokenizer): transformers and
                        SGLang load it as is
    trainer_state.pt    optimizer, LR scheduler, optimizer-step counter
    rng.pt              python, numpy and torch RNG states
    state.json          step, weight_version, data-sampler state, tracking run id, digests
    MANIFEST.json       written last: every file with its size and SHA-256

Everything is written into ``step-000020.partial-<nonce>/`` first; the manifest is written
last and the directory is then renamed into place, so a crash at any point leaves either
nothing or a partial directory that :func:`latest_checkpoint` never returns. The last
``keep_last`` complete checkpoints are kept.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "CheckpointState",
    "capture_rng",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint_state",
    "restore_rng",
    "verify_checkpoint",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or trusted; the message names the directory."""


@dataclass
class CheckpointState:
    """The small, JSON-able part of a checkpoint: where the run stands."""

    step: int
    weight_version: int
    sampler: dict[str, int]
    config_digest: str
    train_digest: str = ""
    tracking_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch RNG states (what a resumed run must continue from)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def write_checkpoint(
    root: str | Path,
    state: CheckpointState,
    write_payload: Callable[[Path], None],
    *,
    keep_last: int = 2,
) -> Path:
    """Write a checkpoint for ``state.step`` under ``root`` and commit it atomically.

    ``write_payload(tmp_dir)`` writes the heavy files (model, trainer state) into the
    temporary directory; this function adds the RNG and run state, the manifest last, then
    renames the directory into place and prunes old checkpoints.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(state.step)
    tmp = root / f"{final.name}.partial-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    tmp.mkdir()
    try:
        write_payload(tmp)
        torch.save(capture_rng(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
        files = {
            str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        manifest = {"step": state.step, "created": time.time(), "files": files}
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a re-run of the same step after a crash: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "checkpoint step %d -> %s (%.1f MB, %.2fs)",
        state.step,
        final,
        sum(f["bytes"] for f in files.values()) / 1e6,
        time.perf_counter() - started,
    )
    prune(root, keep_last)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint, or None. Partial directories are never returned."""
    done = list_checkpoints(root)
    return done[-1] if done else None


def prune(root: str | Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop stale partial directories."""
    done = list_checkpoints(root)
    for p in done[: max(0, len(done) - keep_last)]:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).glob("step-*.partial-*"):
        shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({exc})") from exc
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file() or f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match the manifest; not resuming")
    return manifest


def load_checkpoint_state(path: str | Path) -> tuple[CheckpointState, dict[str, Any]]:
    """The run state and RNG states of a verified checkpoint."""
    path = Path(path)
    verify_checkpoint(path)
    state = CheckpointState(**json.loads((path / "state.json").read_text()))
    rng = torch.load(path / "rng.pt", weights_only=False)
    return state, rng
