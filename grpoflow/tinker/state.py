"""What the service remembers: sessions, training models and sampling sessions (in memory),
and training runs and their checkpoints (on disk, so they outlive the process).

Ids follow the SDK (docs/tinker-protocol.md, 5.3 and 11.1): a session ``s-<hex>``; a training
model, which is also its training run, ``{session_id}:train:{model_seq_id}``; a sampling
session ``{session_id}:sample:{sampling_session_seq_id}``; a checkpoint
``tinker://<run>/<weights|sampler_weights>/<name>``, stored in ``<root>/<run>/<kind>/<name>/``
with ``tinker_checkpoint.json`` next to the backend's files, and a run's description in
``<root>/<run>/training_run.json``. Ephemeral sampler weights (``save_weights_and_get_sampling_
client``) live in ``<root>/.ephemeral/`` until their session finishes or the service restarts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rl_core.tinker import TinkerError

__all__ = ["CHECKPOINT_META", "KINDS", "CheckpointStore", "Registry", "Sampler", "Session",
           "TrainingModel", "check_name", "now_iso"]

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> checkpoint_type
CHECKPOINT_META = "tinker_checkpoint.json"
RUN_META = "training_run.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+:-]{0,127}")


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def check_name(name: str, what: str = "checkpoint name") -> str:
    """``name`` if it is usable as one path component (letters, digits, ``._=+:-``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TinkerError(f"{what} {name!r} must be 1-128 characters of letters, digits and "
                          "._=+:- starting with a letter or digit (no '/')")
    return name


@dataclass
class Session:
    id: str
    owner: str
    created: str
    tags: list[str] = field(default_factory=list)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)


@dataclass
class TrainingModel:
    """A LoRA adapter being trained: also a training run (``id``)."""

    id: str
    session_id: str
    owner: str
    base_model: str
    rank: int
    request_id: str = ""  # the creating request (create_model or load_weights)
    error: str | None = None  # creation failed: every later request fails with this
    optim_steps: int = 0
    last_request: str = field(default_factory=now_iso)


@dataclass
class Sampler:
    id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None = None
    adapter_dir: Path | None = None
    ephemeral: bool = False


class Registry:
    """Sessions, models and samplers of this process (thread-safe)."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.lock = threading.RLock()

    def new_session(self, owner: str, tags: list[str], user_metadata: dict[str, Any]) -> Session:
        with self.lock:
            session = Session(id=f"s-{uuid.uuid4().hex[:16]}", owner=owner, created=now_iso(),
                              tags=tags, user_metadata=user_metadata)
            self.sessions[session.id] = session
            return session

    def session(self, session_id: str, owner: str) -> Session:
        """The caller's live session; KeyError (unknown, another user's) or TinkerError
        (finished)."""
        with self.lock:
            session = self.sessions.get(session_id)
            if session is None or session.owner != owner:
                raise KeyError(f"unknown session {session_id!r}")
            if session.finished:
                raise TinkerError(f"session {session_id} is finished; start a new ServiceClient")
            session.last_seen = time.monotonic()
            return session

    def model(self, model_id: str, owner: str) -> TrainingModel:
        with self.lock:
            model = self.models.get(model_id)
            if model is None or model.owner != owner:
                raise KeyError(f"unknown model {model_id!r}")
            model.last_request = now_iso()
            return model

    def sampler(self, sampler_id: str, owner: str) -> Sampler:
        with self.lock:
            sampler = self.samplers.get(sampler_id)
            if sampler is None or sampler.owner != owner:
                raise KeyError(f"unknown sampling session {sampler_id!r}")
            return sampler

    def add_model(self, model: TrainingModel) -> None:
        with self.lock:
            self.models[model.id] = model
            self.sessions[model.session_id].model_ids.append(model.id)

    def add_sampler(self, sampler: Sampler) -> None:
        with self.lock:
            self.samplers[sampler.id] = sampler
            if (session := self.sessions.get(sampler.session_id)) is not None:
                session.sampler_ids.append(sampler.id)


class CheckpointStore:
    """Training runs and checkpoints under ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ephemeral = self.root / ".ephemeral"
        shutil.rmtree(self.ephemeral, ignore_errors=True)  # the samplers that used it are gone
        self.ephemeral.mkdir()

    # ------------------------------------------------------------------ paths
    def parse(self, tinker_path: str) -> tuple[str, str, str]:
        """``tinker://run/kind/name`` -> (run, kind, name); TinkerError if malformed."""
        if not isinstance(tinker_path, str) or not tinker_path.startswith("tinker://"):
            raise TinkerError(f"{tinker_path!r} is not a tinker:// path")
        parts = tinker_path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise TinkerError(f"{tinker_path!r} is not tinker://<training_run_id>/"
                              "<weights|sampler_weights>/<name>")
        run, kind, name = parts
        check_name(run, "training run id")
        check_name(name)
        return run, kind, name

    @staticmethod
    def path(run: str, kind: str, name: str) -> str:
        return f"tinker://{run}/{kind}/{name}"

    def dir(self, run: str, kind: str, name: str) -> Path:
        return self.root / run / kind / name

    def staging(self, run: str, kind: str, name: str) -> Path:
        """An empty directory for a checkpoint being written (:meth:`commit` moves it)."""
        tmp = self.root / run / kind / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    # ------------------------------------------------------------------ runs
    def write_run(self, meta: dict[str, Any]) -> None:
        run_dir = self.root / meta["training_run_id"]
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{RUN_META}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, run_dir / RUN_META)

    def read_run(self, run: str) -> dict[str, Any] | None:
        try:
            check_name(run, "training run id")
            return json.loads((self.root / run / RUN_META).read_text())
        except (TinkerError, OSError, ValueError):
            return None

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for meta_file in sorted(self.root.glob(f"*/{RUN_META}")):
            if (meta := self.read_run(meta_file.parent.name)) is not None:
                out.append(meta)
        return out

    # ------------------------------------------------------------------ checkpoints
    def commit(self, tmp: Path, run: str, kind: str, name: str, *, overwrite: bool,
               ttl_seconds: int | None = None,
               user_metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """Describe the checkpoint written into ``tmp`` and move it into place; its
        ``Checkpoint`` JSON."""
        final = self.dir(run, kind, name)
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        when = datetime.now(UTC)
        meta: dict[str, Any] = {
            "checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind],
            "time": when.isoformat(), "tinker_path": self.path(run, kind, name),
            "size_bytes": size, "public": False}
        if user_metadata:
            meta["user_metadata"] = {str(k): str(v) for k, v in user_metadata.items()}
        if ttl_seconds:
            meta["expires_at"] = (when + timedelta(seconds=int(ttl_seconds))).isoformat()
        (tmp / CHECKPOINT_META).write_text(json.dumps(meta, indent=2))
        if final.exists():
            if not overwrite:
                shutil.rmtree(tmp, ignore_errors=True)
                raise TinkerError(f"checkpoint {meta['tinker_path']} exists; save it under "
                                  "another name, or pass overwrite=True")
            shutil.rmtree(final)
        os.replace(tmp, final)
        return meta

    def exists(self, run: str, kind: str, name: str) -> bool:
        return self.checkpoint(run, kind, name) is not None

    def checkpoint(self, run: str, kind: str, name: str) -> dict[str, Any] | None:
        """A checkpoint's JSON, or None when there is none (an expired one is deleted)."""
        d = self.dir(run, kind, name)
        try:
            meta = json.loads((d / CHECKPOINT_META).read_text())
        except (OSError, ValueError):
            return None
        expires = meta.get("expires_at")
        if expires and datetime.fromisoformat(expires) < datetime.now(UTC):
            shutil.rmtree(d, ignore_errors=True)
            return None
        return meta

    def checkpoints(self, run: str) -> list[dict[str, Any]]:
        """Every live checkpoint of ``run``, oldest first."""
        out = []
        for kind in KINDS:
            base = self.root / run / kind
            if not base.is_dir():
                continue
            for d in base.iterdir():
                if not d.name.startswith(".") and (meta := self.checkpoint(run, kind, d.name)):
                    out.append(meta)
        return sorted(out, key=lambda m: m["time"])

    def delete(self, run: str, kind: str, name: str) -> bool:
        d = self.dir(run, kind, name)
        if not (d / CHECKPOINT_META).is_file():
            return False
        shutil.rmtree(d)
        return True

    def set_ttl(self, run: str, kind: str, name: str, ttl_seconds: int | None) -> bool:
        meta = self.checkpoint(run, kind, name)
        if meta is None:
            return False
        meta.pop("expires_at", None)
        if ttl_seconds:
            meta["expires_at"] = (datetime.now(UTC) + timedelta(seconds=int(ttl_seconds))
                                  ).isoformat()
        (self.dir(run, kind, name) / CHECKPOINT_META).write_text(json.dumps(meta, indent=2))
        return True

    def ephemeral_dir(self, sampler_id: str) -> Path:
        d = self.ephemeral / sampler_id
        d.mkdir(parents=True, exist_ok=True)
        return d
