"""The content-keyed model cache: hub snapshots by (repo id, commit sha), local dirs by digest.

The hub's metadata API is a local HTTP server answered by the real ``HfApi.model_info`` (so
connection failures, 404s and 5xx take the real client's path); only ``snapshot_download``
is replaced, by a copy of a tiny model directory. Nothing is fetched from the internet.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import tiny_qwen2, tiny_tokenizer

from rl_core.models.hub import MANIFEST, ModelError, download_model, verify_model_dir

ROOT = Path(__file__).resolve().parents[1]
REPO = "someorg/tiny-model"
SHA_A, SHA_B = "a" * 40, "b" * 40
TOKEN = "hf_SECRETtoken1234567890"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Two loadable tiny HF model directories that differ in their weights."""
    root = tmp_path_factory.mktemp("hub-content")
    out = {}
    for sha, seed in ((SHA_A, 0), (SHA_B, 1)):
        d = root / sha
        tiny_qwen2(seed).save_pretrained(d)
        tiny_tokenizer().save_pretrained(d)
        out[sha] = d
    return out


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


class FakeHub:
    """``/api/models/<repo>/revision/<ref>`` over HTTP, plus a copying snapshot_download."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, commits: dict[str, Path]) -> None:
        import huggingface_hub
        from huggingface_hub import constants

        self.commits = commits
        self.refs = {"main": SHA_A, "v1": SHA_A}
        self.status: int | None = None  # force this HTTP status on model_info
        self.requests: list[tuple[str, str | None]] = []
        self.downloads: list[str] = []
        self.break_after: int | None = None  # copy this many files, then drop the connection
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if not self.path.startswith("/api/models/"):  # the client's own side calls
                    return self._send(404, {"error": "not here"})
                hub.requests.append((self.path, self.headers.get("authorization")))
                prefix = f"/api/models/{REPO}/revision/"
                ref = unquote(self.path.split("?")[0][len(prefix) :])
                if hub.status is not None:
                    self._send(hub.status, {"error": "forced"})
                elif not self.path.startswith(prefix):
                    self._send(404, {"error": "Repository not found"}, "RepoNotFound")
                elif ref not in hub.refs and ref not in hub.commits:
                    self._send(404, {"error": "Invalid rev id"}, "RevisionNotFound")
                else:
                    self._send(200, {"id": REPO, "sha": hub.refs.get(ref, ref)})

            def _send(self, status: int, body: dict, code: str | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                if code:
                    self.send_header("X-Error-Code", code)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._monkeypatch = monkeypatch
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def snapshot_download(self, repo_id, *, revision, local_dir, allow_patterns, token):  # noqa: ANN001
        assert repo_id == REPO and token == TOKEN, "the repo id and the token are passed on"
        self.downloads.append(revision)
        out = Path(local_dir)
        (out / ".cache" / "huggingface").mkdir(parents=True)  # the real one keeps metadata here
        src = self.commits[revision]  # the cache asks for the resolved commit, never a branch
        files = [
            f
            for f in sorted(src.iterdir())
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns)
        ]
        for i, f in enumerate(files):
            if self.break_after is not None and i == self.break_after:
                raise ConnectionError("connection reset by peer")
            shutil.copy(f, out / f.name)
        return str(out)

    def offline(self) -> None:
        from huggingface_hub import constants

        self._monkeypatch.setattr(constants, "ENDPOINT", _closed_port_url())

    def online(self) -> None:
        from huggingface_hub import constants

        self._monkeypatch.setattr(constants, "ENDPOINT", self.url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path]):
    fake = FakeHub(monkeypatch, model_dirs)
    yield fake
    fake.close()


def _get(cache: Path, revision: str | None = None):
    return download_model(REPO, cache, revision=revision, token=TOKEN)


def _snapshot_dir(cache: Path, sha: str) -> Path:
    return cache / "models" / "hf" / REPO.replace("/", "--") / "snapshots" / sha


def test_second_call_with_the_same_commit_is_a_verified_cache_hit(
    hub: FakeHub, tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    first = _get(tmp_path)
    assert (first.cached, first.revision, first.kind) == (False, SHA_A, "hub")
    assert first.path == _snapshot_dir(tmp_path, SHA_A)
    assert hub.downloads == [SHA_A]
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert manifest["source"] == f"hf://{REPO}" and manifest["sha"] == SHA_A
    assert manifest["revision"] == "main" and manifest["key"] == first.key
    weights = model_dirs[SHA_A] / "model.safetensors"
    assert manifest["files"]["model.safetensors"]["size"] == weights.stat().st_size
    assert not (first.path / ".cache").exists()

    again = _get(tmp_path)
    assert again.cached and again.path == first.path and again.key == first.key
    assert hub.downloads == [SHA_A]
    # A tag that resolves to the same commit reuses the same snapshot too.
    assert _get(tmp_path, "v1").path == first.path and hub.downloads == [SHA_A]
    # The hub was asked which commit each name means; the token went with the request.
    assert [p.split("/revision/")[1] for p, _ in hub.requests] == ["main", "main", "v1"]
    assert all(auth == f"Bearer {TOKEN}" for _, auth in hub.requests)


def test_a_moved_branch_downloads_the_new_commit(hub: FakeHub, tmp_path: Path) -> None:
    a = _get(tmp_path)
    hub.refs["main"] = SHA_B
    b = _get(tmp_path)
    assert not b.cached and b.revision == SHA_B and hub.downloads == [SHA_A, SHA_B]
    assert b.path == _snapshot_dir(tmp_path, SHA_B) and b.key != a.key
    # The old commit is still there, addressable by its sha.
    old = _get(tmp_path, SHA_A)
    assert old.cached and old.path == a.path and old.key == a.key


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "no-manifest"])
def test_a_damaged_snapshot_is_detected_and_downloaded_again(
    hub: FakeHub, tmp_path: Path, model_dirs: dict[str, Path], damage: str, caplog
) -> None:
    snap = _get(tmp_path)
    weights = snap.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":  # same size, one byte off: only the sha256 can tell
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        weights.unlink()
    else:
        (snap.path / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="rl_core.models.hub"):
        again = _get(tmp_path)
    assert "damaged" in caplog.text
    assert not again.cached and hub.downloads == [SHA_A, SHA_A]
    assert again.key == snap.key
    assert weights.read_bytes() == (model_dirs[SHA_A] / "model.safetensors").read_bytes()


def test_a_damaged_snapshot_is_never_used_offline(hub: FakeHub, tmp_path: Path) -> None:
    snap = _get(tmp_path)
    (snap.path / "tokenizer.json").write_text("{}")
    hub.offline()
    with pytest.raises(ModelError, match="no verified snapshot"):
        _get(tmp_path)
    assert not snap.path.exists()


def test_a_failed_download_leaves_nothing_that_looks_complete(hub: FakeHub, tmp_path: Path) -> None:
    hub.break_after = 2
    with pytest.raises(ConnectionError):
        _get(tmp_path)
    repo_dir = tmp_path / "models" / "hf" / REPO.replace("/", "--")
    assert not (repo_dir / "snapshots" / SHA_A).exists()
    assert list((repo_dir / "tmp").iterdir()) == []
    hub.break_after = None
    assert not _get(tmp_path).cached and hub.downloads == [SHA_A, SHA_A]


def test_a_killed_download_is_never_used_and_is_cleaned_up(
    hub: FakeHub, tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    """SIGKILL half-way through: no cleanup code runs, yet the partial copy is never used."""
    cache, started = tmp_path / "cache", tmp_path / "started"
    script = f"""
import shutil, time
from pathlib import Path
import huggingface_hub
from huggingface_hub import constants
constants.ENDPOINT = {hub.url!r}
def half(repo_id, *, revision, local_dir, **kw):
    src, out = Path({str(model_dirs[SHA_A])!r}), Path(local_dir)
    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    weights = (src / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    Path({str(started)!r}).write_text("half-way")
    time.sleep(600)
huggingface_hub.snapshot_download = half
from rl_core.models.hub import download_model
download_model({REPO!r}, {str(cache)!r}, token="x")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "0"}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 180
        while not started.exists():
            assert proc.poll() is None, "the downloader exited before it was killed"
            assert time.monotonic() < deadline, "the downloader never started"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    tmp_root = cache / "models" / "hf" / REPO.replace("/", "--") / "tmp"
    [partial] = list(tmp_root.iterdir())
    assert (partial / "model.safetensors").is_file()
    assert not _snapshot_dir(cache, SHA_A).exists()

    hub.offline()
    with pytest.raises(ModelError, match="no verified snapshot"):
        _get(cache)
    hub.online()
    snap = _get(cache)
    assert not snap.cached and hub.downloads == [SHA_A]
    assert not partial.exists(), "the dead process's tmp entry is removed"
    assert verify_model_dir(snap.path) == snap.path


@pytest.mark.parametrize("how", ["unreachable", "HF_HUB_OFFLINE", "server error"])
def test_offline_uses_the_last_resolved_snapshot_and_says_so(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, how: str
) -> None:
    hub.refs["main"] = SHA_B
    online = _get(tmp_path)
    asked = len(hub.requests)
    if how == "unreachable":
        hub.offline()
    elif how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        hub.status = 503
    with caplog.at_level(logging.WARNING, logger="rl_core.models.hub"):
        snap = _get(tmp_path)
    assert snap.offline and snap.cached and snap.revision == SHA_B
    assert snap.path == online.path and snap.key == online.key
    assert "cannot be reached" in caplog.text and SHA_B[:12] in caplog.text
    assert hub.downloads == [SHA_B]
    if how == "HF_HUB_OFFLINE":
        assert len(hub.requests) == asked, "offline mode does not ask the hub"


def test_a_cached_commit_needs_no_hub(hub: FakeHub, tmp_path: Path) -> None:
    _get(tmp_path, SHA_A)
    asked = len(hub.requests)
    hub.offline()
    snap = _get(tmp_path, SHA_A)
    assert snap.cached and not snap.offline and snap.revision == SHA_A
    assert len(hub.requests) == asked


def test_offline_without_a_cached_copy_fails_with_the_fix(hub: FakeHub, tmp_path: Path) -> None:
    _get(tmp_path)  # main -> SHA_A is cached; v2 never was
    hub.offline()
    with pytest.raises(ModelError) as err:
        _get(tmp_path, "v2")
    msg = str(err.value)
    for needed in (
        f"model.path={REPO!r}",
        "'v2'",
        "cannot be reached",
        "HF_HUB_OFFLINE=1",
        f"download-model --uri {REPO}",
        SHA_A,
        "model.revision",
    ):
        assert needed in msg, needed
    assert TOKEN not in msg


def test_hub_refusals_name_the_fix_and_do_not_fall_back(hub: FakeHub, tmp_path: Path) -> None:
    _get(tmp_path)
    with pytest.raises(ModelError, match="has no revision 'nope'; fix model.revision"):
        _get(tmp_path, "nope")
    with pytest.raises(ModelError, match="not a model on the hub, or it is private.*HF_TOKEN"):
        download_model("someorg/other", tmp_path, token=TOKEN)
    hub.status = 403
    with pytest.raises(ModelError, match="refused"):
        _get(tmp_path)


def test_the_token_is_never_logged_or_stored(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with caplog.at_level(logging.DEBUG):
        _get(tmp_path)
        hub.status = 500
        _get(tmp_path)
        hub.offline()
        with pytest.raises(ModelError) as err:
            _get(tmp_path, "v2")
    assert caplog.text and TOKEN not in caplog.text and TOKEN not in str(err.value)
    for f in tmp_path.rglob("*"):
        assert not f.is_file() or TOKEN.encode() not in f.read_bytes(), f


def test_a_download_that_does_not_load_is_not_installed(
    hub: FakeHub, tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dirs[SHA_A], broken)
    (broken / "tokenizer.json").unlink()
    hub.commits = {**hub.commits, SHA_B: broken}
    hub.refs["main"] = SHA_B
    with pytest.raises(ModelError, match=f"hf://{REPO}@{SHA_B[:12]} was downloaded but.*tokenizer"):
        _get(tmp_path / "cache")
    assert not _snapshot_dir(tmp_path / "cache", SHA_B).exists()


def test_local_dir_is_keyed_by_its_content(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    d = tmp_path / "local"
    shutil.copytree(model_dirs[SHA_A], d)
    first = download_model(str(d), tmp_path / "cache")
    assert first.path == d and first.kind == "local" and first.revision is None
    assert download_model(str(d), tmp_path / "cache").key == first.key
    (d / ".git").mkdir()  # VCS metadata is not content
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert download_model(str(d), tmp_path / "cache").key == first.key

    config = json.loads((d / "config.json").read_text())
    config["rope_theta"] = 12345.0
    (d / "config.json").write_text(json.dumps(config))
    changed = download_model(str(d), tmp_path / "cache")
    assert changed.key != first.key
    (d / "extra.txt").write_text("x")
    assert download_model(str(d), tmp_path / "cache").key not in (first.key, changed.key)
    # Same files elsewhere, same key: the key is the content, not the place.
    shutil.copytree(model_dirs[SHA_A], tmp_path / "copy")
    assert download_model(str(tmp_path / "copy"), tmp_path / "cache").key == first.key


def test_local_dir_must_load(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    d = tmp_path / "local"
    shutil.copytree(model_dirs[SHA_A], d)
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ModelError, match="does not load as safetensors"):
        download_model(str(d), tmp_path / "cache")
    (d / "model.safetensors").write_bytes(weights)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="lacks weight shards"):
        download_model(str(d), tmp_path / "cache")


def test_fetch_model_task_says_when_it_skips_the_download(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rl_core.config import load_config
    from tasks import setup

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    # Prefect's logging setup replaces the root handlers (caplog's too): listen directly.
    logger = logging.getLogger("test.fetch_model")
    logger.setLevel(logging.INFO)
    handler = Collect()
    logger.addHandler(handler)
    monkeypatch.setattr(setup, "get_run_logger", lambda: logger)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    cfg = load_config(None, [f"model.path={REPO}"])
    try:
        first = setup.fetch_model.fn(cfg.model, cfg.data, str(tmp_path), "v1")
        second = setup.fetch_model.fn(cfg.model, cfg.data, str(tmp_path), "v1")
        hub.offline()
        third = setup.fetch_model.fn(cfg.model, cfg.data, str(tmp_path), "v1")
    finally:
        logger.removeHandler(handler)
    assert first == second == third == str(_snapshot_dir(tmp_path, SHA_A))
    assert len(lines) == 3 and hub.downloads == [SHA_A]
    assert f"{REPO}@{SHA_A[:12]} ready in" in lines[0]
    assert "skipping the download" in lines[1] and "content key" in lines[1]
    assert "cannot be reached" in lines[2]
    assert not any(TOKEN in line for line in lines)
