"""The megatron backend trains a tiny Qwen3-MoE with GRPO through the flow: two Ray trainer
ranks at expert parallelism 2 (the all-to-all dispatcher over gloo), routing replay from the
rollout engine's ``routed_experts``, the load-balancing loss, every step's weight sync
verified by the engine's checksum, router metrics in ``metrics.jsonl``, and the final model
in the hub's per-expert layout, loadable by transformers.

A soak test (~110 s on 2 cores, beyond the CI budget): ``pytest -m soak
tests/test_megatron_moe_flow.py``. tests/test_megatron_moe.py pins the same pieces in CI
(EP=2 equals one rank, replay, metrics, checkpoints) without the flow around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)


@pytest.mark.soak
def test_megatron_ep2_grpo_flow_with_routing_replay(prefect_harness, tiny_cache, tmp_path):
    from engine_helpers import run_demo_flow
    from safetensors.torch import load_file
    from test_moe import _moe_demo_dir
    from transformers import AutoModelForCausalLM

    model = _moe_demo_dir(tmp_path / "moe-init")
    out = run_demo_flow(
        tmp_path, tiny_cache, "megatron-ep2", f"model.path={model}", "train.backend=megatron",
        "train.megatron.ep=2", "cluster.mode=ray", "cluster.trainer_ranks=2",
        "rollout.num_engines=1", "cluster.cpus_per_trainer=0.5", "cluster.cpus_per_engine=0.5",
        "cluster.num_cpus=4", "train.moe.routing_replay=true", "train.moe.aux_loss_coef=0.1",
        "train.lr=1e-2", "train.steps=2", "train.prompts_per_step=4", "rollout.max_new_tokens=8",
        "checkpoint.every=0",
        # 8 tokens answer nothing (every advantage 0): the KL term is what trains the experts
        # (the demo has none since 2026-11-30)
        "algorithm.kl_coef=0.001",
    )  # fmt: skip
    run = Path(out["run_dir"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "moe/load_cv" in r]
    assert len(trained) == 2 and all(r["sync_bytes"] > 0 for r in trained)
    assert all(r["moe/replayed_tokens"] == 1.0 for r in trained)  # the engine's routing
    assert all(1.0 <= r["moe/load_max_over_mean"] <= 2.0 for r in trained)
    final = load_file(Path(out["model_dir"]) / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in final  # both EP ranks' experts
    start = load_file(model / "model.safetensors")
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
        assert not torch.equal(final[name], start[name]), name  # router and experts trained
    AutoModelForCausalLM.from_pretrained(out["model_dir"])  # the hub layout loads
