"""The planner's mixture-of-experts arithmetic: experts sharded by expert parallelism, the
dispatch's activations, the EP layout for Qwen3-30B-A3B, EP in the weight sync's gather, and
``train.megatron.ep: auto`` (docs/planner.md). Numbers by hand, as tests/test_planner.py does."""

from __future__ import annotations

from pathlib import Path

from rl_core.cluster.planner import (
    MODEL_PRESETS,
    MOE_DISPATCH_IMBALANCE,
    plan,
    training_activation_bytes,
)
from rl_core.config import load_config

QWEN3_30B = MODEL_PRESETS["qwen3-30b-a3b"]
GIB = 2**30


def test_expert_parameters_of_qwen3_30b_a3b():
    # 48 layers x 128 experts x 3 matrices x 2048 x 768: 95% of the 30.5B parameters
    assert QWEN3_30B.expert_params == 48 * 128 * 3 * 2048 * 768 == 28_991_029_248
    assert QWEN3_30B.n_params - QWEN3_30B.expert_params == 1_541_093_376
    assert MODEL_PRESETS["qwen2.5-7b"].expert_params == 0


def test_moe_activation_bytes_by_hand():
    # 1 x 9216 tokens, bf16, an EP rank receiving up to twice its share of routed tokens:
    #   checkpoints 48 * 9216 * 2048 * 2                                    =  1,811,939,328
    #   one layer   2 * 9216 * (4*2048 + 2*32*128 + 2*4*128                  (attention)
    #                           + 2 * (4*8*768 + 2*8*2048)                   (top-8 experts and
    #                           + 2*128) * 2                                  dispatch; router)
    #             = 2 * 9216 * 132,328 * 2                                  =  4,879,024,128
    #   logits      9216 * 151936 * (2 + 8)                                 = 14,002,421,760
    got = training_activation_bytes(QWEN3_30B, micro_batch=1, seq_len=9216,
                                    dispatch_imbalance=MOE_DISPATCH_IMBALANCE)
    assert MOE_DISPATCH_IMBALANCE == 2.0
    assert got == 1_811_939_328 + 4_879_024_128 + 14_002_421_760 == 20_693_385_216
    balanced = training_activation_bytes(QWEN3_30B, micro_batch=1, seq_len=9216)
    assert got - balanced == 2 * 9216 * (4 * 8 * 768 + 2 * 8 * 2048) * 2


def test_qwen3_30b_a3b_on_8_mi300x_trains_with_ep8():
    """The layout of configs/qwen3-30b-a3b-megatron-8xmi300x.yaml: TP 1, EP 8, DP 8."""
    p = plan(QWEN3_30B, "mi300x", 8, prompt_len=1024, response_len=8192, rollout_batch=256)
    t = p.training
    assert (t.backend, t.tp, t.pp, t.dp, t.ep, t.fits) == ("megatron", 1, 1, 8, 8, True)
    # bf16 weights + fp32 grads: dense parts whole, experts / 8; Adam over all 8 devices
    state = 6 * 1_541_093_376 + 6 * 28_991_029_248 // 8 + 12 * 30_532_122_624 // 8
    assert t.state_bytes == state == 76_788_016_128  # 71.5 GiB
    # micro-batch 4: 71.5 + 4 x 19.3 GiB fits 0.9 x 192 GiB, 8 would not
    assert t.micro_batch == 4 and t.max_tokens_per_device == 4 * 9216
    assert state + 4 * 20_693_385_216 <= 0.9 * 192 * GIB < state + 8 * 20_693_385_216
    assert any("EP=8" in r and "16 per device" in r for r in p.reasons)
    # the sync gathers every rank's experts (7/8 of them) over Infinity Fabric
    assert p.resharding.gather_bytes_per_train_device == 28_991_029_248 * 2 * 7 // 8
    assert p.rollout.tp == 1 and p.rollout.dp == 8


def test_ep_does_not_fit_8_h100_but_fits_16():
    p = plan(QWEN3_30B, "h100", 8, response_len=8192, rollout_batch=256)
    assert not p.training.fits and any("no megatron expert-parallel layout" in w
                                       for w in p.warnings)
    t = plan(QWEN3_30B, "h100", 16, response_len=8192, rollout_batch=256).training
    # EP stays inside a node (the all-to-all on NVLink): EP 8 x 2 expert-data-parallel groups
    assert (t.backend, t.tp, t.pp, t.dp, t.ep, t.fits) == ("megatron", 1, 1, 16, 8, True)
    assert t.state_bytes == 6 * 1_541_093_376 + 6 * 28_991_029_248 // 8 + 12 * 30_532_122_624 // 16


def test_ep_auto_takes_the_planners_layout():
    from rl_core.training.megatron.layout import resolve_layout

    demo = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    cfg = load_config(demo, ["train.backend=megatron", "train.megatron.ep=auto",
                             "cluster.mode=ray", "cluster.trainer_ranks=8",
                             "train.prompts_per_step=32", "rollout.n_samples=8",
                             "rollout.max_new_tokens=8192", "data.max_prompt_tokens=1024"])  # fmt: skip
    layout, how = resolve_layout(cfg, "qwen3-30b-a3b", device="mi300x")
    assert (layout.tp, layout.pp, layout.ep) == (1, 1, 8)
    assert "ep=8" in how
    dense, _ = resolve_layout(cfg, "qwen2.5-7b", device="mi300x")
    assert dense.ep == 1
