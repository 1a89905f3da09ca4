"""rl_core.cluster.planner: recommendations for (model, device) pairs, checked against numbers
computed by hand from the formulas in the module's docstrings.

Defaults throughout: prompt 1024 + response 2048 = 3072 tokens, rollout batch 512,
mem_fraction_static 0.85, training headroom 0.9, a minimum KV budget of 32 sequences, link
efficiency 0.8. Memory is nominal GiB: 80 GiB = 85,899,345,920 bytes.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rl_core.cluster.planner import (
    MODEL_PRESETS,
    ModelShape,
    format_plan,
    get_device,
    kv_bytes_per_token,
    load_model,
    main,
    plan,
    plan_to_dict,
    training_activation_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
P7B = 7_615_616_512  # Qwen2.5-7B
P72B = 72_706_203_648  # Qwen2.5-72B
W7B = 2 * P7B  # bf16 bytes: 15,231,233,024
W72B = 2 * P72B  # 145,412,407,296

# SGLang static memory (0.85 of the device) and training's usable memory (0.9).
STATIC_H100 = int(80 * GIB * 0.85)  # 73,014,444,032
STATIC_MI300X = int(192 * GIB * 0.85)  # 175,234,665,676
USABLE_H100 = int(80 * GIB * 0.9)  # 77,309,411,328


# ---------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-7b", P7B),
        ("qwen2.5-32b", 32_763_876_352),
        ("qwen2.5-72b", P72B),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
    ],
)
def test_preset_parameter_counts_match_the_published_checkpoints(name, published):
    assert MODEL_PRESETS[name].n_params == published


def test_preset_lookup_accepts_hub_ids():
    assert load_model("Qwen/Qwen2.5-7B-Instruct") is MODEL_PRESETS["qwen2.5-7b"]
    assert load_model("meta-llama/Meta-Llama-3.1-8B") is MODEL_PRESETS["llama-3.1-8b"]
    with pytest.raises(ValueError, match="unknown model 'gpt-17'.*qwen2.5-7b"):
        load_model("gpt-17")


def test_kv_bytes_per_token():
    q7, q72 = MODEL_PRESETS["qwen2.5-7b"], MODEL_PRESETS["qwen2.5-72b"]
    assert kv_bytes_per_token(q7) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv_bytes_per_token(q7, tp=4) == 2 * 28 * 1 * 128 * 2
    assert kv_bytes_per_token(q72, tp=4) == 2 * 80 * 2 * 128 * 2 == 81_920
    # 16 ranks, 8 KV heads: every rank keeps one head's copy.
    assert kv_bytes_per_token(q72, tp=16) == kv_bytes_per_token(q72, tp=8) == 40_960
    assert kv_bytes_per_token(q72, tp=8, pp=2) == 20_480


def test_training_activation_bytes_by_hand():
    # Qwen2.5-7B, 1 x 3072 tokens, bf16:
    #   checkpoints 28 * 3072 * 3584 * 2                         =   616,562,688
    #   one layer   2 * 3072 * (4*3584 + 2*28*128 + 2*4*128 + 4*18944) * 2
    #             = 2 * 3072 * 98,304 * 2                        = 1,207,959,552
    #   logits      3072 * 152064 * (2 + 8)                      = 4,671,406,080
    m = MODEL_PRESETS["qwen2.5-7b"]
    one = training_activation_bytes(m, micro_batch=1, seq_len=3072)
    assert one == 616_562_688 + 1_207_959_552 + 4_671_406_080 == 6_495_928_320
    assert training_activation_bytes(m, micro_batch=2, seq_len=3072, tp=2) == one


# ---------------------------------------------------------------------------- 7B


def test_7b_on_mi300x_is_tp1_with_eight_replicas():
    p = plan("qwen2.5-7b", "mi300x", 8)
    r = p.rollout
    assert (r.tp, r.pp, r.dp) == (1, 1, 8)
    assert r.weight_bytes == W7B
    assert r.kv_bytes == STATIC_MI300X - W7B == 160_003_432_652
    assert r.kv_tokens == 160_003_432_652 // 57_344 == 2_790_238
    assert r.concurrent_seqs == 8 * (2_790_238 // 3072) == 7264
    assert r.waves == 1 and r.fits
    t = p.training
    assert (t.backend, t.tp, t.pp, t.dp, t.shard) == ("fsdp2", 1, 1, 8, 8)
    assert t.state_bytes == 16 * P7B // 8 == W7B
    assert t.micro_batch == 16 and t.fits
    assert any("TP=1, DP=8" in x and "2.3-4.3x" in x for x in p.reasons)
    assert p.warnings == ()


def test_7b_on_h100_is_tp1_too():
    p = plan("qwen2.5-7b", "h100", 8)
    assert (p.rollout.tp, p.rollout.dp) == (1, 8)
    assert p.rollout.kv_tokens == (STATIC_H100 - W7B) // 57_344 == 1_007_659
    t = p.training
    # usable 77,309,411,328 - state 15,231,233,024 - gathered units 3 * 544,997,376 * 2
    # leaves 58,808,194,048 for activations: 9.05 micro-batches of 6,495,928,320, so 8.
    assert t.working_bytes == 3 * 152064 * 3584 * 2 == 3_269_984_256
    assert t.micro_batch == 8
    assert t.activation_bytes == 8 * 6_495_928_320
    assert t.max_tokens_per_device == 8 * 3072
    assert t.state_bytes + t.working_bytes + t.activation_bytes <= USABLE_H100
    # Colocated: the trainer's shard goes to host and back over PCIe (64 GB/s x 0.8).
    assert t.offload_seconds == pytest.approx(2 * W7B / 51.2e9)  # 0.59 s
    assert plan("qwen2.5-7b", "h100", 8, placement="disaggregated").training.offload_seconds == 0


def test_7b_disaggregated_on_h100_splits_the_node():
    p = plan("qwen2.5-7b", "h100", 8, placement="disaggregated")
    assert (p.rollout.devices, p.rollout.tp, p.rollout.dp) == (4, 1, 4)
    assert (p.training.devices, p.training.dp, p.training.state_bytes) == (4, 4, 16 * P7B // 4)
    s = p.resharding
    assert s.gather_bytes_per_train_device == W7B * 3 // 4 == 11_423_424_768
    assert s.link == "NVLink 4" and s.link_gbps == 450
    assert s.transfer_seconds == pytest.approx(W7B / (450e9 * 0.8))
    assert s.seconds == pytest.approx(11_423_424_768 / 360e9 + W7B / 360e9)
    p3 = plan("qwen2.5-7b", "h100", 8, placement="disaggregated", rollout_devices=6)
    assert (p3.rollout.dp, p3.training.devices) == (6, 2)


# ---------------------------------------------------------------------------- 72B


def test_72b_on_h100_needs_tp4_and_more_devices_to_train():
    p = plan("qwen2.5-72b", "h100", 8)
    r = p.rollout
    # TP=2: 72.7 GB of weights leave 308,240,384 bytes of KV, below the 32 x 3072 x 163,840
    # bytes (16.1 GB) minimum; TP=4 leaves 36.7 GB.
    assert STATIC_H100 - W72B // 2 == 308_240_384 < 32 * 3072 * 163_840
    assert (r.tp, r.pp, r.dp) == (4, 1, 2)
    assert r.weight_bytes == W72B // 4 == 36_353_101_824
    assert r.kv_tokens == (STATIC_H100 - W72B // 4) // 81_920 == 447_526
    assert r.concurrent_seqs == 2 * (447_526 // 3072) == 290
    assert r.waves == 2
    t = p.training
    assert not t.fits and t.micro_batch == 0
    assert t.state_bytes == 16 * P72B // 8 == 145_412_407_296
    # spare = usable - gathered embedding (3 * 152064 * 8192 * 2) - one sequence's
    # activations (10,780,409,856) = 59,054,751,744; 16 * P / spare = 19.7 -> 20 -> 3 nodes.
    assert t.min_devices == 24
    assert any("training does not fit on 8 device(s)" in w and ">= 24" in w for w in p.warnings)
    assert any("runs in >= 2 waves" in w for w in p.warnings)


def test_72b_on_four_h100_nodes_trains_with_megatron_tp8_pp2():
    p = plan("qwen2.5-72b", "h100", 32)
    assert (p.rollout.tp, p.rollout.dp) == (4, 8)
    t = p.training
    assert (t.backend, t.tp, t.pp, t.dp) == ("megatron", 8, 2, 2)
    # 6 bytes/param over TP x PP = 16, 12 bytes/param over all 32 devices.
    assert t.state_bytes == 6 * P72B // 16 + 12 * P72B // 32 == 54_529_652_736
    assert t.fits and t.micro_batch >= 1
    s = p.resharding
    # Each stage assembles its half of the layers inside its TP group of 8.
    assert s.gather_bytes_per_train_device == W72B // 2 * 7 // 8 == 63_617_928_192
    assert s.transfer_seconds == 0.0


def test_72b_bigger_memory_means_less_tp():
    tps = {d: plan("qwen2.5-72b", d, 8).rollout.tp for d in ("mi355x", "mi300x", "h200", "h100")}
    # MI355X: 0.85 x 288 GiB = 262.8e9 static, 145.4e9 of weights, 117.5e9 left >= 16.1e9.
    # MI300X: 175.2e9 - 145.4e9 = 29.8e9 < 32 x 3072 x 327,680 = 32.2e9, so TP=2.
    assert tps == {"mi355x": 1, "mi300x": 2, "h200": 2, "h100": 4}
    p = plan("qwen2.5-72b", "mi355x", 8)
    assert p.rollout.dp == 8
    assert p.training.fits and p.training.backend == "fsdp2"
    assert any("2.3-4.3x" in x for x in p.reasons)


# ---------------------------------------------------------------------------- CPU


def test_half_b_on_cpu_runs_float32_without_tp():
    p = plan("qwen2.5-0.5b", "cpu", 2, prompt_len=64, response_len=64, rollout_batch=16)
    w = 494_032_768 * 4  # the embedded engine and the trainer run float32 on CPU
    assert (p.rollout.tp, p.rollout.dp) == (1, 2)
    assert p.rollout.weight_bytes == w == 1_976_131_072
    assert kv_bytes_per_token(p.model, dtype_bytes=4) == 2 * 24 * 2 * 64 * 4 == 24_576
    assert p.rollout.kv_tokens == (int(16 * GIB * 0.85) - w) // 24_576
    t = p.training
    assert (t.backend, t.dp, t.state_bytes) == ("fsdp2", 2, 16 * 494_032_768 // 2)
    assert t.micro_batch == 8  # capped by the batch: 16 sequences over 2 ranks
    s = p.resharding
    assert s.gather_bytes_per_train_device == w // 2 == 988_065_536
    assert s.gather_seconds == pytest.approx(988_065_536 / (10e9 * 0.8))
    # One CPU rank never splits a layer, however many there are.
    assert plan("qwen2.5-0.5b", get_device("cpu", memory_gib=1), 4).rollout.tp == 1


# ---------------------------------------------------------------------------- misfits


def test_a_model_that_cannot_fit_is_flagged():
    p = plan("llama-3.1-70b", "a100-40gb", 1)
    assert not p.rollout.fits and not p.training.fits
    assert p.rollout.tp == 1 and p.rollout.concurrent_seqs == 0
    text = " ".join(p.warnings)
    assert "rollout does not fit" in text and "training does not fit on 1 device(s)" in text
    assert "DOES NOT FIT" in format_plan(p)


def test_idle_devices_are_reported():
    p = plan("qwen2.5-72b", "h100", 6)
    assert (p.rollout.tp, p.rollout.dp) == (4, 1)
    assert any("2 of 6 rollout devices stay idle" in w for w in p.warnings)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match=">= 1 device per plane"):
        plan("qwen2.5-7b", "h100", 1, placement="disaggregated")
    with pytest.raises(ValueError, match="placement"):
        plan("qwen2.5-7b", "h100", 8, placement="split")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_device("tpu")
    assert get_device("A100").name == "a100-80gb"


# ---------------------------------------------------------------------------- resharding


def test_resharding_bytes_and_time_by_hand():
    p = plan("qwen2.5-7b", "mi300x", 8)
    s = p.resharding
    assert s.weight_bytes == 15_231_233_024
    assert (s.replicas, s.bytes_to_rollout) == (8, 8 * 15_231_233_024)
    assert s.bytes_per_rollout_device == 15_231_233_024
    assert s.gather_bytes_per_train_device == 15_231_233_024 * 7 // 8 == 13_327_328_896
    assert s.gather_link == "Infinity Fabric" and s.gather_gbps == 448
    assert s.gather_seconds == pytest.approx(13_327_328_896 / 358.4e9)  # 0.0372 s
    assert s.transfer_seconds == 0.0 and s.seconds == s.gather_seconds

    s72 = plan("qwen2.5-72b", "h100", 8).resharding
    assert (s72.replicas, s72.bytes_to_rollout) == (2, 2 * W72B)
    assert s72.bytes_per_rollout_device == W72B // 4 == 36_353_101_824


def test_resharding_across_nodes_uses_the_nic():
    p = plan("llama-3.1-70b", "h100", 64, placement="disaggregated")
    w = 2 * 70_553_706_496
    s = p.resharding
    assert (p.training.backend, p.training.tp, p.training.pp) == ("megatron", 8, 2)
    assert s.link.startswith("the network") and s.link_gbps == 50
    assert s.transfer_seconds == pytest.approx(w / 40e9)  # 3.53 s
    assert s.gather_bytes_per_train_device == w // 2 * 7 // 8
    assert s.gather_link == "NVLink 4"


# ---------------------------------------------------------------------------- config.json

QWEN_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_config_json_directory_estimates_params(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B_CONFIG))
    m = load_model(tmp_path)
    assert m.name == tmp_path.name
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) == (28, 3584, 28, 4, 128)
    assert m.qkv_bias and not m.tied_embeddings and m.dtype_bytes == 2
    assert m.n_params == P7B
    assert plan(m, "mi300x", 8).rollout.tp == 1
    assert load_model(tmp_path / "config.json").n_params == P7B


def test_config_json_other_families(tmp_path):
    llama = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    m = ModelShape.from_hf_config(llama, name="llama")
    assert m.n_params == 8_030_261_248 and m.dtype_bytes == 4
    moe = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 48,
        "vocab_size": 151936,
        "attention_bias": False,
    }
    m = ModelShape.from_hf_config(moe)
    assert m.n_params == 30_532_122_624 and m.mlp_active_width == 8 * 768
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        ModelShape.from_hf_config({k: v for k, v in llama.items() if k != "vocab_size"})


def test_exact_params_from_safetensors_headers_and_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B_CONFIG))
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]},
            "b": {"dtype": "BF16", "shape": [7], "data_offsets": [30, 44]},
        }
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(44)
    )
    assert load_model(tmp_path).n_params == 22

    (tmp_path / "model.safetensors").unlink()
    index = {"metadata": {"total_size": W7B}, "weight_map": {}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(tmp_path).n_params == P7B


# ---------------------------------------------------------------------------- output


def test_cli_json(capsys):
    rc = main(["--model", "qwen2.5-7b", "--device", "mi300x", "--devices", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["rollout"]["tp"], out["rollout"]["dp"]) == (1, 8)
    assert out["model"]["params"] == P7B
    assert out["seq_len"] == 3072 and out["placement"] == "colocated"
    assert out["resharding"]["weight_bytes"] == W7B
    assert out["resharding"]["weight_gib"] == round(W7B / GIB, 2) == 14.19
    assert out["training"]["backend"] == "fsdp2"
    assert out["warnings"] == []


def test_cli_table_and_errors(capsys):
    argv = ["--model", "qwen2.5-72b", "--device", "h100", "--devices", "8"]
    argv += ["--prompt-len", "512", "--response-len", "1024", "--placement", "disaggregated"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rollout" in out and "training" in out and "why:" in out
    assert "qwen2.5-72b (72.71B params) on 8 x NVIDIA H100" in out
    assert main(["--model", "qwen2.5-7b", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_plan_to_dict_round_trips_through_json():
    d = plan_to_dict(plan("qwen2.5-72b", "h100", 8))
    again = json.loads(json.dumps(d))
    assert again["training"]["fits"] is False
    assert again["training"]["min_devices"] == 24
    assert again["rollout"]["kv_tokens"] == 447_526


def test_module_imports_nothing_heavy():
    code = (
        "import sys; import rl_core.cluster.planner as p; "
        "heavy = [m for m in ('torch', 'ray', 'prefect', 'mlflow') if m in sys.modules]; "
        "assert not heavy, heavy; print(p.plan('qwen2.5-7b', 'mi300x', 8).rollout.dp)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"
