"""``rollout.weight_sync: shm``: weights through shared memory to engine processes on this host.

Pinned: the segment holds every tensor once (a tied head is an alias) and the checksum computed
while copying is :func:`weights_checksum`'s; an engine serves its parameters *from* the
segment (no copy) through a private mapping, so what the engine writes never reaches the
trainer's segment; the two segments alternate, so staging never writes what an engine serves;
through an engine process each sync is verified (version, checksum, probe), a restarted
engine comes back from the current segment, and a fault the probe catches is reloaded clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import save_tiny_model
from test_rollout_planes import _http
from test_sync_probe import GREEDY, PROMPTS, caught, claims, nudge, plan, probe  # noqa: F401

from rl_core.config import AlgorithmConfig, TrainConfig, load_config
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.weight_sync import sync_weights, weights_checksum
from rl_core.weight_sync.shm import SegmentWriter, layout_of, map_segment, views
from rl_core.weight_sync.transports import ShmSync, TensorSync

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5, tie=True)


def _trainer(model_dir: Path) -> TorchTrainer:
    return TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)


def test_segments_hold_each_tensor_once_and_alternate(tmp_path: Path) -> None:
    emb = torch.randn(50, 8)
    weights = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "embed": emb, "lm_head": emb, "h": torch.randn(4).to(torch.bfloat16)}
    layout, size = layout_of(weights)
    assert {e["name"]: e.get("alias") for e in layout}["lm_head"] == "embed"
    assert size % 64 == 0 and size < sum(t.numel() * t.element_size() for t in weights.values())
    writer = SegmentWriter(tmp_path)
    path1, checksum = writer.write(weights, 1)
    assert checksum == weights_checksum(weights)
    served = views(map_segment(path1, size, private=True), layout)
    assert all(torch.equal(served[n], t) for n, t in weights.items())
    served["a"].fill_(0)  # a reader's write stays its own
    assert torch.equal(views(map_segment(path1, size), layout)["a"], weights["a"])
    weights["a"] = weights["a"] + 1
    path2, checksum2 = writer.write(weights, 2)
    assert path2 != path1 and checksum2 == weights_checksum(weights) != checksum
    assert writer.write(weights, 3)[0] == path1  # version 3 reuses version 1's segment
    writer.close()
    assert not path1.exists() and not path2.exists()


def test_an_engine_serves_its_parameters_from_the_segment(model_dir: Path, tmp_path: Path) -> None:
    trainer, reference, mine = _trainer(model_dir), InProcessPlane(model_dir), InProcessPlane(
        model_dir)
    nudge(trainer, 1)
    engine = mine.engine
    writer = SegmentWriter(tmp_path)
    try:
        path, checksum = writer.write(trainer.export_weights(), 1)
        assert engine.update_weights_from_shared_memory(
            str(path), writer.layout, writer.size, 1) == checksum
        storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
        assert len(storages) == 1  # every parameter: a view of the one mapping, no copy
        assert next(engine.model.parameters()).untyped_storage().nbytes() == writer.size
        segment = map_segment(path, writer.size)
        sync_weights(trainer, reference, TensorSync(reference), 1)
        mine.weight_version = 1
        assert [s.completion_ids for s in mine.generate(PROMPTS, GREEDY)] == [
            s.completion_ids for s in reference.generate(PROMPTS, GREEDY)]
        with torch.no_grad():  # the engine's own write: private, the trainer's bytes intact
            next(engine.model.parameters()).mul_(0)
        assert weights_checksum(views(segment, writer.layout)) == checksum
        with pytest.raises(Exception, match="no shared-memory segment"):
            engine.update_weights_from_shared_memory(str(tmp_path / "nope"), writer.layout,
                                                     writer.size, 2)
    finally:
        writer.close()
        mine.close()
        reference.close()


def test_engine_process_syncs_and_recovers_each_fault(model_dir: Path, tmp_path: Path,
                                                      plan, caplog) -> None:  # noqa: F811
    """The faults of tests/test_sync_probe.py's disk test, on shared memory: a permuted tensor
    (v1) and a cache not dropped (v2) are caught and reloaded; a tensor transposed again after
    its reload (v3) gets the engine rebuilt, and the restarted engine comes back from the
    current segment. The engine's own writes never reached the segment it reloads."""
    faults = plan(("permute", 1, 1), ("stale_cache", 2, 1), ("transpose", 3, 2))
    trainer = _trainer(model_dir)
    plane, _ = _http(model_dir, tmp_path)
    sync = ShmSync(plane, 60, tmp_path)
    plane.pool.resync = sync.resync
    check = probe()
    try:
        engine = f"engine 0 ({plane.pool.engines[0].url})"
        plane.generate(PROMPTS, GREEDY)  # packed weights derived from v0
        for version in (1, 2, 3):
            nudge(trainer, version)
            metrics = sync_weights(trainer, plane, sync, version, check)
            assert metrics["sync_bytes"] == sync.writer.size
            assert metrics["sync/probe_reloads"] == 1.0
            assert metrics["sync/probe_max_abs_logp_diff"] < 1e-5
            caught(caplog, version, engine)
        assert metrics["sync/probe_rebuilt_engines"] == 1.0 and plane.pool.engines[0].restarts == 1
        assert claims(faults) == [("permute", "1"), ("stale_cache", "2"), ("transpose", "3"),
                                  ("transpose", "3")]
        expected = weights_checksum(trainer.export_weights())
        assert plane.client.weights_checksum(url=plane.pool.engines[0].url) == expected
        assert {s.weight_version for s in plane.generate(PROMPTS, GREEDY)} == {3}
    finally:
        plane.close()
        sync.close()
    assert not list(tmp_path.glob("grpoflow-weights-*"))


def test_shm_needs_engine_processes_on_this_host() -> None:
    assert load_config(None, ["rollout.engine=embedded", "rollout.weight_sync=shm"])
    for bad in (["rollout.engine=local"], ["rollout.engine=sglang"],
                ["rollout.engine=embedded", "cluster.mode=ray"]):
        with pytest.raises(ValueError, match="rollout.weight_sync=shm"):
            load_config(None, [*bad, "rollout.weight_sync=shm"])
