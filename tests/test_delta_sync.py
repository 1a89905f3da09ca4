"""Delta weight sync (rl_core/weight_sync/delta.py): only what changed since the version the
engines hold, reconstructed exactly (the sync's checksum of the whole new weights verifies
every delta), a full sync every K versions and after a failed one; a reload onto an engine
that no longer holds the base, and a restarted engine, get the version whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import save_tiny_model

from rl_core.config import AlgorithmConfig, TrainConfig, load_config
from rl_core.config.base import ConfigError
from rl_core.engine.faults import FAULTS_ENV
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.weight_sync import sync_weights, weights_checksum
from rl_core.weight_sync.delta import DeltaEncoder, decode, encode
from rl_core.weight_sync.probe import ProbeBatch, WeightProbe
from rl_core.weight_sync.transports import DiskSync

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def _step(weights: dict[str, torch.Tensor], seed: int, lr: float = 1e-4) -> dict:
    """What an Adam step does to every element: a change of about ``lr`` (all change)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: t + lr * torch.randn(t.shape, generator=gen).sign().to(t.dtype)
            for n, t in weights.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_encoding_is_chosen_where_smallest_and_exact(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    base = {n: torch.randn(64, 64, generator=gen).to(dtype) for n in "abcd"}
    new = dict(base)
    new["b"] = base["b"].clone()
    new["b"].view(-1)[[3, 700, 4000]] += 1.0  # three elements: index/value pairs
    lr = 1e-4 if dtype == torch.float32 else 3e-2  # below bfloat16 resolution most stay put
    new["c"] = _step({"c": base["c"]}, 1, lr)["c"]  # every element, a little: XOR compresses
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    noise = torch.randint(-(2**15), 2**15 - 1, (64, 64, base["d"].element_size() // 2),
                          generator=gen, dtype=torch.int16)
    new["d"] = noise.view(bits).view(dtype).reshape(64, 64)  # all new bits: sent whole
    entries, how = encode(new, base)
    assert "a" not in how  # unchanged: not sent
    assert {n: h["encoding"] for n, h in how.items()} == {"b": "sparse", "c": "xor", "d": "full"}
    sent = sum(t.numel() * t.element_size() for t in entries.values())
    assert sent < 0.75 * sum(new[n].numel() * new[n].element_size() for n in "bcd")
    out = decode(entries, json.loads(json.dumps(how)), base)
    for n in "bcd":  # bit for bit
        assert torch.equal(out[n].view(torch.uint8), new[n].view(torch.uint8)), n


def test_a_full_sync_every_k_versions_and_after_a_failed_one(tmp_path) -> None:
    enc = DeltaEncoder(full_every=3)
    w = {"w": torch.zeros(8, 8)}
    kinds = []
    for version in range(1, 6):
        enc.confirm(version - 1)  # each earlier version was delivered
        w = _step(w, version)
        _, m = enc.write(w, version, tmp_path / f"v{version}")
        kinds.append(int(m["sync_delta"]))
    assert kinds == [0, 1, 1, 0, 1]
    enc.confirm(4)  # the plane still serves 4: version 5 was not delivered
    _, m = enc.write(_step(w, 6), 6, tmp_path / "v6")
    assert m["sync_delta"] == 0.0  # nothing is known about the engines: whole


def test_delta_sync_to_an_engine_process(tmp_path, monkeypatch) -> None:
    model = save_tiny_model(tmp_path / "model", seed=2)
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps([{"kind": "permute", "version": 5, "times": 1}]))
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    trainer = TorchTrainer(model, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    pool = EnginePool(embedded_engine_command(model, num_threads=1), 1, log_dir=tmp_path / "e",
                      router=False, health_interval_s=0.5, startup_timeout_s=120)
    plane = HttpPlane(pool, weight_sync_timeout_s=60)
    sync = DiskSync(plane, tmp_path / "staging", 60, delta=DeltaEncoder(full_every=3))
    pool.resync = sync.resync
    probe = WeightProbe(ProbeBatch.from_prompts([[5, 6, 7, 8, 9], [10, 11, 12]]), 1e-3)
    plane.start()
    try:
        seen = []
        for version in range(1, 8):
            with torch.no_grad():  # an Adam-like step: every element moves
                for n, p in trainer.model.named_parameters():
                    p.copy_(_step({n: p.data}, version, lr=1e-3)[n])
            if version == 6:  # a restarted engine holds the base model: brought back whole
                pool.restart(0)
            m = sync_weights(trainer, plane, sync, version, probe)
            seen.append((int(m["sync_delta"]), m["sync/probe_reloads"]))
            served = pool.client.weights_checksum(url=pool.engine_urls[0])
            assert served == weights_checksum(trainer.export_weights()), version  # exact
            if m["sync_delta"]:
                assert m["sync_delta_fraction"] < 0.9 and m["sync_bytes"] < m["sync_full_bytes"]
        # 1 whole; 2, 3 deltas; 4 whole (every 3rd); 5 a delta whose load put a weight in the
        # wrong place: the probe caught it, the reload (the delta refused: the engine no
        # longer held its base) loaded version 5 whole; 6 after a restart; 7 whole (every 3rd)
        assert seen == [(0, 0.0), (1, 0.0), (1, 0.0), (0, 0.0), (1, 1.0), (1, 0.0), (0, 0.0)]
    finally:
        plane.close()


def test_delta_sync_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="rollout.weight_sync_delta=true: rollout.weight_sync"):
        load_config(ROOT / "configs" / "tiny-cpu.yaml", ["rollout.weight_sync_delta=true"])
