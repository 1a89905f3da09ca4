"""Checkpoints that are complete or invisible: written aside, committed by a manifest last.

Each is written into ``step-NNNNNN.partial-<nonce>/``, ``MANIFEST.json`` last, then renamed
into place: a crash leaves nothing :func:`latest_checkpoint` returns; the last ``keep_last``
are kept. An ``s3://`` root is staged locally, then uploaded manifest last (a prefix without a
manifest is never loaded); :func:`fetch_checkpoint` verifies every SHA-256 and reuses the cached
copy (layout and S3 rules: docs/storage.md). Never imports Prefect or MLflow; never logs or
raises a message that was not redacted.
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

from rl_core import storage
from rl_core.secrets import RedactFilter, redact

__all__ = [
    "CheckpointError", "CheckpointState", "capture_rng", "fetch_checkpoint", "latest_checkpoint",
    "list_checkpoints", "load_checkpoint_state", "prune", "restore_rng", "restore_training",
    "save_training", "verify_checkpoint", "write_checkpoint",
]

log = logging.getLogger(__name__)
log.addFilter(RedactFilter())

MANIFEST = storage.MANIFEST
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or trusted; the message names the directory."""


@dataclass
class CheckpointState:
    """The small, JSON-able part of a checkpoint: where the run stands."""

    step: int
    weight_version: int
    sampler: dict[str, Any]  # the sampler position and the prompt batches drawn ahead
    config_digest: str
    train_digest: str = ""
    tracking_run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch RNG states (what a resumed run must continue from)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def write_checkpoint(root: str | Path, state: CheckpointState,
                     write_payload: Callable[[Path], None], *, keep_last: int = 2,
                     cache_dir: str | Path | None = None) -> Path | str:
    """Write a checkpoint for ``state.step`` under ``root`` and commit it atomically:
    ``write_payload(tmp_dir)`` writes the heavy files, this the RNG and run state and the manifest
    last, then renames and prunes. Returns the directory, or for an S3 root its URI (staged under
    ``<cache_dir>/checkpoints/``, kept as the cache)."""
    if storage.is_remote(root):
        return _write_remote(str(root), state, write_payload, keep_last, cache_dir)
    final, _ = _commit_local(Path(root), state, write_payload)
    prune(root, keep_last)
    return final


def _commit_local(root: Path, state: CheckpointState, write_payload: Callable[[Path], None],
                  label: str = "checkpoint") -> tuple[Path, dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(state.step)
    started = time.perf_counter()
    (tmp := root / f"{final.name}.partial-{uuid.uuid4().hex[:8]}").mkdir()
    try:
        write_payload(tmp)
        torch.save(capture_rng(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
        manifest = {"step": state.step, **storage.build_manifest(tmp)}
        with (tmp / MANIFEST).open("w") as f:  # synced: the rename below publishes it
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a re-run of the same step after a crash: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f["bytes"] for f in manifest["files"].values()) / 1e6
    log.info("%s step %d -> %s (%.1f MB, %.2fs)", label, state.step, final, size,
             time.perf_counter() - started)
    return final, manifest


def _cache_root(root: str, cache_dir: str | Path | None) -> Path:
    """``<cache_dir>/checkpoints/<digest of the root URI>``: one local copy per S3 root."""
    base = Path(cache_dir) if cache_dir is not None else storage.default_cache_dir()
    return base / "checkpoints" / hashlib.sha256(root.rstrip("/").encode()).hexdigest()[:16]


def _keep_only(cache_root: Path, name: str | None) -> None:
    """Drop every cached step of this root but ``name`` (one local copy is enough)."""
    for p in cache_root.glob("step-*"):
        if p.name != name:
            shutil.rmtree(p, ignore_errors=True)


def _storage_failure(root: str, exc: storage.StorageError) -> CheckpointError:
    return CheckpointError(redact(f"checkpoint.uri={root}: {exc}"))


def _write_remote(root: str, state: CheckpointState, write_payload: Callable[[Path], None],
                  keep_last: int, cache_dir: str | Path | None) -> str:
    cache_root = _cache_root(root, cache_dir)
    for stale in cache_root.glob("staging-*"):  # left by a writer that was killed
        shutil.rmtree(stale, ignore_errors=True)
    staging = cache_root / f"staging-{uuid.uuid4().hex[:8]}"
    target = storage.join(root, step_dir_name(state.step))
    try:
        local, manifest = _commit_local(staging, state, write_payload, "checkpoint (to upload)")
        # A re-run replaces the step, old manifest first: old and new never read as complete.
        storage.delete(storage.join(target, MANIFEST))
        storage.delete_prefix(target)
        storage.upload_dir(local, target, manifest=manifest)
        _keep_only(cache_root, None)
        os.replace(local, cache_root / local.name)
    except storage.StorageError as exc:
        raise _storage_failure(root, exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    prune(root, keep_last)
    return target


def _remote_steps(root: str) -> list[tuple[int, str, bool]]:
    """(step, URI, complete) of every ``step-*`` prefix under ``root``, oldest first."""
    steps = [(int(m.group(1)), storage.join(root, name)) for name in storage.list_dirs(root)
             if (m := _STEP_DIR.match(name))]
    return sorted((step, uri, storage.exists(storage.join(uri, MANIFEST))) for step, uri in steps)


def list_checkpoints(root: str | Path) -> list[Path] | list[str]:
    """Complete checkpoints (with a manifest) under ``root``, oldest first: Paths, or URIs in S3."""
    if storage.is_remote(root):
        try:
            return [uri for _, uri, complete in _remote_steps(str(root)) if complete]
        except storage.StorageError as exc:
            raise _storage_failure(str(root), exc) from None
    if not (root := Path(root)).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | str | None:
    """The newest complete checkpoint (with a manifest), or None; never a partial one or an
    interrupted upload. For an ``s3://`` root its URI: pass it to :func:`fetch_checkpoint`."""
    if not storage.is_remote(root):
        return done[-1] if (done := list_checkpoints(root)) else None
    root = str(root)
    try:
        names = [n for n in storage.list_dirs(root) if _STEP_DIR.match(n)]
        for name in sorted(names, key=lambda n: int(n.split("-", 1)[1]), reverse=True):
            if storage.exists(storage.join(uri := storage.join(root, name), MANIFEST)):
                return uri
            log.info("skipping %s: no %s (an interrupted upload)", uri, MANIFEST)
    except storage.StorageError as exc:
        raise _storage_failure(root, exc) from None
    return None


def prune(root: str | Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop stale partial directories (in S3
    those older than the newest complete checkpoint: a newer one may still be uploading)."""
    if storage.is_remote(root):
        _prune_remote(str(root), keep_last)
        return
    done = list_checkpoints(root)
    for p in [*done[: max(0, len(done) - keep_last)], *Path(root).glob("step-*.partial-*")]:
        shutil.rmtree(p, ignore_errors=True)


def _prune_remote(root: str, keep_last: int) -> None:
    try:
        steps = _remote_steps(root)
        if not (complete := [(step, uri) for step, uri, ok in steps if ok]):
            return
        for _, uri in complete[: max(0, len(complete) - keep_last)]:
            storage.delete(storage.join(uri, MANIFEST))  # invisible first, then gone
            storage.delete_prefix(uri)
            log.info("pruned %s (checkpoint.keep_last=%d)", uri, keep_last)
        for step, uri, ok in steps:
            if not ok and step < complete[-1][0]:
                storage.delete_prefix(uri)
                log.info("removed %s: an upload interrupted before its manifest", uri)
    except storage.StorageError as exc:
        raise _storage_failure(root, exc) from None


def fetch_checkpoint(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local, verified directory of the checkpoint at ``path``: a local path as is; an
    ``s3://`` one downloaded (each file checked) into ``<cache_dir>/checkpoints/`` unless the
    copy there has the same manifest and still verifies. One copy per root is kept."""
    if not storage.is_remote(path):
        return Path(path)
    parent, _, name = (uri := str(path).rstrip("/")).rpartition("/")
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{uri}: not a checkpoint (expected .../step-NNNNNN)")
    local = (cache_root := _cache_root(parent, cache_dir)) / name
    try:
        remote = storage.read_manifest(uri)
        if local.is_dir():
            try:
                if verify_checkpoint(local) == remote:
                    log.info("checkpoint %s: using the verified local copy %s", uri, local)
                    return local
            except CheckpointError as exc:
                log.warning("the local copy of %s is unusable (%s); downloading", uri, exc)
        storage.download_dir(uri, local)
    except storage.ManifestMissing:
        raise CheckpointError(redact(f"{uri}: no {MANIFEST}, so this checkpoint is incomplete (an "
                                     "interrupted upload); not resuming from it")) from None
    except storage.StorageError as exc:
        raise _storage_failure(uri, exc) from None
    _keep_only(cache_root, name)
    return local


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; returns it. In S3 only sizes (SHA-256s are checked
    when :func:`fetch_checkpoint` downloads it)."""
    if storage.is_remote(path):
        return _verify_remote(str(path))
    try:
        manifest = json.loads(((path := Path(path)) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({exc})") from exc
    for name, meta in manifest["files"].items():
        if not (f := path / name).is_file() or f.stat().st_size != meta["bytes"] or (
                storage.file_sha256(f) != meta["sha256"]):
            raise CheckpointError(f"{path}: {name} does not match the manifest; not resuming")
    return manifest


def _verify_remote(uri: str) -> dict[str, Any]:
    try:
        manifest = storage.read_manifest(uri)
        sizes = {f.name: f.size for f in storage.list_files(uri)}
    except storage.ManifestMissing:
        raise CheckpointError(f"{uri}: no {MANIFEST}; an incomplete checkpoint") from None
    except storage.StorageError as exc:
        raise _storage_failure(uri, exc) from None
    for name, meta in manifest["files"].items():
        if sizes.get(name) != meta["bytes"]:
            raise CheckpointError(redact(f"{uri}: {name} is missing or not its manifest's size"))
    return manifest


def load_checkpoint_state(
    path: str | Path, *, cache_dir: str | Path | None = None
) -> tuple[CheckpointState, dict[str, Any]]:
    """The run state and RNG states of a verified checkpoint (an ``s3://`` one fetched first;
    callers that load the weights too fetch it themselves and pass the local path)."""
    if storage.is_remote(path):
        path = fetch_checkpoint(path, cache_dir)  # verified while downloading
    else:
        verify_checkpoint(path := Path(path))
    state = CheckpointState(**json.loads((path / "state.json").read_text()))
    return state, torch.load(path / "rng.pt", weights_only=False)


# ------------------------------------------------------------------- a training run's own


# A vision-language model's processor files (rl_core.models.vlm.PROCESSOR_FILES).
_PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json",
                    "processor_config.json")


def save_training(root: str | Path, trainer: Any, tokenizer: Any, state: CheckpointState, *,
                  keep_last: int, cache_dir: str | Path | None,
                  extra: Callable[[Path], None] | None = None) -> Path | str:
    """The one checkpoint of a training run (GRPO and SFT): the trainer's state (model or
    adapter, optimizer, LR schedule), the tokenizer in ``model/``, whatever ``extra`` writes
    (GRPO: the rollouts generated ahead), and ``state``; committed by its manifest."""
    def payload(tmp: Path) -> None:
        trainer.save_state(tmp)
        tokenizer.save_pretrained(tmp / "model")
        source = getattr(trainer, "model_path", None)
        for name in _PROCESSOR_FILES if source is not None else ():  # a VLM's image processor
            if (f := Path(source) / name).is_file():
                shutil.copyfile(f, tmp / "model" / name)
        if extra is not None:
            extra(tmp)

    return write_checkpoint(root, state, payload, keep_last=keep_last, cache_dir=cache_dir)


def restore_training(path: str | Path, trainer: Any, *, config_digest: str, train_digest: str,
                     cache_dir: str | Path | None,
                     after_load: Callable[[CheckpointState], None] | None = None,
                     ) -> tuple[CheckpointState, Path]:
    """Load a verified checkpoint into ``trainer`` (``after_load``: e.g. the engines synced to
    it), then the RNG states; the run state and the local copy. Refuses a checkpoint written
    for other training data (resuming would skip or repeat rows); warns on another config."""
    local = fetch_checkpoint(path, cache_dir)  # s3://: downloaded, verified
    state, rng = load_checkpoint_state(local)
    if state.train_digest and state.train_digest != train_digest:
        raise CheckpointError(redact(
            f"{path} was written for training data {state.train_digest[:12]}, but the data "
            f"prepared now is {train_digest[:12]}; resuming would skip or repeat rows. "
            "Restore the original data.source, or start a new run (--no-resume)"))
    if state.config_digest != config_digest:
        log.warning("resuming %s with a config that differs from the one that wrote it", path)
    trainer.load_state(local)
    if after_load is not None:
        after_load(state)
    restore_rng(rng)
    return state, local
