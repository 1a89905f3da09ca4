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

The root may also be an ``s3://bucket/prefix`` (``checkpoint.uri``, through
:mod:`rl_core.storage`): the checkpoint is written locally as above (in
``<cache_dir>/checkpoints/``), then uploaded to ``<uri>/step-000020/`` with its manifest
uploaded last, so a prefix without ``MANIFEST.json`` is an interrupted upload that is never
listed, loaded or resumed from. Keep-last-K applies in S3 too (older complete checkpoints, and
incomplete ones older than the newest complete one, are deleted). :func:`fetch_checkpoint`
downloads one (every file's SHA-256 checked) into the local cache before it is loaded; the
copy just uploaded is kept there, so a restart on the same machine downloads nothing.

Never imports Prefect or MLflow; never logs or raises a message that was not redacted
(:func:`rl_core.storage.redact`).
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

__all__ = [
    "CheckpointError",
    "CheckpointState",
    "capture_rng",
    "fetch_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint_state",
    "prune",
    "restore_rng",
    "verify_checkpoint",
    "write_checkpoint",
]

log = logging.getLogger(__name__)
log.addFilter(storage.RedactFilter())

MANIFEST = "MANIFEST.json"
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
    cache_dir: str | Path | None = None,
) -> Path | str:
    """Write a checkpoint for ``state.step`` under ``root`` and commit it atomically.

    ``write_payload(tmp_dir)`` writes the heavy files (model, trainer state) into the
    temporary directory; this function adds the RNG and run state, the manifest last, then
    renames the directory into place and prunes old checkpoints. Returns the checkpoint's
    directory (its ``s3://`` URI when ``root`` is in S3).

    For an ``s3://`` root the checkpoint is written under ``<cache_dir>/checkpoints/``
    (default :func:`rl_core.storage.default_cache_dir`), uploaded with the manifest last, and
    the local copy is kept there as the cache :func:`fetch_checkpoint` reads first.
    """
    if storage.is_remote(root):
        return _write_remote(str(root), state, write_payload, keep_last, cache_dir)
    root = Path(root)
    final = _commit_local(root, state, write_payload)
    prune(root, keep_last)
    return final


def _commit_local(
    root: Path,
    state: CheckpointState,
    write_payload: Callable[[Path], None],
    label: str = "checkpoint",
) -> Path:
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
        "%s step %d -> %s (%.1f MB, %.2fs)",
        label,
        state.step,
        final,
        sum(f["bytes"] for f in files.values()) / 1e6,
        time.perf_counter() - started,
    )
    return final


def _cache_root(root: str, cache_dir: str | Path | None) -> Path:
    """``<cache_dir>/checkpoints/<digest of the root URI>``: one local copy per S3 root."""
    base = Path(cache_dir) if cache_dir is not None else storage.default_cache_dir()
    key = hashlib.sha256(root.rstrip("/").encode()).hexdigest()[:16]
    return base / "checkpoints" / key


def _keep_only(cache_root: Path, name: str | None) -> None:
    """Drop every cached step of this root but ``name`` (one local copy is enough)."""
    for p in cache_root.glob("step-*"):
        if p.name != name:
            shutil.rmtree(p, ignore_errors=True)


def _storage_failure(root: str, exc: storage.StorageError) -> CheckpointError:
    return CheckpointError(storage.redact(f"checkpoint.uri={root}: {exc}"))


def _write_remote(
    root: str,
    state: CheckpointState,
    write_payload: Callable[[Path], None],
    keep_last: int,
    cache_dir: str | Path | None,
) -> str:
    cache_root = _cache_root(root, cache_dir)
    for stale in cache_root.glob("staging-*"):  # left by a writer that was killed
        shutil.rmtree(stale, ignore_errors=True)
    staging = cache_root / f"staging-{uuid.uuid4().hex[:8]}"
    target = storage.join(root, step_dir_name(state.step))
    try:
        local = _commit_local(staging, state, write_payload, "checkpoint (staged for upload)")
        manifest = json.loads((local / MANIFEST).read_text())
        # A re-run of the same step replaces it: the old manifest goes first, so the prefix
        # is never "complete" with a mix of old and new files.
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
    out = []
    for name in storage.list_dirs(root):
        m = _STEP_DIR.match(name)
        if m:
            uri = storage.join(root, name)
            out.append((int(m.group(1)), uri, storage.exists(storage.join(uri, MANIFEST))))
    return sorted(out)


def list_checkpoints(root: str | Path) -> list[Path] | list[str]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first.

    Local directories as Paths; for an ``s3://`` root, their URIs.
    """
    if storage.is_remote(root):
        try:
            return [uri for _, uri, complete in _remote_steps(str(root)) if complete]
        except storage.StorageError as exc:
            raise _storage_failure(str(root), exc) from None
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | str | None:
    """The newest complete checkpoint, or None. Partial directories are never returned.

    For an ``s3://`` root: the URI of the newest ``step-*`` prefix whose manifest exists (an
    upload interrupted before its manifest is skipped); pass it to :func:`fetch_checkpoint`.
    """
    if storage.is_remote(root):
        root = str(root)
        try:
            names = [n for n in storage.list_dirs(root) if _STEP_DIR.match(n)]
            for name in sorted(names, key=lambda n: int(n.split("-", 1)[1]), reverse=True):
                uri = storage.join(root, name)
                if storage.exists(storage.join(uri, MANIFEST)):
                    return uri
                log.info("skipping %s: no %s (an interrupted upload)", uri, MANIFEST)
        except storage.StorageError as exc:
            raise _storage_failure(root, exc) from None
        return None
    done = list_checkpoints(root)
    return done[-1] if done else None


def prune(root: str | Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop stale partial directories.

    In S3, "partial" means a ``step-*`` prefix without a manifest that is older than the
    newest complete checkpoint (a newer one may still be uploading).
    """
    if storage.is_remote(root):
        _prune_remote(str(root), keep_last)
        return
    done = list_checkpoints(root)
    for p in done[: max(0, len(done) - keep_last)]:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).glob("step-*.partial-*"):
        shutil.rmtree(p, ignore_errors=True)


def _prune_remote(root: str, keep_last: int) -> None:
    try:
        steps = _remote_steps(root)
        complete = [(step, uri) for step, uri, ok in steps if ok]
        if not complete:
            return
        newest = complete[-1][0]
        for _, uri in complete[: max(0, len(complete) - keep_last)]:
            storage.delete(storage.join(uri, MANIFEST))  # invisible first, then gone
            storage.delete_prefix(uri)
            log.info("pruned %s (checkpoint.keep_last=%d)", uri, keep_last)
        for step, uri, ok in steps:
            if not ok and step < newest:
                storage.delete_prefix(uri)
                log.info("removed %s: an upload interrupted before its manifest", uri)
    except storage.StorageError as exc:
        raise _storage_failure(root, exc) from None


def fetch_checkpoint(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local, verified directory of the checkpoint at ``path``.

    A local path is returned as is. An ``s3://`` checkpoint is downloaded (every file checked
    against its manifest) into ``<cache_dir>/checkpoints/`` unless the copy there already has
    the same manifest and still verifies; one copy per root is kept.
    """
    if not storage.is_remote(path):
        return Path(path)
    uri = str(path).rstrip("/")
    parent, _, name = uri.rpartition("/")
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{uri}: not a checkpoint (expected .../step-NNNNNN)")
    cache_root = _cache_root(parent, cache_dir)
    local = cache_root / name
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
        raise CheckpointError(
            storage.redact(
                f"{uri}: no {MANIFEST}, so this checkpoint is incomplete (an interrupted "
                "upload); not resuming from it"
            )
        ) from None
    except storage.StorageError as exc:
        raise _storage_failure(uri, exc) from None
    _keep_only(cache_root, name)
    return local


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; returns the manifest.

    For an ``s3://`` checkpoint this checks that the manifest exists and every file it lists
    is there with its size; SHA-256s are checked when :func:`fetch_checkpoint` downloads it.
    """
    if storage.is_remote(path):
        return _verify_remote(str(path))
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
            raise CheckpointError(
                storage.redact(f"{uri}: {name} is missing or not the size its manifest records")
            )
    return manifest


def load_checkpoint_state(
    path: str | Path, *, cache_dir: str | Path | None = None
) -> tuple[CheckpointState, dict[str, Any]]:
    """The run state and RNG states of a verified checkpoint.

    An ``s3://`` checkpoint is fetched first (:func:`fetch_checkpoint`); callers that also
    load the weights should call :func:`fetch_checkpoint` themselves and pass the local path.
    """
    if storage.is_remote(path):
        path = fetch_checkpoint(path, cache_dir)  # verified while downloading
    else:
        path = Path(path)
        verify_checkpoint(path)
    state = CheckpointState(**json.loads((path / "state.json").read_text()))
    rng = torch.load(path / "rng.pt", weights_only=False)
    return state, rng
