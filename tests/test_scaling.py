"""Engines that join and leave a running job (``grpoflow scale``, the run's control file).

Pinned on real engine processes behind the real sglang-router:

- A joining engine starts while generation goes on, takes the current weights from the
  staged copy (never from the trainer), is checked by the weight probe, and serves behind the
  router; a probe that refuses it stops it and leaves the pool as it was.
- A leaving engine is drained: the generation it was serving finishes with every sample,
  then it stops.
- Through the flow: an engine added at step 2 and removed at step 3 of a run changes
  nothing the run computes: the ledger and the final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import run_demo_flow, save_tiny_model
from safetensors.torch import load_file

from grpoflow.cli import main
from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.engine.sampling import SamplingParams
from rl_core.planes import get_planes
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.rundir import read_control
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.weight_sync import sync_weights, weights_checksum
from rl_core.weight_sync.probe import ProbeBatch, ProbeMismatch, WeightProbe
from rl_core.weight_sync.transports import DiskSync

pytestmark = pytest.mark.timeout(600)

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _nudged(model_dir: Path) -> TorchTrainer:
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return trainer


def test_an_engine_joins_from_the_staged_weights_and_leaves_drained(model_dir: Path,
                                                                     tmp_path: Path) -> None:
    pool = EnginePool(embedded_engine_command(model_dir, num_threads=1), 1,
                      log_dir=tmp_path / "engines", router=True, router_policy="round_robin",
                      health_interval_s=0.5, health_timeout_s=10, startup_timeout_s=120)
    plane = HttpPlane(pool, request_batch_size=4, weight_sync_timeout_s=60)
    sync = DiskSync(plane, tmp_path / "staging", 60)
    pool.resync = sync.resync
    probe = WeightProbe(ProbeBatch.from_prompts(PROMPTS), 1e-3)
    trainer = _nudged(model_dir)
    plane.start()
    try:
        sync_weights(trainer, plane, sync, 1, probe)
        expected = weights_checksum(trainer.export_weights())
        asked: list[str] = []
        trainer.export_weights = lambda: asked.append("trainer") or {}  # never asked again
        pool.admit_check = lambda url: probe.admit(plane, url, plane.weight_version)

        # joins while a generation runs on the first engine
        out: list = []
        worker = threading.Thread(target=lambda: out.extend(plane.generate(PROMPTS * 8, PARAMS)))
        worker.start()
        joined = pool.add_engine()
        worker.join(120)
        assert len(out) == 24 and not asked
        assert joined.in_service and len(pool.in_service_urls()) == 2
        assert plane.client.weight_version(url=joined.url) == "1"
        assert plane.client.weights_checksum(url=joined.url) == expected
        plane.generate(PROMPTS * 8, PARAMS)  # the router sends it work
        steps = plane.client.server_info(url=joined.url)["internal_states"][0]["decode_steps"]
        assert steps > 0

        # leaves drained: the generation it serves finishes whole
        out.clear()
        worker = threading.Thread(target=lambda: out.extend(plane.generate(PROMPTS * 8, PARAMS)))
        worker.start()
        assert pool.remove_engine() == joined.index
        worker.join(120)
        assert len(out) == 24 and all(len(s.completion_ids) == 48 for s in out)
        assert not joined.alive and pool.in_service_urls() == [pool.engines[0].url]
        assert len(plane.generate(PROMPTS, PARAMS)) == 3

        # a joining engine the probe refuses never serves and is stopped
        def refuse(url: str) -> None:
            raise ProbeMismatch(f"engine {url}: refused", [url])

        pool.admit_check = refuse
        with pytest.raises(ProbeMismatch, match="refused"):
            pool.add_engine()
        assert len(pool.engines) == 1 and len(pool.in_service_urls()) == 1
        with pytest.raises(ValueError, match="last engine"):
            pool.remove_engine()
    finally:
        plane.close()
    assert not any(e.alive for e in pool.engines)


def test_grpoflow_scale_writes_the_runs_control_file(tmp_path: Path, capsys) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    assert main(["scale", "r1", "--engines", "3", "--root", str(tmp_path / "runs")]) == 0
    assert read_control(run) == {"rollout.num_engines": 3}
    assert "rollout.num_engines=3" in capsys.readouterr().out
    assert main(["scale", str(tmp_path / "runs" / "nope"), "--engines", "2",
                 "--root", str(tmp_path / "runs")]) == 1
    assert "no run directory" in capsys.readouterr().err
    assert main(["scale", "r1", "--engines", "0", "--root", str(tmp_path / "runs")]) == 1
    assert "at least 1" in capsys.readouterr().err and read_control(run)["rollout.num_engines"] == 3


SCALED_RUN = ["rollout.engine=embedded", "train.steps=3", "rollout.engine_threads=1"]


def test_engines_added_and_removed_mid_run_change_nothing_it_computes(
        tmp_path: Path, tiny_cache: Path, monkeypatch) -> None:
    """One engine at steps 1 and 3, two at step 2 (the control file, as `grpoflow
    scale` writes it). Each scale runs in the background; here the step waits for it, so
    which step it lands at is fixed."""
    plain = Path(run_demo_flow(tmp_path, tiny_cache, "plain", *SCALED_RUN)["run_dir"])

    from flows.grpo_train import GRPOPlanes

    apply, steps = GRPOPlanes.apply_control, []

    def at_step(self: GRPOPlanes) -> dict[str, float]:
        steps.append(len(steps) + 1)
        if steps[-1] in (2, 3):
            main(["scale", str(self.run.dir.path), "--engines", "2" if steps[-1] == 2 else "1"])
        metrics = apply(self)
        plane = get_planes(self.planes).rollout
        if plane._scaler is not None:
            plane._scaler.join(180)
        return {**metrics, "rollout_engines": float(len(plane.pool.in_service_urls()))}

    monkeypatch.setattr(GRPOPlanes, "apply_control", at_step)
    scaled = Path(run_demo_flow(tmp_path, tiny_cache, "scaled", *SCALED_RUN)["run_dir"])

    metrics = [json.loads(x) for x in (scaled / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_engines"] for m in metrics] == [1, 2, 1]
    assert all(m["rollout_scale_errors"] == 0 for m in metrics)

    def ledger(run: Path) -> list[dict]:
        return [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]

    assert ledger(scaled) == ledger(plain)
    a, b = (load_file(str(run / "model" / "model.safetensors")) for run in (plain, scaled))
    assert weights_checksum(a) == weights_checksum(b)
