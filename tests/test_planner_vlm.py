"""The planner on vision-language models (rl_core/cluster/vision.py; docs/planner.md,
"Vision-language models on GPUs"): Qwen2.5-VL's parameter counts from the shape, the frozen
tower's state, image tokens in the sequence and KV budget, and the shipped VLM configs' layouts.

Published counts: the checkpoints' parameters as transformers counts them (Qwen2.5-VL-7B
8,292,166,656 of which the tower 676,550,144; Qwen2.5-VL-3B 3,754,622,976; Qwen2-VL-7B
8,291,375,616); one Qwen2.5-VL vision block 19,702,200, the patch embedding 1,505,280.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_core.cluster.planner import (
    MODEL_PRESETS,
    ModelShape,
    Plan,
    format_plan,
    load_model,
    main,
    plan,
    plan_to_dict,
    vision_activation_bytes,
)
from rl_core.config import ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
VL3, VL7 = MODEL_PRESETS["qwen2.5-vl-3b"], MODEL_PRESETS["qwen2.5-vl-7b"]
TOWER_7B, TOWER_3B = 676_550_144, 668_684_288
MAX_PIXELS = 1_003_520  # data.image_max_pixels' default: 5,120 patches, 1,280 tokens

# Qwen/Qwen2.5-VL-3B-Instruct's config.json (the fields the planner reads).
VL3_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                      "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31]},
}


# ---------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(("m", "published", "tower", "approx", "hub_id"), [
    (VL7, 8_292_166_656, TOWER_7B, 8.29e9, "Qwen/Qwen2.5-VL-7B-Instruct"),
    (VL3, 3_754_622_976, TOWER_3B, 3.75e9, "Qwen/Qwen2.5-VL-3B-Instruct")], ids=["7b", "3b"])
def test_qwen25_vl_parameter_counts_from_the_shape(m: ModelShape, published: int, tower: int,
                                                   approx: float, hub_id: str) -> None:
    assert m.vision is not None and m.vision_params == tower
    assert m.n_params == published and abs(m.n_params / approx - 1) < 0.01
    v = m.vision
    assert v.block_params == 19_702_200 and v.patch_embed_params == 1_505_280
    assert v.params == 32 * 19_702_200 + 1_505_280 + v.merger_params
    # the language model alone: Qwen2.5-7B's 7,615,616,512 and Qwen2.5-3B's 3,085,938,688
    assert m.n_params - tower == (7_615_616_512 if m is VL7 else 3_085_938_688)
    assert load_model(hub_id) is m


def test_config_json_reads_the_vision_tower(tmp_path: Path) -> None:
    m = ModelShape.from_hf_config(VL3_CONFIG, name="qwen2.5-vl-3b")
    assert m == VL3
    # transformers >= 4.5x writes the language model under text_config
    nested = {"model_type": "qwen2_5_vl", "vision_config": VL3_CONFIG["vision_config"],
              "text_config": {k: v for k, v in VL3_CONFIG.items() if k != "vision_config"}}
    assert ModelShape.from_hf_config(nested, name="qwen2.5-vl-3b") == VL3
    (tmp_path / "config.json").write_text(json.dumps(VL3_CONFIG))
    assert load_model(tmp_path).n_params == 3_754_622_976
    # Qwen2-VL: embed_dim + mlp_ratio (a GELU tower with LayerNorms), hidden_size its output
    qwen2_vl = {**{k: v for k, v in VL3_CONFIG.items() if k != "vision_config"},
                "model_type": "qwen2_vl", "hidden_size": 3584, "intermediate_size": 18944,
                "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                "vocab_size": 152064, "tie_word_embeddings": False,
                "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4,
                                  "num_heads": 16, "hidden_size": 3584, "patch_size": 14,
                                  "spatial_merge_size": 2, "temporal_patch_size": 2}}
    m = ModelShape.from_hf_config(qwen2_vl)
    assert m.vision is not None and not m.vision.gated and m.vision.out_hidden == 3584
    assert m.n_params == 8_291_375_616
    # a text model has no tower
    assert MODEL_PRESETS["qwen2.5-7b"].vision is None
    assert MODEL_PRESETS["qwen2.5-7b"].vision_params == 0


# ---------------------------------------------------------------------------- image tokens


def test_image_tokens_from_max_pixels_enter_the_sequence_and_kv_budget() -> None:
    v = VL7.vision
    assert v is not None
    assert v.patches_per_image(MAX_PIXELS) == MAX_PIXELS // (14 * 14) == 5120
    assert v.tokens_per_image(MAX_PIXELS) == 5120 // 4 == 1280
    assert v.tokens_per_image(256 * 28 * 28) == 256
    p = plan(VL7, "h100", 8, prompt_len=1024, response_len=2048)
    assert p.image_tokens == 1280 and p.seq_len == 1024 + 1280 + 2048
    r = p.rollout
    assert r.concurrent_seqs == r.dp * (r.kv_tokens // 4352)
    two = plan(VL7, "h100", 8, prompt_len=1024, response_len=2048, images_per_sample=2,
               image_max_pixels=256 * 28 * 28)
    assert two.image_tokens == 512 and two.seq_len == 1024 + 512 + 2048
    none = plan(VL7, "h100", 8, prompt_len=1024, response_len=2048, images_per_sample=0)
    assert none.image_tokens == 0 and none.seq_len == 3072 and none.vision is not None
    # the same KV pool holds fewer sequences with images in them
    assert r.kv_tokens == none.rollout.kv_tokens
    assert r.concurrent_seqs < two.rollout.concurrent_seqs < none.rollout.concurrent_seqs
    # a text model's sequences have no image tokens, whatever is asked
    assert plan("qwen2.5-7b", "h100", 8, images_per_sample=3).seq_len == 3072
    with pytest.raises(ValueError, match="images_per_sample"):
        plan(VL7, "h100", 8, images_per_sample=-1)


def test_vision_activation_bytes_by_hand() -> None:
    # one image of 1,003,520 pixels: n = 5,120 patches, h = 1280, i = 3420, bf16
    #   one block  5120 * (8*1280 + 4*3420) * 2 = 244,940,800
    #   merger     5120 * 3*1280 * 2            =  39,321,600
    #   frozen:    block + merger               = 284,262,400
    #   trained:   32 * 5120 * 1280 * 2 + 2 * (block + merger) = 419,430,400 + 568,524,800
    v = VL7.vision
    assert v is not None
    frozen = vision_activation_bytes(v, images=1, max_pixels=MAX_PIXELS, trainable=False)
    assert frozen == 244_940_800 + 39_321_600 == 284_262_400
    trained = vision_activation_bytes(v, images=1, max_pixels=MAX_PIXELS, trainable=True)
    assert trained == 419_430_400 + 2 * 284_262_400 == 987_955_200
    assert vision_activation_bytes(v, images=4, max_pixels=MAX_PIXELS, trainable=True,
                                   tp=2) == 2 * trained


# ---------------------------------------------------------------------------- frozen tower


def test_freezing_the_tower_drops_its_grads_and_adam_state() -> None:
    frozen = plan(VL7, "h100", 8, prompt_len=1024, response_len=2048)
    trained = plan(VL7, "h100", 8, prompt_len=1024, response_len=2048, freeze_vision=False)
    t_f, t_t = frozen.training, trained.training
    assert (t_f.backend, t_f.shard) == (t_t.backend, t_t.shard) == ("fsdp2", 8)
    # 16 bytes/param trained, 4 (its fp32 weight shard) frozen, over 8 shards
    assert t_t.state_bytes - t_f.state_bytes == (16 - 4) * TOWER_7B // 8 == 1_014_825_216
    assert t_t.state_bytes == 16 * VL7.n_params // 8
    assert frozen.vision.train_state_bytes == 4 * TOWER_7B // 8
    assert trained.vision.train_state_bytes == 16 * TOWER_7B // 8
    # the weight sync carries the tower only when it trains
    assert frozen.resharding.weight_bytes == 2 * (VL7.n_params - TOWER_7B)
    assert trained.resharding.weight_bytes == 2 * VL7.n_params
    assert frozen.vision.sync_bytes == 0 and trained.vision.sync_bytes == 2 * TOWER_7B
    # both engines hold the whole model
    assert frozen.rollout.weight_bytes == trained.rollout.weight_bytes == 2 * VL7.n_params
    assert frozen.vision.rollout_weight_bytes == 2 * TOWER_7B
    # a trained tower keeps its activations for the backward pass
    assert trained.vision.train_activation_bytes > frozen.vision.train_activation_bytes > 0
    assert any("vision tower (0.68B params) frozen" in r for r in frozen.reasons)
    assert any("vision tower (0.68B params) trained" in r for r in trained.reasons)


# ---------------------------------------------------------------------------- shipped configs


VLM_CONFIGS = {  # config -> (planner device, devices)
    "qwen2.5-vl-7b-geo3k-8xh100": ("h100", 8),
    "qwen2.5-vl-7b-geo3k-8xmi300x": ("mi300x", 8),
    "qwen2.5-vl-3b-geo3k-1gpu": ("h100", 1),
    "qwen2.5-vl-3b-geo3k-1xmi300x": ("mi300x", 1),
}


def _plan_config(name: str) -> tuple[ExperimentConfig, Plan]:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    device, devices = VLM_CONFIGS[name]
    assert cfg.cluster.trainer_ranks == cfg.rollout.num_engines == devices
    m = load_model(cfg.model.path)
    assert m.vision is not None
    # data.max_prompt_tokens counts the prompt with its image's tokens; the planner adds those
    text = cfg.data.max_prompt_tokens - m.vision.tokens_per_image(cfg.data.image_max_pixels)
    p = plan(m, device, devices, prompt_len=text, response_len=cfg.rollout.max_new_tokens,
             rollout_batch=cfg.train.prompts_per_step * cfg.rollout.n_samples,
             mem_fraction_static=cfg.rollout.sglang_mem_fraction_static,
             image_max_pixels=cfg.data.image_max_pixels, freeze_vision=cfg.model.freeze_vision)
    return cfg, p


@pytest.mark.parametrize("name", sorted(VLM_CONFIGS))
def test_the_shipped_vlm_configs_fit_and_the_plan_says_so(name: str) -> None:
    cfg, p = _plan_config(name)
    assert cfg.data.image_field == "images" and cfg.model.freeze_vision
    assert cfg.rollout.engine == "sglang" and cfg.rollout.sglang_tp == 1
    assert cfg.rollout.sglang_platform == ("rocm" if "mi300x" in name else "cuda")
    assert p.rollout.fits and p.training.fits, p.warnings
    assert (p.rollout.tp, p.rollout.dp) == (1, p.num_devices)
    assert (p.training.backend, p.training.shard) == ("fsdp2", p.num_devices)
    # the config's micro batch is within the planner's (which assumes activation recompute)
    assert 1 <= cfg.train.micro_batch_size <= p.training.micro_batch
    assert p.prompt_len == 1024 and p.image_tokens == 1280
    assert p.seq_len == cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens == 4352
    assert not any("does not fit" in w for w in p.warnings)
    text = format_plan(p)
    assert "DOES NOT FIT" not in text
    assert f"{p.model.vision_params / 1e9:.2f}B params, frozen (model.freeze_vision)" in text
    assert "1280 image + " in text and "1 image(s) x 1,280 tokens" in text


def test_7b_on_8_gpus_by_hand() -> None:
    """configs/qwen2.5-vl-7b-geo3k-8xh100.yaml: 0.3 x 80 GiB static memory per engine."""
    _, p = _plan_config("qwen2.5-vl-7b-geo3k-8xh100")
    w = 2 * 8_292_166_656  # bf16, tower included: 15.4 GiB
    assert p.rollout.weight_bytes == w
    assert p.rollout.kv_tokens == (int(80 * 2**30 * 0.3) - w) // (2 * 28 * 4 * 128 * 2)
    assert p.rollout.kv_tokens // 4352 >= 32  # the minimum KV budget at TP=1
    assert p.training.state_bytes == (16 * 7_615_616_512 + 4 * TOWER_7B) // 8
    _, mi = _plan_config("qwen2.5-vl-7b-geo3k-8xmi300x")
    assert mi.training.micro_batch > p.training.micro_batch  # 192 GB against 80


def test_plan_to_dict_and_the_cli_show_the_vision_part(capsys: pytest.CaptureFixture) -> None:
    d = json.loads(json.dumps(plan_to_dict(plan(VL7, "mi300x", 8))))
    assert d["image_tokens"] == 1280 and d["seq_len"] == 1024 + 1280 + 2048
    assert d["vision"]["params"] == TOWER_7B and d["vision"]["trainable"] is False
    assert d["vision"]["train_state_gib"] == round(4 * TOWER_7B // 8 / 2**30, 2)
    assert d["model"]["vision"]["depth"] == 32
    assert plan_to_dict(plan("qwen2.5-7b", "mi300x", 8))["vision"] is None
    argv = ["--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--device", "h100", "--devices", "1",
            "--images-per-sample", "2", "--image-max-pixels", str(512 * 28 * 28),
            "--train-vision", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["image_tokens"] == 1024 and out["vision"]["trainable"] is True
    assert out["vision"]["sync_bytes"] == 2 * TOWER_3B
    assert main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "vision: 0.67B params, trained" in table and "2 image(s) x 512 tokens" in table
