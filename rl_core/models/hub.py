"""Resolving a model reference to a verified local Hugging Face directory, cached by content.

``model.path`` may be ``embedded:tiny`` (built here by :mod:`rl_core.models.tiny`), a local
HF directory, a Hugging Face hub id, or an ``s3://`` prefix. Every result is verified
to load (config, tokenizer, weights) before anything else starts, and carries a content key:
the digest of its manifest (each file's name, size and sha256).

Hub snapshots live in ``<cache>/models/hf/<org>--<name>/``::

    snapshots/<commit sha>/   the files plus grpoflow_manifest.json (written last, in tmp/)
    refs/<revision>           the commit a branch or tag last resolved to (offline fallback)
    tmp/                      downloads in progress; renamed into snapshots/ only when done

A revision is resolved to its commit sha on the hub first, so a moved branch downloads the
new commit and an unchanged one is reused. A reused snapshot is checked against its manifest;
a corrupted or partial one is discarded and downloaded again, never used. A download killed
half-way leaves only a tmp/ entry, removed by the next download. When the hub cannot be
reached, the snapshot of the requested commit (or the one a branch last resolved to) is used
and the log says so. The HF token is passed to ``huggingface_hub`` and never logged.

S3 prefixes (through :mod:`rl_core.storage`) live in ``<cache>/models/s3/<bucket>--<prefix>/``
with the same layout; a snapshot is named by the digest of the prefix's listing (names, sizes,
ETags), so a changed object downloads a new snapshot. Files are checked against the prefix's
``MANIFEST.json`` (SHA-256) when it has one (``rl_core.storage.upload_dir`` writes it), else
against the listed sizes; then the directory must load like any other.

:func:`check_context_length` refuses, before anything starts, a config whose longest
sequence (``data.max_prompt_tokens`` plus the tokens it may generate) does not fit the model's
context; longer prompts themselves are skipped and counted (:mod:`rl_core.planes`).

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from rl_core.config import DataConfig, ExperimentConfig, ModelConfig
from rl_core.models.tiny import TinyModelSpec, bootstrap_tiny_model

__all__ = [
    "MANIFEST",
    "ModelError",
    "ModelSnapshot",
    "check_context_length",
    "context_length",
    "download_model",
    "file_manifest",
    "resolve_model",
    "snapshot_model",
    "tiny_spec_for",
    "verify_model_dir",
]

log = logging.getLogger(__name__)

EMBEDDED_TINY = "embedded:tiny"
MANIFEST = "grpoflow_manifest.json"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Transport failures of requests / httpx / httpx2, whichever huggingface_hub uses.
_TRANSPORT_ERRORS = {"TransportError", "ConnectionError", "Timeout", "TimeoutException"}


class ModelError(ValueError):
    """A model reference that cannot be used; the message names the path and the fix."""


@dataclass(frozen=True)
class ModelSnapshot:
    """A verified local model directory and where it came from."""

    path: Path
    key: str  # content key: digest of the manifest (file names, sizes, sha256)
    kind: Literal["tiny", "local", "hub", "s3"]
    source: str  # what was asked for: embedded:tiny, the directory, the hub id, the s3:// URI
    revision: str | None  # the commit sha of a hub snapshot
    cached: bool  # nothing was downloaded or built
    offline: bool = False  # the hub (or S3) was unreachable; a cached snapshot was used


def tiny_spec_for(model: ModelConfig, data: DataConfig) -> TinyModelSpec:
    """The tiny model is warm-started on the same synthetic task the run trains on."""
    return TinyModelSpec(
        hidden_size=model.tiny_hidden_size,
        layers=model.tiny_layers,
        heads=model.tiny_heads,
        kv_heads=model.tiny_kv_heads,
        intermediate_size=model.tiny_intermediate_size,
        vocab_size=model.tiny_vocab_size,
        **data.synthetic_knobs(),
        data_seed=data.seed,
        train_size=data.synthetic_train_size,
        test_size=data.synthetic_test_size,
        sft_max_steps=model.tiny_sft_steps,
        target_accuracy=model.tiny_target_accuracy,
        seed=model.seed,
    )


def verify_model_dir(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """Check that ``path`` holds a loadable HF causal LM: config, tokenizer, weights."""
    from transformers import AutoConfig, AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p} has no config.json; is model.path an HF model directory?")
    if not trust_remote_code:
        _refuse_remote_code(p)
    try:
        config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - report any loader failure with the path
        raise ModelError(f"{p}/config.json does not load: {exc}") from exc
    weights = list(p.glob("*.safetensors")) + list(p.glob("pytorch_model*.bin"))
    if not weights:
        raise ModelError(f"{p} has no weights (*.safetensors or pytorch_model*.bin)")
    _check_safetensors(p)
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((p / f).is_file() for f in vocab_files):
        # transformers would build an empty tokenizer from the model type alone.
        raise ModelError(
            f"{p} has no tokenizer ({', '.join(vocab_files)}); copy the tokenizer files "
            "of the base model into it"
        )
    try:
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(
            f"{p}: the tokenizer does not load ({exc}); a model directory needs "
            "tokenizer.json or the tokenizer files of its family"
        ) from exc
    if tok.eos_token_id is None:
        raise ModelError(f"{p}: the tokenizer has no eos_token; set it in tokenizer_config.json")
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None
    )
    for name in ("eos_token", "pad_token"):
        token_id = getattr(tok, f"{name}_id", None)
        if vocab and token_id is not None and token_id >= vocab:
            # transformers gives a tokenizer without one a new token past the model's ids
            raise ModelError(
                f"{p}: the tokenizer's {name} {getattr(tok, name)!r} has id {token_id}, outside "
                f"the model's vocabulary ({vocab} ids): the tokenizer has no {name} the model "
                f"knows; set {name} in tokenizer_config.json to one of its tokens"
            )
    return p


def _refuse_remote_code(p: Path) -> None:
    """A config or tokenizer that maps to the directory's own Python (``auto_map``) would run
    that code on load: refuse it unless the user said to trust it."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((p / name).read_text())
        except (OSError, ValueError):
            continue  # missing or broken: the loaders below say so
        if isinstance(data, dict) and data.get("auto_map"):
            raise ModelError(
                f"{p}/{name} has an auto_map: loading this model runs Python code shipped "
                f"with it ({', '.join(sorted(map(str, data['auto_map'])))}); grpoflow runs "
                "no model code unless model.trust_remote_code=true. Review the code, then "
                "set model.trust_remote_code=true, or use a model transformers supports natively"
            )


# rope_scaling types whose factor stretches the trained context (as vLLM derives it).
_STRETCHING_ROPE = {"linear", "dynamic", "yarn"}


def context_length(path: str | Path) -> int | None:
    """The model's context window from its ``config.json``: ``max_position_embeddings`` (of
    ``text_config`` for multimodal configs), stretched by a linear/dynamic/yarn
    ``rope_scaling`` factor; None when the config names no limit. Reads the JSON only (no
    model code runs)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}/config.json does not load: {exc}") from exc
    for section in (config, config.get("text_config") or {}):
        limit = section.get("max_position_embeddings")
        if isinstance(limit, int) and limit > 0:
            rope = section.get("rope_scaling") or {}
            kind = rope.get("rope_type") or rope.get("type")
            factor = rope.get("factor")
            if kind in _STRETCHING_ROPE and isinstance(factor, int | float) and factor > 1:
                base = rope.get("original_max_position_embeddings") or limit
                return int(base * factor)
            return limit
    return None


def check_context_length(path: str | Path, cfg: ExperimentConfig) -> int | None:
    """Refuse a config whose longest sequence does not fit the model's context window.

    A sequence is a prompt of up to ``data.max_prompt_tokens`` tokens plus up to
    ``rollout.max_new_tokens`` generated ones (and ``eval.max_new_tokens`` when set). The
    engines would refuse such requests mid-run; this says so before any step, naming the
    fields, the model and the fix. Returns the limit (None: the config names none).
    """
    limit = context_length(path)
    if limit is None:
        log.warning("model %s: config.json names no context length; not checked", path)
        return None
    prompt = cfg.data.max_prompt_tokens
    responses = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens}
    if cfg.eval.max_new_tokens is not None:
        responses["eval.max_new_tokens"] = cfg.eval.max_new_tokens
    for field, new in responses.items():
        if prompt + new > limit:
            raise ModelError(
                f"data.max_prompt_tokens={prompt} + {field}={new} = {prompt + new} tokens, "
                f"more than the context window of the model at {path} ({limit} tokens, "
                f"max_position_embeddings in its config.json); lower data.max_prompt_tokens "
                f"(longer prompts are skipped and counted) or {field} so that their sum is "
                f"at most {limit}, or use a model with a longer context"
            )
    return limit


def _check_safetensors(p: Path) -> None:
    """Every shard named by the index exists, and every header parses (cheap: no tensors)."""
    from safetensors import safe_open

    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as exc:
            raise ModelError(f"{index} is not a safetensors index: {exc}") from exc
        missing = sorted(s for s in shards if not (p / s).is_file())
        if missing:
            raise ModelError(f"{p} lacks weight shards named in {index.name}: {missing}")
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as exc:  # noqa: BLE001 - truncated or not safetensors at all
            raise ModelError(f"{f} does not load as safetensors (truncated?): {exc}") from exc


# ---------------------------------------------------------------- manifests and content keys


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{relative name: {size, sha256}}`` of the files under ``root``.

    Dot-prefixed paths (``.git``, ``.cache``) and the manifest itself are left out.
    """
    root = Path(root)
    files: dict[str, dict[str, Any]] = {}
    started, total = time.perf_counter(), 0
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if rel.as_posix() == MANIFEST or any(part.startswith(".") for part in rel.parts):
            continue
        if f.is_file():
            size = f.stat().st_size
            files[rel.as_posix()] = {"size": size, "sha256": _sha256(f)}
            total += size
    elapsed = time.perf_counter() - started
    if elapsed > 5:
        log.info("hashed %.2f GB under %s in %.0fs", total / 1e9, root, elapsed)
    return files


def _content_key(files: dict[str, dict[str, Any]]) -> str:
    blob = json.dumps(
        [[name, e["size"], e["sha256"]] for name, e in sorted(files.items())],
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _manifest_problem(d: Path) -> str | None:
    """Why ``d`` does not match its manifest, or None when every file does."""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        recorded: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    for name, entry in sorted(recorded.items()):
        f = d / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['size']}"
        if _sha256(f) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


# ---------------------------------------------------------------- entry points


def snapshot_model(
    model: ModelConfig,
    data: DataConfig,
    cache_dir: str | Path,
    *,
    revision: str | None = None,
    token: str | None = None,
) -> ModelSnapshot:
    """``model.path`` -> a verified local directory (building the embedded tiny model).

    ``revision`` defaults to ``model.revision`` where the config has one, else ``main``.
    """
    if model.path != EMBEDDED_TINY:
        return download_model(
            model.path,
            cache_dir,
            revision=revision if revision is not None else getattr(model, "revision", None),
            token=token,
            trust_remote_code=model.trust_remote_code,
        )
    spec = tiny_spec_for(model, data)
    out = Path(cache_dir) / "models" / f"tiny-{spec.digest()}"
    cached = (out / "grpoflow_tiny.json").is_file()
    if not cached:
        log.info("building the embedded tiny model in %s (first run only)", out)

    def progress(step: int, loss: float, acc: float | None) -> None:
        if acc is not None:
            log.info(
                "  warm start step %d: loss %.3f, validation greedy accuracy %.3f (stops at %.2f)",
                step,
                loss,
                acc,
                spec.target_accuracy,
            )

    bootstrap_tiny_model(out, spec, progress=progress)
    return ModelSnapshot(verify_model_dir(out), spec.digest(), "tiny", EMBEDDED_TINY, None, cached)


def resolve_model(
    model: ModelConfig,
    data: DataConfig,
    cache_dir: str | Path,
    *,
    token: str | None = None,
    revision: str | None = None,
) -> tuple[Path, bool]:
    """Return (local verified directory, whether it came from the cache).

    Kept for callers that need only the path; :func:`snapshot_model` says more.
    """
    snap = snapshot_model(model, data, cache_dir, revision=revision, token=token)
    return snap.path, snap.cached


def download_model(
    uri: str,
    cache_dir: str | Path,
    *,
    revision: str | None = None,
    token: str | None = None,
    trust_remote_code: bool = False,
) -> ModelSnapshot:
    """A hub id, local directory or ``s3://`` prefix -> a verified local directory.

    Hub snapshots are cached by (repo id, commit sha); a local directory is used in place,
    keyed by the digest of its files.
    """
    if uri.startswith("s3://"):
        return _s3_snapshot(uri, Path(cache_dir), trust_remote_code)
    local = Path(uri).expanduser()
    if local.exists():
        if revision not in (None, "main"):
            log.warning("model.path=%s is a local directory; revision %r ignored", uri, revision)
        verify_model_dir(local, trust_remote_code=trust_remote_code)
        files = file_manifest(local)
        return ModelSnapshot(local, _content_key(files), "local", str(local), None, cached=True)
    if "://" in uri or uri.startswith(("/", ".", "~")) or uri.count("/") != 1:
        raise ModelError(
            f"model.path={uri!r} is neither an existing directory nor a hub id "
            "(`org/name`); fix the path or use embedded:tiny"
        )
    return _hub_snapshot(uri, Path(cache_dir), revision or "main", token, trust_remote_code)


# ---------------------------------------------------------------- S3


def _s3_snapshot(uri: str, cache: Path, trust_remote_code: bool) -> ModelSnapshot:
    """An ``s3://`` prefix -> a verified snapshot in the cache, named by its listing digest."""
    from rl_core import storage

    uri = uri.rstrip("/")
    repo_dir = cache / "models" / "s3" / re.sub(r"[^A-Za-z0-9._-]+", "--", uri[len("s3://") :])
    try:
        listing = [
            f for f in storage.list_files(uri) if not f.name.startswith(".") and f.name != MANIFEST
        ]
    except storage.Unreachable as exc:
        return _s3_offline(repo_dir, uri, str(exc), trust_remote_code)
    except storage.StorageError as exc:
        raise ModelError(f"model.path={uri}: {exc}") from None
    if not listing:
        raise ModelError(
            storage.redact(
                f"model.path={uri}: no objects under this prefix; upload the model directory "
                "there (config.json, tokenizer, *.safetensors) or fix model.path"
            )
        )
    digest = hashlib.sha256(
        json.dumps([[f.name, f.size, f.etag] for f in listing], separators=(",", ":")).encode()
    ).hexdigest()
    snap = _reuse(repo_dir, uri, digest, trust_remote_code)
    if snap is None:
        log.info("downloading %s into %s", uri, repo_dir)

        def fill(tmp: Path) -> None:
            manifest = storage.download_dir(uri, tmp, require_manifest=False)
            # Transport metadata, not model content: the content key must not depend on it.
            (tmp / storage.MANIFEST).unlink(missing_ok=True)
            if manifest["verified"] != "sha256":
                log.info(
                    "%s has no %s: files were checked by size only (upload models with "
                    "rl_core.storage.upload_dir for SHA-256 checks)",
                    uri,
                    storage.MANIFEST,
                )

        try:
            path, key = _install_snapshot(
                repo_dir, digest, fill, {"source": uri, "listing": digest}, trust_remote_code
            )
        except storage.StorageError as exc:
            raise ModelError(f"model.path={uri}: {exc}") from None
        snap = ModelSnapshot(path, key, "s3", uri, None, cached=False)
    else:
        snap = dataclasses.replace(snap, kind="s3", revision=None)
    _record_ref(repo_dir, "latest", digest)
    return snap


def _s3_offline(repo_dir: Path, uri: str, reason: str, trust_remote_code: bool) -> ModelSnapshot:
    """S3 cannot be reached: the snapshot this prefix last resolved to, if it is cached."""
    recorded = _read_ref(repo_dir, "latest")
    snap = _reuse(repo_dir, uri, recorded["sha"], trust_remote_code) if recorded else None
    if snap is None:
        raise ModelError(
            f"model.path={uri}: {reason}; and {repo_dir} holds no verified snapshot of it. "
            "Fix the endpoint, or download it once where S3 is reachable with the same "
            "storage.cache_dir"
        )
    log.warning("S3 cannot be reached (%s); using the cached snapshot %s", reason, snap.path)
    return dataclasses.replace(snap, kind="s3", revision=None, offline=True)


# ---------------------------------------------------------------- the hub


def _hub_snapshot(
    repo: str, cache: Path, ref: str, token: str | None, trust_remote_code: bool
) -> ModelSnapshot:
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    repo_dir = cache / "models" / "hf" / repo.replace("/", "--")
    if _COMMIT.fullmatch(ref):  # content-addressed already: no need to ask the hub
        snap = _reuse(repo_dir, repo, ref, trust_remote_code)
        if snap is not None:
            return snap
    try:
        if _offline_mode():
            raise OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
        sha = huggingface_hub.HfApi().model_info(repo, revision=ref, token=token).sha
    except Exception as exc:  # noqa: BLE001 - classified below
        if not _unreachable(exc):
            raise ModelError(_refusal(repo, ref, exc, token)) from exc
        return _offline_fallback(repo_dir, repo, ref, _redact(str(exc), token), trust_remote_code)
    if not sha:
        raise ModelError(f"model.path={repo!r}: the hub gave no commit for revision {ref!r}")
    snap = _reuse(repo_dir, repo, sha, trust_remote_code)
    if snap is None:
        log.info("downloading %s@%s (%s) into %s", repo, ref, sha[:12], repo_dir)

        def fill(tmp: Path) -> None:
            huggingface_hub.snapshot_download(
                repo_id=repo,
                revision=sha,
                local_dir=tmp,
                allow_patterns=_HUB_PATTERNS,
                token=token,
            )

        path, key = _install_snapshot(
            repo_dir,
            sha,
            fill,
            {"source": f"hf://{repo}", "revision": ref, "sha": sha},
            trust_remote_code,
        )
        snap = ModelSnapshot(path, key, "hub", repo, sha, cached=False)
    _record_ref(repo_dir, ref, sha)
    return snap


def _offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub read it at import, or as set since."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").upper()
    return constants.HF_HUB_OFFLINE or env in {"1", "ON", "YES", "TRUE"}


def _unreachable(exc: BaseException) -> bool:
    """The hub could not answer (network, offline mode, 5xx), as opposed to refusing."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError):
        return False
    if isinstance(exc, HfHubHTTPError):
        status = getattr(exc.response, "status_code", None)
        return status is None or status >= 500 or status in (408, 429)
    if isinstance(exc, OfflineModeIsEnabled | ConnectionError | TimeoutError):
        return True
    return any(c.__name__ in _TRANSPORT_ERRORS for c in type(exc).__mro__)


def _redact(text: str, token: str | None) -> str:
    for secret in {token, os.environ.get("HF_TOKEN")} - {None, ""}:
        text = text.replace(secret, "***")  # type: ignore[arg-type]
    return text


def _refusal(repo: str, ref: str, exc: BaseException, token: str | None) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return (
            f"model.path={repo!r} is gated: accept its terms on huggingface.co and set "
            "HF_TOKEN to a token of an account with access"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"model.path={repo!r} is not a model on the hub, or it is private: check the id, "
            "or set HF_TOKEN to a token that can read it"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"model.path={repo!r} has no revision {ref!r}; fix model.revision"
    return f"model.path={repo!r}@{ref}: the hub refused the request: {_redact(str(exc), token)}"


def _offline_fallback(
    repo_dir: Path, repo: str, ref: str, reason: str, trust_remote_code: bool
) -> ModelSnapshot:
    recorded = None if _COMMIT.fullmatch(ref) else _read_ref(repo_dir, ref)
    sha = ref if recorded is None else recorded["sha"]
    snap = _reuse(repo_dir, repo, sha, trust_remote_code) if _COMMIT.fullmatch(sha) else None
    if snap is None:
        others = sorted(p.name for p in (repo_dir / "snapshots").glob("*") if p.is_dir())
        hint = ""
        if others:
            hint = f" It holds other commits ({', '.join(others)}): set model.revision to one."
        raise ModelError(
            f"model.path={repo!r} (revision {ref!r}): the Hugging Face hub cannot be reached "
            f"({reason}) and {repo_dir} holds no verified snapshot of that revision.{hint} "
            "Fix: download it once where the hub is reachable, with the same "
            f"storage.cache_dir (`grpoflow download-model --uri {repo}`), then run here "
            "with HF_HUB_OFFLINE=1; or set model.path to a local HF directory."
        )
    when = f", resolved {recorded['resolved_at']}" if recorded else ""
    log.warning(
        "the hub cannot be reached (%s); using the cached snapshot of %s@%s (%s%s)",
        reason,
        repo,
        ref,
        sha[:12],
        when,
    )
    return ModelSnapshot(snap.path, snap.key, "hub", repo, sha, cached=True, offline=True)


def _ref_path(repo_dir: Path, ref: str) -> Path:
    return repo_dir / "refs" / quote(ref, safe="")


def _read_ref(repo_dir: Path, ref: str) -> dict[str, str] | None:
    try:
        recorded = json.loads(_ref_path(repo_dir, ref).read_text())
        return recorded if isinstance(recorded.get("sha"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _record_ref(repo_dir: Path, ref: str, sha: str) -> None:
    if ref == sha:
        return
    path = _ref_path(repo_dir, ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tmp.write_text(json.dumps({"sha": sha, "resolved_at": stamp}))
    os.replace(tmp, path)


# ---------------------------------------------------------------- the snapshot store


def _reuse(repo_dir: Path, repo: str, sha: str, trust_remote_code: bool) -> ModelSnapshot | None:
    """The verified snapshot of ``sha``, or None (a damaged one is discarded first)."""
    d = repo_dir / "snapshots" / sha
    if not d.exists():
        return None
    problem = _manifest_problem(d)
    if problem is not None:
        log.warning("cached snapshot %s is damaged (%s); discarding it", d, problem)
        _discard(d, repo_dir / "tmp")
        return None
    verify_model_dir(d, trust_remote_code=trust_remote_code)
    key = json.loads((d / MANIFEST).read_text())["key"]
    return ModelSnapshot(d, key, "hub", repo, sha, cached=True)


def _tmp_name(label: str) -> str:
    # '~' cannot occur in a commit sha, a host name or a pid: the name parses back.
    return f"{label}~{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"


def _discard(d: Path, tmp_root: Path) -> None:
    """Move ``d`` out of the way in one rename, then delete it."""
    tmp_root.mkdir(parents=True, exist_ok=True)
    gone = tmp_root / _tmp_name("discard")
    os.rename(d, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _remove_stale(tmp_root: Path) -> None:
    """Delete tmp/ entries of processes on this host that no longer run (killed downloads)."""
    host = socket.gethostname()
    for entry in tmp_root.glob("*~*~*~*"):
        _, entry_host, pid, _ = entry.name.split("~", 3)
        if entry_host == host and pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by an interrupted download", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _install_snapshot(
    repo_dir: Path,
    sha: str,
    fill: Callable[[Path], None],
    origin: dict[str, str],
    trust_remote_code: bool,
) -> tuple[Path, str]:
    """Fill a tmp/ entry, verify it, write its manifest, rename it to snapshots/<sha>.

    The rename is the commit point: snapshots/ never holds a partial download.
    """
    tmp_root = repo_dir / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    _remove_stale(tmp_root)
    tmp = tmp_root / _tmp_name(sha)
    final = repo_dir / "snapshots" / sha
    try:
        fill(tmp)
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
        try:
            verify_model_dir(tmp, trust_remote_code=trust_remote_code)
        except ModelError as exc:
            raise ModelError(f"{origin['source']}@{sha[:12]} was downloaded but: {exc}") from exc
        files = file_manifest(tmp)
        key = _content_key(files)
        manifest = {**origin, "key": key, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if _manifest_problem(final) is not None:  # not a concurrent download's result
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process got there first
            key = json.loads((final / MANIFEST).read_text())["key"]
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, key
