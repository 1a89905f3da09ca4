"""Checkpoints: complete or invisible, verified, pruned; RNG states round-trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_core.checkpoint import (
    CheckpointError,
    CheckpointState,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    restore_rng,
    verify_checkpoint,
    write_checkpoint,
)


def _state(step: int) -> CheckpointState:
    return CheckpointState(
        step=step, weight_version=step, sampler={"seed": 0, "epoch": 1, "position": 3},
        config_digest="abc", train_digest="def",
    )


def _payload(tmp: Path) -> None:
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_bytes(b"w" * 1000)


def test_write_then_load(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, _state(4), _payload)
    assert path.name == "step-000004" and latest_checkpoint(tmp_path) == path
    state, rng = load_checkpoint_state(path)
    assert state == _state(4)
    assert set(rng) == {"python", "numpy", "torch"}
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"model/weights.bin", "rng.pt", "state.json"}


def test_a_crash_while_writing_leaves_nothing_visible(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, _state(2), _payload)

    def dies(tmp: Path) -> None:
        _payload(tmp)
        raise KeyboardInterrupt  # e.g. the process is told to stop half-way

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, _state(4), dies)
    assert latest_checkpoint(tmp_path).name == "step-000002"
    assert not list(tmp_path.glob("*.partial-*"))


def test_directories_without_manifest_are_never_resumed_from(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, _state(2), _payload)
    # What SIGKILL leaves behind: a partial directory, or a step directory with no manifest.
    (tmp_path / "step-000004.partial-1234").mkdir()
    (tmp_path / "step-000006").mkdir()
    (tmp_path / "step-000006" / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step-000002"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002"]


def test_keep_last(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        write_checkpoint(tmp_path, _state(step), _payload, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000008"]


def test_a_corrupted_file_is_detected(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, _state(2), _payload)
    (path / "model" / "weights.bin").write_bytes(b"x" * 1000)
    with pytest.raises(CheckpointError, match="weights.bin does not match the manifest"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError):
        load_checkpoint_state(path)


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, _state(2), _payload)
    path = write_checkpoint(tmp_path, _state(2), _payload)
    assert [p.name for p in list_checkpoints(tmp_path)] == [path.name]


def test_rng_round_trip() -> None:
    saved = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


class _Linear:
    """A trainer as the checkpoint sees one: ``save_state``/``load_state`` of a real module."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(3, 2)

    def save_state(self, path: Path) -> None:
        torch.save(self.model.state_dict(), Path(path) / "model.pt")

    def load_state(self, path: Path) -> None:
        self.model.load_state_dict(torch.load(Path(path) / "model.pt"))


class _Tokenizer:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "tokenizer.json").write_text("{}")


def test_training_state_round_trip_refuses_other_data_and_warns_on_another_config(
    tmp_path: Path, caplog
) -> None:
    from rl_core.checkpoint import restore_training, save_training

    trainer = _Linear()
    extra = lambda tmp: (tmp / "rollouts.json").write_text("[]")  # noqa: E731
    torch.manual_seed(7)
    path = save_training(tmp_path, trainer, _Tokenizer(), _state(3), keep_last=2, cache_dir=None,
                         extra=extra)
    assert {"model.pt", "model/tokenizer.json", "rollouts.json"} <= set(
        json.loads((Path(path) / "MANIFEST.json").read_text())["files"])
    expected = torch.rand(1)
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    with pytest.raises(CheckpointError, match="skip or repeat rows"):
        restore_training(path, _Linear(), config_digest="abc", train_digest="other",
                         cache_dir=None)
    other = _Linear()
    seen: list[float] = []
    state, local = restore_training(
        path, other, config_digest="changed", train_digest="def", cache_dir=None,
        after_load=lambda s: seen.append(float(torch.rand(1))))  # before the RNG is restored
    assert state == _state(3) and local == Path(path) and len(seen) == 1
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, saved[k])
    assert torch.rand(1) == expected  # the RNG stands where the checkpoint was written
    assert "differs from the one that wrote it" in caplog.text
