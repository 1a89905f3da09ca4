"""Resolving a model reference to a verified local Hugging Face directory, cached by content.

``model.path``: ``embedded:tiny``, a local HF directory, a hub id or an ``s3://`` prefix. Every
result is verified to load before anything starts and keyed by its manifest's digest; hub and
S3 snapshots are cached by commit / listing, downloaded atomically, discarded when damaged, and
reused when the source is unreachable (docs/models.md, 'The model cache').
:func:`local_model_dir` finds a reference already here without downloading, building or
hashing. The HF token goes to ``huggingface_hub`` only, never to a log. No Prefect or MLflow.
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

from rl_core import storage
from rl_core.config import ConfigError, DataConfig, ModelConfig
from rl_core.host import pid_alive
from rl_core.models.tiny import TinyModelSpec
from rl_core.models.tiny_vlm import TinyVLMSpec
from rl_core.secrets import redact

__all__ = ["EMBEDDED_TINY", "EMBEDDED_TINY_VLM", "MANIFEST", "ModelError", "ModelSnapshot",
           "TINY_MARKER", "TINY_VLM_MARKER", "download_model", "file_manifest",
           "local_model_dir", "tiny_dir", "tiny_spec_for", "tiny_vlm_dir", "tiny_vlm_spec_for",
           "verify_model_dir"]

log = logging.getLogger(__name__)

EMBEDDED_TINY = "embedded:tiny"
EMBEDDED_TINY_VLM = "embedded:tiny-vlm"  # the vision-language demo's (docs/vlm.md)
TINY_VLM_MARKER = "grpoflow_tiny_vlm_warm.json"
MANIFEST = "grpoflow_manifest.json"
TINY_MARKER = "grpoflow_tiny.json"  # written last by the demo model's build (rl_core.base_model)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Transport failures of requests / httpx / httpx2, whichever huggingface_hub uses.
_TRANSPORT_ERRORS = {"TransportError", "ConnectionError", "Timeout", "TimeoutException"}


class ModelError(ConfigError):
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
        hidden_size=model.tiny_hidden_size, layers=model.tiny_layers, heads=model.tiny_heads,
        kv_heads=model.tiny_kv_heads, intermediate_size=model.tiny_intermediate_size,
        vocab_size=model.tiny_vocab_size, **data.synthetic_knobs(), data_seed=data.seed,
        train_size=data.synthetic_train_size, test_size=data.synthetic_test_size,
        sft_max_steps=model.tiny_sft_steps, target_accuracy=model.tiny_target_accuracy,
        seed=model.seed, tool_demos=model.tiny_tool_demos, arch=model.tiny_arch,
        experts=model.tiny_experts, experts_per_token=model.tiny_experts_per_token,
        moe_intermediate_size=model.tiny_moe_intermediate_size)


def tiny_vlm_spec_for(model: ModelConfig, data: DataConfig) -> TinyVLMSpec:
    """The tiny VLM, warm-started on the shapes task's training split the run trains on."""
    return TinyVLMSpec(train_size=data.synthetic_train_size, test_size=data.synthetic_test_size,
                       data_seed=data.seed, image_size=data.synthetic_image_size,
                       seed=model.seed, sft_max_steps=model.tiny_sft_steps,
                       target_accuracy=model.tiny_target_accuracy)


def tiny_vlm_dir(cache: Path, spec: TinyVLMSpec) -> Path:
    return cache / "models" / f"tiny-vlm-{spec.digest()}"


def verify_model_dir(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """Check that ``path`` holds a loadable HF causal LM: config, weights, and a tokenizer
    with an EOS token whose every id the model can embed."""
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
    if not [*p.glob("*.safetensors"), *p.glob("pytorch_model*.bin")]:
        raise ModelError(f"{p} has no weights (*.safetensors or pytorch_model*.bin)")
    _check_safetensors(p)
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((p / f).is_file() for f in vocab_files):
        # transformers would build an empty tokenizer from the model type alone.
        raise ModelError(f"{p} has no tokenizer ({', '.join(vocab_files)}); copy the tokenizer "
                         "files of the base model into it")
    try:
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"{p}: the tokenizer does not load ({exc}); a model directory needs "
                         "tokenizer.json or the tokenizer files of its family") from exc
    if tok.eos_token_id is None:
        raise ModelError(f"{p}: the tokenizer has no eos_token; set it in tokenizer_config.json")
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None)
    outside = sorted((i, t) for t, i in tok.get_vocab().items() if vocab and i >= vocab)
    if outside:  # e.g. a token added to the tokenizer without resizing the embeddings
        roles = {getattr(tok, f"{r}_id", None): r for r in ("eos_token", "pad_token", "bos_token",
                                                           "unk_token")}
        shown = ", ".join(f"{t!r} (id {i}{', ' + roles[i] if i in roles else ''})"
                          for i, t in outside[:5]) + (" ..." if len(outside) > 5 else "")
        raise ModelError(
            f"{p}: the tokenizer has {len(outside)} token(s) whose ids the model cannot embed: "
            f"{shown}; the model's vocabulary has {vocab} ids (vocab_size in config.json). "
            "The tokenizer is not this model's, or tokens were added without resizing the "
            "embeddings: use the model's own tokenizer files, set the special tokens in "
            "tokenizer_config.json to tokens the model knows, or resize the embeddings "
            "(model.resize_token_embeddings(len(tokenizer))) and save the model again")
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
                "set model.trust_remote_code=true, or use a model transformers supports natively")


def _check_safetensors(p: Path) -> None:
    """Every shard named by the index exists, and every header parses (cheap: no tensors)."""
    from safetensors import safe_open

    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as exc:
            raise ModelError(f"{index} is not a safetensors index: {exc}") from exc
        if missing := sorted(s for s in shards if not (p / s).is_file()):
            raise ModelError(f"{p} lacks weight shards named in {index.name}: {missing}")
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as exc:  # noqa: BLE001 - truncated or not safetensors at all
            raise ModelError(f"{f} does not load as safetensors (truncated?): {exc}") from exc


# ---------------------------------------------------------------- manifests and content keys
def file_manifest(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{relative name: {size, sha256}}`` of the files under ``root``, but dot-prefixed
    paths (``.git``, ``.cache``) and the manifest itself."""
    root = Path(root)
    files: dict[str, dict[str, Any]] = {}
    started, total = time.perf_counter(), 0
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if rel.as_posix() == MANIFEST or any(part.startswith(".") for part in rel.parts):
            continue
        if f.is_file():
            files[rel.as_posix()] = {"size": f.stat().st_size, "sha256": storage.file_sha256(f)}
            total += files[rel.as_posix()]["size"]
    if (elapsed := time.perf_counter() - started) > 5:
        log.info("hashed %.2f GB under %s in %.0fs", total / 1e9, root, elapsed)
    return files


def _content_key(files: dict[str, dict[str, Any]]) -> str:
    rows = [[name, e["size"], e["sha256"]] for name, e in sorted(files.items())]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]


def _manifest_problem(d: Path) -> str | None:
    """Why ``d`` does not match its manifest, or None when every file does."""
    try:
        recorded: dict[str, dict[str, Any]] = json.loads((d / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    for name, entry in sorted(recorded.items()):
        f = d / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['size']}"
        if storage.file_sha256(f) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


# ---------------------------------------------------------------- entry points
def download_model(uri: str, cache_dir: str | Path, *, revision: str | None = None,
                   token: str | None = None, trust_remote_code: bool = False) -> ModelSnapshot:
    """A hub id, local directory or ``s3://`` prefix -> a verified local directory. Hub
    snapshots are cached by (repo id, commit sha); a local directory is used in place."""
    if uri.startswith("s3://"):
        return _s3_snapshot(uri, Path(cache_dir), trust_remote_code)
    local = Path(uri).expanduser()
    if local.exists():
        if revision not in (None, "main"):
            log.warning("model.path=%s is a local directory; revision %r ignored", uri, revision)
        verify_model_dir(local, trust_remote_code=trust_remote_code)
        key = _content_key(file_manifest(local))
        return ModelSnapshot(local, key, "local", str(local), None, cached=True)
    _check_hub_id(uri)
    return _hub_snapshot(uri, Path(cache_dir), revision or "main", token, trust_remote_code)


def local_model_dir(model: ModelConfig, data: DataConfig, cache_dir: str | Path) -> Path | None:
    """The directory ``model.path`` resolves to when it is on this machine already (a local
    directory, the built tiny model, the cached hub snapshot of ``model.revision`` or S3
    snapshot), else None. Nothing is downloaded, built, hashed or verified; a reference that
    can never resolve (a missing local path) raises :class:`ModelError`."""
    cache, uri = Path(cache_dir), model.path
    if uri == EMBEDDED_TINY:
        out = tiny_dir(cache, tiny_spec_for(model, data))
        return out if (out / TINY_MARKER).is_file() else None
    if uri == EMBEDDED_TINY_VLM:
        out = tiny_vlm_dir(cache, tiny_vlm_spec_for(model, data))
        return out if (out / TINY_VLM_MARKER).is_file() else None
    if uri.startswith("s3://"):
        repo_dir, ref = _s3_dir(cache, uri), "latest"
    elif (local := Path(uri).expanduser()).exists():
        return local
    else:
        _check_hub_id(uri)
        repo_dir, ref = _hub_dir(cache, uri), model.revision or "main"
    sha = ref if _COMMIT.fullmatch(ref) else (_read_ref(repo_dir, ref) or {}).get("sha")
    snap = repo_dir / "snapshots" / str(sha)
    return snap if sha and (snap / MANIFEST).is_file() else None


def tiny_dir(cache: Path, spec: TinyModelSpec) -> Path:
    return cache / "models" / f"tiny-{spec.digest()}"


def _check_hub_id(uri: str) -> None:
    if "://" in uri or uri.startswith(("/", ".", "~")) or uri.count("/") != 1:
        raise ModelError(f"model.path={uri!r} is neither an existing directory nor a hub id "
                         "(`org/name`); fix the path or use embedded:tiny")


# ---------------------------------------------------------------- S3
def _s3_dir(cache: Path, uri: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "--", uri.rstrip("/")[len("s3://") :])
    return cache / "models" / "s3" / name


def _s3_snapshot(uri: str, cache: Path, trust_remote_code: bool) -> ModelSnapshot:
    """An ``s3://`` prefix -> a verified snapshot in the cache, named by its listing digest."""
    uri, repo_dir = uri.rstrip("/"), _s3_dir(cache, uri)
    try:
        listing = [f for f in storage.list_files(uri)
                   if not f.name.startswith(".") and f.name != MANIFEST]
    except storage.Unreachable as exc:  # the snapshot this prefix last resolved to, if cached
        recorded = _read_ref(repo_dir, "latest")
        snap = _reuse(repo_dir, uri, recorded["sha"], trust_remote_code) if recorded else None
        if snap is None:
            raise ModelError(
                f"model.path={uri}: {exc}; and {repo_dir} holds no verified snapshot of it. Fix "
                "the endpoint, or download it once where S3 is reachable with the same "
                "storage.cache_dir") from None
        log.warning("S3 cannot be reached (%s); using the cached snapshot %s", exc, snap.path)
        return dataclasses.replace(snap, kind="s3", revision=None, offline=True)
    except storage.StorageError as exc:
        raise ModelError(f"model.path={uri}: {exc}") from None
    if not listing:
        raise ModelError(redact(f"model.path={uri}: no objects under this prefix; upload the "
                                "model directory there (config.json, tokenizer, *.safetensors) "
                                "or fix model.path"))
    digest = hashlib.sha256(json.dumps([[f.name, f.size, f.etag] for f in listing],
                                       separators=(",", ":")).encode()).hexdigest()
    snap = _reuse(repo_dir, uri, digest, trust_remote_code)
    if snap is None:
        log.info("downloading %s into %s", uri, repo_dir)

        def fill(tmp: Path) -> None:
            manifest = storage.download_dir(uri, tmp, require_manifest=False)
            # Transport metadata, not model content: the content key must not depend on it.
            (tmp / storage.MANIFEST).unlink(missing_ok=True)
            if manifest["verified"] != "sha256":
                log.info("%s has no %s: files were checked by size only (upload models with "
                         "rl_core.storage.upload_dir for SHA-256 checks)", uri, storage.MANIFEST)

        try:
            path, key = _install_snapshot(repo_dir, digest, fill,
                                          {"source": uri, "listing": digest}, trust_remote_code)
        except storage.StorageError as exc:
            raise ModelError(f"model.path={uri}: {exc}") from None
        snap = ModelSnapshot(path, key, "s3", uri, None, cached=False)
    _record_ref(repo_dir, "latest", digest)
    return dataclasses.replace(snap, kind="s3", revision=None)


# ---------------------------------------------------------------- the hub
def _hub_dir(cache: Path, repo: str) -> Path:
    return cache / "models" / "hf" / repo.replace("/", "--")


def _hub_snapshot(repo: str, cache: Path, ref: str, token: str | None,
                  trust_remote_code: bool) -> ModelSnapshot:
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    repo_dir = _hub_dir(cache, repo)
    # A commit is content-addressed already: no need to ask the hub.
    if _COMMIT.fullmatch(ref) and (snap := _reuse(repo_dir, repo, ref, trust_remote_code)):
        return snap
    try:
        if _offline_mode():
            raise OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
        sha = huggingface_hub.HfApi().model_info(repo, revision=ref, token=token).sha
    except Exception as exc:  # noqa: BLE001 - classified below
        if not _unreachable(exc):
            raise ModelError(_refusal(repo, ref, exc)) from exc
        return _offline_fallback(repo_dir, repo, ref, redact(str(exc)), trust_remote_code)
    if not sha:
        raise ModelError(f"model.path={repo!r}: the hub gave no commit for revision {ref!r}")
    snap = _reuse(repo_dir, repo, sha, trust_remote_code)
    if snap is None:
        log.info("downloading %s@%s (%s) into %s", repo, ref, sha[:12], repo_dir)

        def fill(tmp: Path) -> None:
            huggingface_hub.snapshot_download(repo_id=repo, revision=sha, local_dir=tmp,
                                              allow_patterns=_HUB_PATTERNS, token=token)

        origin = {"source": f"hf://{repo}", "revision": ref, "sha": sha}
        path, key = _install_snapshot(repo_dir, sha, fill, origin, trust_remote_code)
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
    from huggingface_hub import errors as hf

    if isinstance(exc, hf.RepositoryNotFoundError | hf.RevisionNotFoundError):
        return False
    if isinstance(exc, hf.HfHubHTTPError):
        status = getattr(exc.response, "status_code", None)
        return status is None or status >= 500 or status in (408, 429)
    if isinstance(exc, hf.OfflineModeIsEnabled | ConnectionError | TimeoutError):
        return True
    return any(c.__name__ in _TRANSPORT_ERRORS for c in type(exc).__mro__)


def _refusal(repo: str, ref: str, exc: BaseException) -> str:
    from huggingface_hub import errors as hf

    if isinstance(exc, hf.GatedRepoError):
        return (f"model.path={repo!r} is gated: accept its terms on huggingface.co and set "
                "HF_TOKEN to a token of an account with access")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return (f"model.path={repo!r} is not a model on the hub, or it is private: check the "
                "id, or set HF_TOKEN to a token that can read it")
    if isinstance(exc, hf.RevisionNotFoundError):
        return f"model.path={repo!r} has no revision {ref!r}; fix model.revision"
    return f"model.path={repo!r}@{ref}: the hub refused the request: {redact(str(exc))}"


def _offline_fallback(repo_dir: Path, repo: str, ref: str, reason: str,
                      trust_remote_code: bool) -> ModelSnapshot:
    recorded = None if _COMMIT.fullmatch(ref) else _read_ref(repo_dir, ref)
    sha = ref if recorded is None else recorded["sha"]
    snap = _reuse(repo_dir, repo, sha, trust_remote_code) if _COMMIT.fullmatch(sha) else None
    if snap is None:
        others = sorted(p.name for p in (repo_dir / "snapshots").glob("*") if p.is_dir())
        hint = f" It holds other commits ({', '.join(others)}): set model.revision to one." \
            if others else ""
        raise ModelError(
            f"model.path={repo!r} (revision {ref!r}): the Hugging Face hub cannot be reached "
            f"({reason}) and {repo_dir} holds no verified snapshot of that revision.{hint} "
            "Fix: download it once where the hub is reachable, with the same "
            f"storage.cache_dir (`grpoflow download-model --uri {repo}`), then run here "
            "with HF_HUB_OFFLINE=1; or set model.path to a local HF directory.")
    when = f", resolved {recorded['resolved_at']}" if recorded else ""
    log.warning("the hub cannot be reached (%s); using the cached snapshot of %s@%s (%s%s)",
                reason, repo, ref, sha[:12], when)
    return dataclasses.replace(snap, cached=True, offline=True)


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
    if (problem := _manifest_problem(d)) is not None:
        log.warning("cached snapshot %s is damaged (%s); discarding it", d, problem)
        gone = repo_dir / "tmp" / _tmp_name("discard")
        gone.parent.mkdir(parents=True, exist_ok=True)
        os.rename(d, gone)  # out of the way in one rename, then deleted
        shutil.rmtree(gone, ignore_errors=True)
        return None
    verify_model_dir(d, trust_remote_code=trust_remote_code)
    key = json.loads((d / MANIFEST).read_text())["key"]
    return ModelSnapshot(d, key, "hub", repo, sha, cached=True)


def _tmp_name(label: str) -> str:
    # '~' cannot occur in a commit sha, a host name or a pid: the name parses back.
    return f"{label}~{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"


def _remove_stale(tmp_root: Path) -> None:
    """Delete tmp/ entries of processes on this host that no longer run (killed downloads)."""
    host = socket.gethostname()
    for entry in tmp_root.glob("*~*~*~*"):
        _, entry_host, pid, _ = entry.name.split("~", 3)
        if entry_host == host and pid.isdigit() and not pid_alive(int(pid)):
            log.info("removing %s, left by an interrupted download", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _install_snapshot(repo_dir: Path, sha: str, fill: Callable[[Path], None],
                      origin: dict[str, str], trust_remote_code: bool) -> tuple[Path, str]:
    """Fill a tmp/ entry, verify it, write its manifest, rename it to snapshots/<sha> (the
    commit point: snapshots/ never holds a partial download)."""
    tmp_root = repo_dir / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    _remove_stale(tmp_root)
    tmp, final = tmp_root / _tmp_name(sha), repo_dir / "snapshots" / sha
    try:
        fill(tmp)
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
        try:
            verify_model_dir(tmp, trust_remote_code=trust_remote_code)
        except ModelError as exc:
            raise ModelError(f"{origin['source']}@{sha[:12]} was downloaded but: {exc}") from exc
        files = file_manifest(tmp)
        key = _content_key(files)
        (tmp / MANIFEST).write_text(json.dumps({**origin, "key": key, "files": files}, indent=1,
                                               sort_keys=True))
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
