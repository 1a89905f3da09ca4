"""The weight sync's behavioural probe (rl_core/weight_sync/probe.py), on every transport.

A fault hook in the engine (``GRPOFLOW_SYNC_FAULTS``, rl_core/engine/faults.py) corrupts the
weights an engine loaded after their bytes arrived and were checksummed: a permuted or a
transposed tensor, two experts swapped, a LoRA adapter not applied, a derived cache not
dropped. Each must pass the checksum, fail the probe naming the engine and the size of the
difference, and be recovered (a reload; a fault that survives the reload: the engine is
rebuilt), after which the engine computes exactly what the trainer does. Faults are planned
per weight version (deterministic); the engines record which one they took (``.claims``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from engine_helpers import save_tiny_model
from test_moe import save_moe
from test_rollout_planes import _http

from rl_core.config import AlgorithmConfig, LoraConfig, TrainConfig
from rl_core.engine.faults import FAULTS_ENV
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.weight_sync import WeightSyncError, sync_weights
from rl_core.weight_sync.probe import ProbeBatch, WeightProbe, compare
from rl_core.weight_sync.transports import DiskSync, SharedSync, TensorSync

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
TOLERANCE = 1e-3  # float32 (TOLERANCE["float32"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


@pytest.fixture
def plan(tmp_path, monkeypatch):
    """``plan((kind, version, times), ...)``: the faults the engines will take."""
    path = tmp_path / "faults.json"

    def write(*entries: tuple[str, int, int]) -> Path:
        path.write_text(json.dumps([{"kind": k, "version": v, "times": t} for k, v, t in entries]))
        monkeypatch.setenv(FAULTS_ENV, str(path))
        return path

    return write


def claims(path: Path) -> list[tuple[str, str]]:
    claimed = Path(f"{path}.claims")
    lines = claimed.read_text().splitlines() if claimed.exists() else []
    return [(c["kind"], c["version"]) for c in map(json.loads, lines)]


def probe() -> WeightProbe:
    return WeightProbe(ProbeBatch.from_prompts(PROMPTS), TOLERANCE)


def nudge(trainer: TorchTrainer, seed: int, scale: float = 0.05) -> None:
    """A fixed change of the trainer's (trainable) weights: a new version to sync."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def caught(caplog, version: int, engine: str) -> str:
    """The probe's error for ``version``, which names ``engine`` and the difference."""
    found = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
             and f"weight sync to version {version}:" in r.getMessage()]
    assert found, f"no probe failure logged for version {version}"
    assert engine in found[0] and "max |log p| difference" in found[0], found[0]
    return found[0]


def recovered(metrics: dict, faults: Path, kind: str, caplog, engine: str) -> None:  # noqa: ANN001
    """Version 1's sync took fault ``kind``: caught (naming ``engine``) and reloaded."""
    assert metrics["sync/probe_reloads"] == 1.0 and claims(faults) == [(kind, "1")]
    caught(caplog, 1, engine)


def behaves_as_trainer(trainer: TorchTrainer, plane) -> None:  # noqa: ANN001
    """The engine's log-probs of fresh greedy samples equal the trainer's (the fault is gone)."""
    p = probe()
    served = plane.probe(p.batch.prompt, p.batch.completions)
    for logps in served.values():
        assert compare(p.reference(trainer, -1), logps)[0] < 1e-4


def test_compare_and_the_batch() -> None:
    assert compare([[-1.0, -2.0]], [[-1.0, -2.5]]) == pytest.approx((0.5, (0.0 + (
        torch.tensor(-0.5).exp().item() - 1 + 0.5)) / 2))  # fmt: skip
    batch = ProbeBatch.from_prompts([[1, 2, 3]])  # one prompt: its own tokens complete it
    assert batch.prompt == [1, 2, 3] and batch.completions == [[1, 2, 3], [1, 2, 3]]
    with pytest.raises(ValueError, match="at least two tokens"):
        ProbeBatch.from_prompts([[1]])


# ------------------------------------------------------------------ in-process transports


def test_in_process_tensors_catch_each_fault_and_reload(model_dir, plan, caplog) -> None:
    faults = plan(("permute", 1, 1), ("transpose", 2, 1), ("stale_cache", 3, 1))
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    plane, check = InProcessPlane(model_dir, num_threads=1), probe()
    try:
        for version in (1, 2, 3, 4):
            nudge(trainer, version)
            metrics = sync_weights(trainer, plane, TensorSync(plane), version, check)
            faulted = version < 4
            assert metrics["sync/probe_reloads"] == (1.0 if faulted else 0.0), (version, metrics)
            assert metrics["sync/probe_max_abs_logp_diff"] < 1e-5  # after the reload: exact
            if faulted:
                caught(caplog, version, "the in-process engine")
            assert plane.weight_version == version
        assert claims(faults) == [("permute", "1"), ("transpose", "2"), ("stale_cache", "3")]
        behaves_as_trainer(trainer, plane)
        # a fault that survives the reload: the in-process engine cannot be rebuilt alone, so
        # the sync fails, and nothing samples from its weights until a sync succeeds
        plan(("permute", 5, 2))
        nudge(trainer, 5)
        with pytest.raises(WeightSyncError, match="cannot be rebuilt alone"):
            sync_weights(trainer, plane, TensorSync(plane), 5, check)
        with pytest.raises(WeightSyncError, match="not verified"):
            plane.generate(PROMPTS[:1], GREEDY)
        sync_weights(trainer, plane, TensorSync(plane), 5, check)  # the fault is spent
        assert plane.generate(PROMPTS[:1], GREEDY)[0].weight_version == 5
    finally:
        plane.close()


def test_shared_parameters_catch_a_cache_not_flushed(model_dir, plan, caplog) -> None:
    faults = plan(("stale_cache", 1, 1))
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    plane = InProcessPlane(model_dir, share=trainer.model, num_threads=1)
    try:
        plane.generate(PROMPTS, GREEDY)  # the engine derives its packed weights from v0
        nudge(trainer, 1)  # in place: the engine reads these parameters
        metrics = sync_weights(trainer, plane, SharedSync(trainer), 1, probe())
        recovered(metrics, faults, "stale_cache", caplog, "the in-process engine")
        behaves_as_trainer(trainer, plane)
    finally:
        plane.close()


def test_a_lora_adapter_not_applied_is_caught(model_dir, plan, caplog) -> None:
    faults = plan(("lora_off", 1, 1))
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0)),
                           AlgorithmConfig(), max_response_len=8)
    nudge(trainer, 1, scale=0.3)  # B starts at 0 (adapter == base): give it something to carry
    plane = InProcessPlane(model_dir, num_threads=1)
    try:
        metrics = sync_weights(trainer, plane, TensorSync(plane, "policy"), 1, probe())
        recovered(metrics, faults, "lora_off", caplog, "the in-process engine")
        behaves_as_trainer(trainer, plane)
    finally:
        plane.close()


def test_two_experts_swapped_are_caught(tmp_path, plan, caplog) -> None:
    moe = save_moe(tmp_path / "moe")
    faults = plan(("swap_experts", 1, 1))
    trainer = TorchTrainer(moe, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    plane = InProcessPlane(moe, num_threads=1)
    try:
        nudge(trainer, 1, scale=0.01)
        metrics = sync_weights(trainer, plane, TensorSync(plane), 1, probe())
        recovered(metrics, faults, "swap_experts", caplog, "the in-process engine")
        behaves_as_trainer(trainer, plane)
    finally:
        plane.close()


# ------------------------------------------------------------------ engine processes


def test_disk_catches_faults_reloads_then_rebuilds_the_engine(model_dir, plan, caplog,
                                                              tmp_path) -> None:
    faults = plan(("permute", 1, 1), ("stale_cache", 2, 1), ("transpose", 3, 2))
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    plane, sync = _http(model_dir, tmp_path)
    try:
        engine = f"engine 0 ({plane.pool.engines[0].url})"
        plane.generate(PROMPTS, GREEDY)  # packed weights derived from v0
        check = probe()
        for version in (1, 2):
            nudge(trainer, version)
            metrics = sync_weights(trainer, plane, sync, version, check)
            assert metrics["sync/probe_reloads"] == 1.0
            assert metrics["sync/probe_max_abs_logp_diff"] < 1e-5
            caught(caplog, version, engine)
        # transposed again after the reload: the engine is restarted and loads v3 afresh
        nudge(trainer, 3)
        metrics = sync_weights(trainer, plane, sync, 3, check)
        assert metrics["sync/probe_rebuilt_engines"] == 1.0 and plane.pool.engines[0].restarts == 1
        assert claims(faults) == [("permute", "1"), ("stale_cache", "2"), ("transpose", "3"),
                                  ("transpose", "3")]
        samples = plane.generate(PROMPTS, GREEDY)
        assert {s.weight_version for s in samples} == {3}
        behaves_as_trainer(trainer, plane)
    finally:
        plane.close()


def test_disk_lora_adapter_not_applied_is_caught(model_dir, plan, caplog, tmp_path) -> None:
    faults = plan(("lora_off", 1, 1))
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0)),
                           AlgorithmConfig(), max_response_len=8)
    nudge(trainer, 1, scale=0.3)
    plane, _ = _http(model_dir, tmp_path)
    sync = DiskSync(plane, tmp_path / "lora-staging", 60, "policy")
    plane.pool.resync = sync.resync
    try:
        metrics = sync_weights(trainer, plane, sync, 1, probe())
        recovered(metrics, faults, "lora_off", caplog, f"engine 0 ({plane.pool.engines[0].url})")
        behaves_as_trainer(trainer, plane)
    finally:
        plane.close()


def test_broadcast_catches_a_permuted_tensor(model_dir, plan, caplog, tmp_path) -> None:
    faults = plan(("permute", 1, 1))
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    plane, sync = _http(model_dir, tmp_path, transport="distributed")
    try:
        nudge(trainer, 1)
        metrics = sync_weights(trainer, plane, sync, 1, probe())
        recovered(metrics, faults, "permute", caplog, f"engine 0 ({plane.pool.engines[0].url})")
        behaves_as_trainer(trainer, plane)
    finally:
        sync.close()
        plane.close()
