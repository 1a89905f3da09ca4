"""Storage over URIs, against a real S3-compatible HTTP server (moto, a subprocess on 127.0.0.1).

Round trips with SHA-256 manifests (multipart included), a corrupted object and an interrupted
upload refused, checkpoints on S3 (write, latest, keep-last-K, resume with a real trainer),
data and models read from S3, and credentials kept out of errors and logs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import boto3
import pytest
import torch
from engine_helpers import save_tiny_model

from rl_core import storage
from rl_core.checkpoint import (
    CheckpointError,
    CheckpointState,
    fetch_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    verify_checkpoint,
    write_checkpoint,
)
from rl_core.data.sources import load_records, write_parquet
from rl_core.data.synthetic import generate_arithmetic
from rl_core.models.hub import MANIFEST as MODEL_MANIFEST
from rl_core.models.hub import ModelError, download_model

# The moto server fixtures (s3_server, s3_bucket) live in tests/s3_server.py.
pytest_plugins = ["s3_server"]

MIB = 1 << 20


def _s3() -> object:
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def _keys(bucket: str, prefix: str = "") -> list[str]:
    resp = _s3().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _sample_dir(root: Path, big: int = 6 * MIB) -> Path:
    root.mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    (root / "sub").mkdir()
    (root / "sub" / "b.bin").write_bytes(bytes(range(256)) * 40)
    (root / "big.bin").write_bytes(os.urandom(big))
    return root


# ---------------------------------------------------------------- no server needed


def test_uris_and_local_paths_share_one_api(tmp_path: Path) -> None:
    assert storage.is_remote("s3://b/x") and storage.is_remote("S3://b/x")
    assert not storage.is_remote("/tmp/x") and not storage.is_remote(tmp_path)
    assert storage.join("s3://b/ckpt/", "step-000002", "MANIFEST.json") == (
        "s3://b/ckpt/step-000002/MANIFEST.json"
    )
    assert storage.join(str(tmp_path), "a") == str(tmp_path / "a")
    src = _sample_dir(tmp_path / "src", big=1000)
    manifest = storage.upload_dir(src, tmp_path / "dst")
    assert set(manifest["files"]) == {"a.txt", "sub/b.bin", "big.bin"}
    assert storage.list_dirs(tmp_path / "dst") == ["sub"]
    got = storage.download_dir(tmp_path / "dst", tmp_path / "back")
    assert got["verified"] == "sha256"
    assert {k: v for k, v in _tree(tmp_path / "back").items() if k != "MANIFEST.json"} == _tree(src)
    (tmp_path / "dst" / "a.txt").write_text("tampered")
    with pytest.raises(storage.ChecksumMismatch, match="a.txt"):
        storage.download_dir(tmp_path / "dst", tmp_path / "again")
    assert not (tmp_path / "again").exists()


# ---------------------------------------------------------------- S3 round trips


def test_round_trip_with_multipart_and_manifest_last(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _sample_dir(tmp_path / "src")
    uri = f"s3://{s3_bucket}/dirs/run1"
    seen_at_manifest: list[list[str]] = []
    real_write = storage.write_bytes

    def spy(target: str, data: bytes) -> None:
        if str(target).endswith("MANIFEST.json"):
            seen_at_manifest.append(_keys(s3_bucket, "dirs/run1/"))
        real_write(target, data)

    monkeypatch.setattr(storage, "write_bytes", spy)
    manifest = storage.upload_dir(
        src, uri, multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB
    )
    # The manifest went last: every file was already there when it was written.
    assert seen_at_manifest == [["dirs/run1/a.txt", "dirs/run1/big.bin", "dirs/run1/sub/b.bin"]]
    big = _s3().head_object(Bucket=s3_bucket, Key="dirs/run1/big.bin")
    assert "-" in big["ETag"], "a 6 MiB file above a 5 MiB threshold goes multipart"
    assert storage.exists(uri) and storage.exists(storage.join(uri, "a.txt"))
    assert not storage.exists(storage.join(uri, "nope"))
    assert storage.list_dirs(uri) == ["sub"]
    assert [f.name for f in storage.list_files(uri)] == [
        "MANIFEST.json",
        "a.txt",
        "big.bin",
        "sub/b.bin",
    ]

    got = storage.download_dir(uri, tmp_path / "back", multipart_threshold=5 * MIB)
    assert got["verified"] == "sha256" and got["files"] == manifest["files"]
    back = _tree(tmp_path / "back")
    assert json.loads(back.pop("MANIFEST.json"))["files"] == manifest["files"]
    assert back == _tree(src)
    assert storage.delete_prefix(uri) == 4 and not storage.exists(uri)


def test_a_corrupted_object_is_refused_by_name(s3_bucket: str, tmp_path: Path) -> None:
    src = _sample_dir(tmp_path / "src", big=1000)
    uri = f"s3://{s3_bucket}/dirs/run2"
    storage.upload_dir(src, uri)
    data = bytearray((src / "sub" / "b.bin").read_bytes())
    data[100] ^= 0xFF  # same size, one byte flipped, written behind grpoflow's back
    _s3().put_object(Bucket=s3_bucket, Key="dirs/run2/sub/b.bin", Body=bytes(data))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("previous good copy")
    with pytest.raises(storage.ChecksumMismatch, match=r"sub/b\.bin does not match its SHA-256"):
        storage.download_dir(uri, dest)
    assert _tree(dest) == {"keep.txt": b"previous good copy"}, "destination left untouched"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_prefix_without_manifest_is_never_downloaded(s3_bucket: str, tmp_path: Path) -> None:
    src = _sample_dir(tmp_path / "src", big=1000)
    uri = f"s3://{s3_bucket}/dirs/interrupted"
    for name in ("a.txt", "sub/b.bin"):  # the upload died before big.bin and the manifest
        storage.upload_file(src / name, storage.join(uri, name))
    with pytest.raises(storage.ManifestMissing, match="no MANIFEST.json"):
        storage.download_dir(uri, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    # Explicitly opting out (a directory another tool uploaded): sizes are checked instead.
    got = storage.download_dir(uri, tmp_path / "dest", require_manifest=False)
    assert got["verified"] == "size" and set(_tree(tmp_path / "dest")) == {"a.txt", "sub/b.bin"}


# ---------------------------------------------------------------- checkpoints on S3


def _state(step: int) -> CheckpointState:
    return CheckpointState(
        step=step,
        weight_version=step,
        sampler={"seed": 0, "epoch": 1, "position": step},
        config_digest="abc",
        train_digest="def",
    )


def _payload(tmp: Path) -> None:
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(b"w" * 1000)


def _step_names(bucket: str, prefix: str) -> list[str]:
    return storage.list_dirs(f"s3://{bucket}/{prefix}")


def test_checkpoint_keep_last_on_s3(s3_bucket: str, tmp_path: Path) -> None:
    root = f"s3://{s3_bucket}/ckpt"
    for step in (2, 4, 6, 8):
        uri = write_checkpoint(root, _state(step), _payload, keep_last=2, cache_dir=tmp_path)
        assert uri == f"{root}/step-{step:06d}"
    assert _step_names(s3_bucket, "ckpt") == ["step-000006", "step-000008"]
    assert list_checkpoints(root) == [f"{root}/step-000006", f"{root}/step-000008"]
    assert latest_checkpoint(root) == f"{root}/step-000008"
    assert verify_checkpoint(f"{root}/step-000008")["step"] == 8


def test_an_interrupted_checkpoint_upload_is_never_used(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"s3://{s3_bucket}/ckpt"
    write_checkpoint(root, _state(2), _payload, cache_dir=tmp_path)
    real_write = storage.write_bytes

    def killed_before_manifest(target: str, data: bytes) -> None:
        if str(target).endswith("MANIFEST.json"):
            raise KeyboardInterrupt  # the process is stopped between the files and the manifest
        real_write(target, data)

    monkeypatch.setattr(storage, "write_bytes", killed_before_manifest)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(root, _state(4), _payload, cache_dir=tmp_path)
    monkeypatch.setattr(storage, "write_bytes", real_write)
    assert "ckpt/step-000004/model/weights.bin" in _keys(s3_bucket, "ckpt/")  # files, no manifest
    assert latest_checkpoint(root) == f"{root}/step-000002"
    assert list_checkpoints(root) == [f"{root}/step-000002"]
    with pytest.raises(CheckpointError, match="incomplete"):
        fetch_checkpoint(f"{root}/step-000004", tmp_path / "fetch")
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(f"{root}/step-000004")
    # The next complete checkpoint prunes the interrupted one (older than the newest complete).
    write_checkpoint(root, _state(6), _payload, keep_last=2, cache_dir=tmp_path)
    assert _step_names(s3_bucket, "ckpt") == ["step-000002", "step-000006"]
    # A re-run of a step replaces it whole: no stale manifest ever vouches for new files.
    write_checkpoint(root, _state(6), _payload, keep_last=2, cache_dir=tmp_path)
    assert latest_checkpoint(root) == f"{root}/step-000006"


def test_resume_a_trainer_from_an_s3_checkpoint(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.training.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    base = save_tiny_model(tmp_path / "base")
    trainer = TorchTrainer(base, TrainConfig(lr=1e-2), AlgorithmConfig())
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)  # weights that differ from the base model
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    root = f"s3://{s3_bucket}/runs/r1/checkpoints"
    cache = tmp_path / "cache"
    uri = write_checkpoint(root, _state(3), trainer.save_state, cache_dir=cache)

    # Another machine: an empty cache, so the checkpoint is downloaded and verified.
    other_cache = tmp_path / "other-cache"
    latest = latest_checkpoint(root)
    assert latest == uri
    local = fetch_checkpoint(latest, other_cache)
    assert local.is_relative_to(other_cache) and (local / "MANIFEST.json").is_file()
    state, rng = load_checkpoint_state(local)
    assert state == _state(3) and set(rng) == {"python", "numpy", "torch"}
    assert load_checkpoint_state(latest, cache_dir=other_cache)[0] == state
    fresh = TorchTrainer(base, TrainConfig(lr=1e-2), AlgorithmConfig())
    fresh.load_state(local)
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, trained[name]), name

    # The writer kept its uploaded copy: a restart there downloads nothing.
    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("the verified local copy should have been used")

    monkeypatch.setattr(storage, "download_dir", no_download)
    assert fetch_checkpoint(uri, cache).is_relative_to(cache)


# ---------------------------------------------------------------- data and models from S3

ROWS = [
    {"id": "r1", "question": "1+1?", "answer": "#### 2"},
    {"id": "r2", "question": "2+2?", "answer": "#### 4"},
    {"id": "r3", "question": "3+3?", "answer": "#### 6"},
]


def _triples(records: list) -> list[tuple]:
    return [(r.id, r.question, r.answer) for r in records]


def test_data_sources_from_s3(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jsonl = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    storage.write_bytes(f"s3://{s3_bucket}/data/train.jsonl", jsonl)
    records = generate_arithmetic(5, seed=1)
    write_parquet(records, tmp_path / "test.parquet")
    storage.upload_file(tmp_path / "test.parquet", f"s3://{s3_bucket}/data/test.parquet")
    cache = tmp_path / "cache"

    got = load_records(f"s3://{s3_bucket}/data/train.jsonl", cache_dir=cache)
    assert [r.id for r in got] == ["r1", "r2", "r3"]
    got = load_records(f"s3://{s3_bucket}/data/test.parquet", "test", cache_dir=cache)
    assert _triples(got) == _triples(records)
    # A prefix laid out like a local directory: {split}.jsonl / {split}.parquet.
    assert len(load_records(f"s3://{s3_bucket}/data", "train", cache_dir=cache)) == 3
    assert _triples(load_records(f"s3://{s3_bucket}/data/", "test", cache_dir=cache)) == \
        _triples(records)

    # Cached by ETag and size: unchanged objects are not downloaded again ...
    real_download = storage.download_file

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("unchanged object downloaded again")

    monkeypatch.setattr(storage, "download_file", no_download)
    assert len(load_records(f"s3://{s3_bucket}/data/train.jsonl", cache_dir=cache)) == 3
    # ... a changed one is.
    monkeypatch.setattr(storage, "download_file", real_download)
    storage.write_bytes(f"s3://{s3_bucket}/data/train.jsonl", jsonl + jsonl.replace(b'"r', b'"s'))
    assert len(load_records(f"s3://{s3_bucket}/data/train.jsonl", cache_dir=cache)) == 6

    # Bad rows are reported against the S3 URI, not the cache path.
    storage.write_bytes(f"s3://{s3_bucket}/bad/train.jsonl", b'{"question": "q"}\n')
    with pytest.raises(ValueError, match=rf"s3://{s3_bucket}/bad/train\.jsonl"):
        load_records(f"s3://{s3_bucket}/bad/train.jsonl", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_records(f"s3://{s3_bucket}/nothing/here.jsonl", cache_dir=cache)


def test_model_download_from_s3_into_the_cache(s3_bucket: str, tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "model")
    uri = f"s3://{s3_bucket}/models/tiny"
    storage.upload_dir(model_dir, uri)
    cache = tmp_path / "cache"

    snap = download_model(uri, cache)
    assert snap.kind == "s3" and snap.source == uri and not snap.cached
    assert snap.path.is_relative_to(cache / "models" / "s3")
    assert (snap.path / MODEL_MANIFEST).is_file()
    got = {k: v for k, v in _tree(snap.path).items() if k not in (MODEL_MANIFEST, "MANIFEST.json")}
    assert got == _tree(model_dir)
    again = download_model(uri + "/", cache)
    assert again.cached and again.path == snap.path and again.key == snap.key

    # A changed object makes a new snapshot; a corrupted one is refused, never installed.
    data = bytearray((model_dir / "config.json").read_bytes())
    _s3().put_object(Bucket=s3_bucket, Key="models/tiny/config.json", Body=bytes(data + b" "))
    with pytest.raises(ModelError, match=r"config\.json has .* bytes, the manifest says"):
        download_model(uri, cache)
    assert [p.name for p in (snap.path.parent).iterdir()] == [snap.path.name]

    # A model synced by another tool (no MANIFEST.json): sizes checked, then it must load.
    synced = f"s3://{s3_bucket}/models/synced"
    for f in sorted(model_dir.iterdir()):
        storage.upload_file(f, storage.join(synced, f.name))
    other = download_model(synced, cache)
    assert other.kind == "s3" and other.key == snap.key  # same files, same content key


# ---------------------------------------------------------------- failures and credentials


def test_credentials_never_reach_errors_or_logs(
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key_id, secret = "AKIAGRPOFLOWTEST1234", "grpoflowSecretValue/DoNotLeak+42"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    storage.reset_clients()
    caplog.set_level(logging.DEBUG, logger="rl_core")
    caplog.set_level(logging.INFO)
    bad = "s3://grpoflow-no-such-bucket/ckpt"

    with pytest.raises(CheckpointError) as info:
        write_checkpoint(bad, _state(2), _payload, cache_dir=tmp_path)
    message = str(info.value)
    assert "does not exist; create the bucket" in message and "checkpoint.uri=" in message
    with pytest.raises(storage.NotFound) as missing:
        storage.download_dir(f"{bad}/step-000002", tmp_path / "x")
    with pytest.raises(FileNotFoundError) as data_error:
        load_records(f"{bad}/train.jsonl", cache_dir=tmp_path)
    for text in (message, str(missing.value), str(data_error.value), caplog.text):
        assert key_id not in text and secret not in text
        assert "IOSFODNN" not in text
    assert info.value.__suppress_context__, "raw boto3 errors are not chained into tracebacks"


def test_an_unreachable_endpoint_fails_fast_and_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens here once the socket closes
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:pw123456@127.0.0.1:{closed}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage.reset_clients()
    try:
        with pytest.raises(storage.Unreachable, match="AWS_ENDPOINT_URL") as info:
            storage.list_dirs("s3://bucket/ckpt")
        assert "pw123456" not in str(info.value)
        with pytest.raises(CheckpointError, match="cannot be reached"):
            latest_checkpoint("s3://bucket/ckpt")
    finally:
        storage.reset_clients()
