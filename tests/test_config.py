"""Tests for rl_core.config: YAML loading, dotted overrides, error messages, digests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rl_core.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    config_digest,
    flatten,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-cpu.yaml"
QWEN = CONFIGS / "qwen2.5-0.5b-gsm8k.yaml"


# ---------------------------------------------------------------------- shipped files


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    if path.name.startswith("sft-"):  # the SFT flow's schema (docs/sft.md)
        from rl_core.sft import SFTConfig, load_sft_config

        assert isinstance(load_sft_config(path), SFTConfig)
        return
    if path.name.startswith("tinker-"):  # grpoflow serve-tinker's schema (docs/tinker.md)
        from grpoflow.tinker.serve import TinkerServeConfig, load_serve_config

        assert isinstance(load_serve_config(path), TinkerServeConfig)
        return
    cfg = load_config(path)
    assert isinstance(cfg, ExperimentConfig)


def test_tiny_cpu_config():
    cfg = load_config(TINY)
    assert cfg.name == "tiny-cpu"
    assert cfg.model.path == "embedded:tiny"
    assert cfg.data.source == "synthetic"
    assert cfg.data.synthetic_digits == (1, 1)
    assert cfg.data.synthetic_operations == ["+", "-"]
    assert cfg.rollout.n_samples == 8
    assert cfg.train.num_threads == 2
    assert cfg.algorithm.clip_high == pytest.approx(0.28)
    assert cfg.algorithm.kl_kind == "low_var_kl"


def test_qwen_gsm8k_config():
    cfg = load_config(QWEN)
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.model.dtype == "bfloat16"
    assert cfg.data.source == "openai/gsm8k"
    assert cfg.data.subset == "main"
    assert cfg.train.lr == pytest.approx(1e-6)
    assert isinstance(cfg.train.lr, float)
    assert cfg.algorithm.kl_coef == pytest.approx(0.001)
    assert cfg.algorithm.kl_kind == "low_var_kl"
    assert cfg.algorithm.advantage == "grpo"
    assert cfg.rollout.n_samples == 5
    assert cfg.train.prompts_per_step == 1024
    assert cfg.rollout.max_new_tokens == 1024
    assert cfg.train.mini_batches == 4
    assert cfg.eval.num_examples == 1319
    assert cfg.seed == 42


def test_no_path_gives_defaults():
    assert load_config() == ExperimentConfig()
    assert load_config(None, []) == ExperimentConfig()


def test_empty_file_gives_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing here\n")
    assert load_config(p) == ExperimentConfig()


# -------------------------------------------------------------------------- overrides


def test_scalar_overrides():
    cfg = load_config(
        TINY,
        [
            "algorithm.kl_coef=0.002",
            "train.lr=3e-5",
            "train.steps=7",
            "rollout.temperature=0.5",
            "name=other",
        ],
    )
    assert cfg.algorithm.kl_coef == pytest.approx(0.002)
    assert cfg.train.lr == pytest.approx(3e-5)
    assert cfg.train.steps == 7
    assert cfg.rollout.temperature == pytest.approx(0.5)
    assert cfg.name == "other"
    # Untouched values keep the file's values.
    assert cfg.rollout.n_samples == 8


def test_list_null_and_boolean_overrides():
    cfg = load_config(
        TINY,
        [
            "data.synthetic_steps=[1,3]",
            "data.synthetic_operations=['+', '*']",
            "data.subset=null",
            "data.use_chat_template=true",
            "model.trust_remote_code=false",
            'rollout.stop=["####", "\\n\\n"]',
            "train.num_threads=null",
        ],
    )
    assert cfg.data.synthetic_steps == (1, 3)
    assert cfg.data.synthetic_operations == ["+", "*"]
    assert cfg.data.subset is None
    assert cfg.data.use_chat_template is True
    assert cfg.model.trust_remote_code is False
    assert cfg.rollout.stop == ["####", "\n\n"]
    assert cfg.train.num_threads is None


def test_override_value_may_contain_equals_sign():
    cfg = load_config(None, ["data.system_prompt=answer after '####' (a=b)"])
    assert cfg.data.system_prompt == "answer after '####' (a=b)"


def test_plain_template_is_a_field_with_a_default_and_needs_the_question():
    assert load_config(None).data.plain_template == "Question: {question}\nAnswer:"
    cfg = load_config(None, ["data.plain_template=Problem {question} =>"])
    assert cfg.data.plain_template == "Problem {question} =>"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.plain_template=Answer this"])
    message = str(info.value)
    assert "data.plain_template: must contain '{question}' where the question goes" in message
    assert "'Answer this'" in message  # the value given


def test_plain_template_from_yaml_keeps_other_braces(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('data:\n  use_chat_template: false\n  plain_template: "Q: {question}\\nA ({x}):"\n')
    cfg = load_config(path)
    assert cfg.data.plain_template == "Q: {question}\nA ({x}):" and cfg.data.use_chat_template is False


def test_override_creates_missing_sections():
    cfg = load_config(None, ["checkpoint.every=5", "eval.max_new_tokens=64"])
    assert cfg.checkpoint.every == 5
    assert cfg.eval.max_new_tokens == 64


def test_apply_overrides_returns_a_copy():
    data = {"train": {"lr": 0.1}}
    out = apply_overrides(data, ["train.lr=0.2", "algorithm.kl_coef=0.001"])
    assert out == {"train": {"lr": 0.2}, "algorithm": {"kl_coef": 0.001}}
    assert data == {"train": {"lr": 0.1}}


def test_malformed_override():
    with pytest.raises(ConfigError, match=r"'foo' is not of the form section\.key=value"):
        load_config(TINY, ["foo"])
    with pytest.raises(ConfigError, match="empty key"):
        load_config(TINY, ["=1"])


def test_override_into_a_scalar():
    with pytest.raises(ConfigError, match=r"train\.lr is a value, not a section"):
        load_config(TINY, ["train.lr.x=1"])
    # Without a file the scalar is not in the dict yet; validation still rejects it by path.
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(None, ["train.lr.x=1"])


# ------------------------------------------------------------------------ bad values


def _error(overrides: list[str], path: Path | None = TINY) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_unknown_key_names_path_and_allowed_keys():
    msg = _error(["algorithm.kl_coeff=0.1"])
    assert "algorithm.kl_coeff: unknown key" in msg
    allowed = re.search(r"allowed keys: (.*)", msg).group(1).split(", ")
    assert "kl_coef" in allowed and "kl_kind" in allowed and "clip_high" in allowed
    assert allowed == sorted(allowed)


def test_unknown_top_level_key_lists_sections():
    msg = _error(["trainer.lr=1"])
    assert "trainer: unknown key" in msg
    allowed = re.search(r"allowed keys: (.*)", msg).group(1).split(", ")
    assert {"train", "rollout", "algorithm", "model", "data"} <= set(allowed)


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  n_sample: 4\n")
    msg = _error([], p)
    assert str(p) in msg
    assert "rollout.n_sample: unknown key" in msg
    assert "n_samples" in msg


def test_bad_literal_names_path_and_allowed_values():
    msg = _error(["algorithm.kl_kind=k4"])
    assert "algorithm.kl_kind: got 'k4'; allowed values:" in msg
    for kind in ("'k1'", "'k2'", "'k3'", "'low_var_kl'"):
        assert kind in msg
    msg = _error(["model.dtype=fp8"])
    assert "model.dtype: got 'fp8'" in msg and "'bfloat16'" in msg
    msg = _error(["data.synthetic_operations=['/']"])
    assert "data.synthetic_operations.0: got '/'" in msg


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("train.lr=-0.1", "train.lr"),
        ("train.lr=0", "train.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.temperature=-1", "rollout.temperature"),
        ("algorithm.clip_low=1.0", "algorithm.clip_low"),
        ("eval.pass_k=0", "eval.pass_k"),
        ("rollout.n_samples=abc", "rollout.n_samples"),
    ],
)
def test_out_of_range_values_name_the_field(override, path):
    msg = _error([override])
    assert f"{path}:" in msg
    assert "(got " in msg  # the offending value is echoed


def test_top_k_zero_is_refused_at_load_not_at_the_first_request():
    msg = _error(["rollout.top_k=0"])
    assert "rollout.top_k:" in msg and "use -1 (off) or >= 1" in msg


def test_clip_low_above_clip_high():
    msg = _error(["algorithm.clip_low=0.3", "algorithm.clip_high=0.2"])
    assert "algorithm.clip_low (0.3) must not exceed algorithm.clip_high (0.2)" in msg


def test_rollout_correction_fields_validate_and_name_the_field():
    msg = _error(["algorithm.icepop_low=0.5"])
    assert "algorithm.icepop_low and algorithm.icepop_high bound one band" in msg
    assert "got 0.5 and None" in msg
    assert "algorithm.icepop_high: Input should be greater than 1 (got 0.9)" in _error(
        ["algorithm.icepop_low=0.5", "algorithm.icepop_high=0.9"])
    assert "algorithm.icepop_low: Input should be less than 1 (got 1.5)" in _error(
        ["algorithm.icepop_low=1.5", "algorithm.icepop_high=2"])
    assert "algorithm.seq_mask_threshold:" in _error(["algorithm.seq_mask_threshold=0"])
    msg = _error(["algorithm.seq_mask_metric=median"])
    assert "algorithm.seq_mask_metric: got 'median'" in msg and "'mean'" in msg
    assert "algorithm.tis_mode: got 'clip'" in _error(["algorithm.tis_mode=clip"])
    # MIS masks above tis_cap: without a cap it would silently do nothing, also when
    # max_staleness would turn truncated TIS on by itself
    for extra in ([], ["rollout.max_staleness=1"]):
        msg = _error(["algorithm.tis_mode=mask", *extra])
        assert "algorithm.tis_mode=mask" in msg and "set algorithm.tis_cap" in msg
    cfg = load_config(TINY, ["algorithm.tis_cap=2", "algorithm.tis_mode=mask",
                             "algorithm.tis_level=geometric", "algorithm.icepop_low=0.5",
                             "algorithm.icepop_high=2", "algorithm.seq_mask_threshold=1",
                             "algorithm.seq_mask_metric=mean"])  # fmt: skip
    a = cfg.algorithm
    assert (a.tis_mode, a.tis_level, a.icepop_low, a.icepop_high) == ("mask", "geometric", 0.5, 2.0)
    assert (a.seq_mask_threshold, a.seq_mask_metric) == (1.0, "mean")


def test_grpo_needs_two_samples():
    msg = _error(["rollout.n_samples=1"])
    assert "rollout.n_samples must be >= 2" in msg
    # Dr.GRPO has no std, so a group of one is allowed there.
    cfg = load_config(TINY, ["rollout.n_samples=1", "algorithm.advantage=drgrpo"])
    assert cfg.rollout.n_samples == 1


def test_rollouts_divisible_by_mini_batches():
    msg = _error(["train.prompts_per_step=3", "rollout.n_samples=3", "train.mini_batches=2"])
    assert "train.prompts_per_step * rollout.n_samples (9)" in msg
    assert "train.mini_batches (2)" in msg
    cfg = load_config(
        TINY, ["train.prompts_per_step=3", "rollout.n_samples=4", "train.mini_batches=6"]
    )
    assert cfg.train.mini_batches == 6


def test_bad_synthetic_ranges():
    msg = _error(["data.synthetic_steps=[3,1]"])
    assert "synthetic_steps must be (low, high)" in msg
    msg = _error(["data.synthetic_digits=[0,1]"])
    assert "synthetic_digits" in msg


def test_every_error_is_reported_at_once():
    msg = _error(["train.lr=-1", "algorithm.kl_kind=k9", "rollout.bogus=1"])
    assert "train.lr:" in msg
    assert "algorithm.kl_kind:" in msg
    assert "rollout.bogus: unknown key" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------------ bad files


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)  # a directory is not a config file


def test_non_mapping_yaml(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping at the top level"):
        load_config(p)
    p.write_text("just a string\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(p)


def test_invalid_yaml(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("train: {lr: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


# --------------------------------------------------------------- flatten and digest


def test_flatten():
    cfg = load_config(TINY)
    flat = flatten(cfg)
    assert flat["train.lr"] == pytest.approx(1e-4)
    assert flat["algorithm.kl_kind"] == "low_var_kl"
    assert flat["data.synthetic_steps"] == [1, 2]  # JSON form: tuples become lists
    assert flat["data.subset"] is None
    assert flat["name"] == "tiny-cpu"
    assert not any(isinstance(v, dict) for v in flat.values())
    # Every leaf field of every section is present.
    for section in ExperimentConfig.model_fields:
        sub = getattr(cfg, section)
        if hasattr(sub, "model_fields"):
            for name in type(sub).model_fields:
                if hasattr(getattr(sub, name), "model_fields"):  # a nested section
                    assert any(k.startswith(f"{section}.{name}.") for k in flat), name
                else:
                    assert f"{section}.{name}" in flat
        else:
            assert section in flat
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
    assert flatten({"a": {"b": 1}}, prefix="p/") == {"p/a.b": 1}


def test_config_digest_is_stable(tmp_path):
    a = load_config(TINY)
    b = load_config(TINY)
    digest = config_digest(a)
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert config_digest(b) == digest
    # Key order in the file does not matter; values do.
    text = TINY.read_text().splitlines()
    p = tmp_path / "reordered.yaml"
    blocks, current = [], []
    for line in text:
        if line and not line.startswith((" ", "#")) and current:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    p.write_text("\n".join(line for block in reversed(blocks) for line in block) + "\n")
    assert load_config(p) == a
    assert config_digest(load_config(p)) == digest
    # An override to the same value is the same config; any change is a new digest.
    assert config_digest(load_config(TINY, ["train.lr=1e-4"])) == digest
    assert config_digest(load_config(TINY, ["train.lr=2e-4"])) != digest
    assert config_digest(load_config(TINY, ["seed=1"])) != digest
    assert config_digest(load_config(QWEN)) != digest


def test_distributed_sync_on_colocated_gpus_is_refused_with_the_fix() -> None:
    from rl_core.config import ConfigError, load_config

    bad = ["cluster.mode=ray", "cluster.placement=colocated", "cluster.gpus_per_trainer=1",
           "cluster.gpus_per_engine=1", "rollout.weight_sync=distributed"]  # fmt: skip
    with pytest.raises(ConfigError, match="Duplicate GPU detected.*cluster.placement=disaggregated"):
        load_config(CONFIGS / "tiny-cpu.yaml", bad)
    # on CPU (gloo) and disaggregated GPUs it is fine
    load_config(CONFIGS / "tiny-cpu.yaml", bad[:2] + ["rollout.weight_sync=distributed"])
    load_config(CONFIGS / "tiny-cpu.yaml", ["cluster.placement=disaggregated", *bad[2:]])


def test_every_field_is_described_and_the_reference_is_the_schema() -> None:
    """docs/configuration.md's reference is generated from the schema (every field of the
    GRPO and the SFT config: type, default, description); it must be current, and no field
    may go undescribed."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  root / "scripts" / "config_reference.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    from rl_core.config import ExperimentConfig
    from rl_core.sft import SFTConfig

    bare = [p for model in (ExperimentConfig, SFTConfig) for p, _, _, d in ref.rows(model) if not d]
    assert not bare, f"fields without a description: {bare}"
    doc = (root / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc.split(ref.START, 1)[1].split(ref.END, 1)[0] == "\n" + ref.reference(), (
        "docs/configuration.md is out of date: run python scripts/config_reference.py")


def test_pause_mode_needs_a_stream_whose_rounds_span_updates():
    """rollout.pause_mode only changes a streamed round in flight during an update: refused
    where no round ever is (no stream, or deterministic rounds), named with the fix."""
    with pytest.raises(ConfigError, match=r"rollout\.pause_mode=in_place .*rollout\.streaming=true"):
        load_config(None, ["rollout.pause_mode=in_place"])
    with pytest.raises(ConfigError, match=r"rollout\.pause_mode=retract needs "
                                          r"rollout\.deterministic=false"):
        load_config(None, ["rollout.streaming=true", "rollout.max_staleness=1",
                           "rollout.pause_mode=retract"])
    cfg = load_config(None, ["rollout.streaming=true", "rollout.max_staleness=1",
                             "rollout.deterministic=false", "rollout.pause_mode=in_place"])
    assert cfg.rollout.pause_mode == "in_place"
    with pytest.raises(ConfigError, match=r"rollout\.pause_mode"):
        load_config(None, ["rollout.pause_mode=hold"])
