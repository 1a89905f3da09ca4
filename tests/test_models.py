"""The embedded tiny model and model resolution (local dirs, hub ids, the demo model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_core.base_model import bootstrap_tiny_model, greedy_accuracy, snapshot_model
from rl_core.config import load_config
from rl_core.data.synthetic import generate_splits
from rl_core.models.hub import ModelError, tiny_spec_for, verify_model_dir
from rl_core.models.tiny import TinyModelSpec
from rl_core.weight_sync import weights_checksum

ROOT = Path(__file__).resolve().parents[1]


def test_demo_model_is_a_hugging_face_model(demo_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (demo_model / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    tok = AutoTokenizer.from_pretrained(demo_model)
    assert model.config.model_type == "qwen2"
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 5_000_000, n_params
    assert (
        tok.chat_template
        and tok.eos_token_id == GenerationConfig.from_pretrained(demo_model).eos_token_id
    )
    # Digits are single tokens, so arithmetic is learnable.
    assert [tok.decode([t]) for t in tok.encode("1234", add_special_tokens=False)] == list("1234")


def test_demo_model_starts_between_20_and_60_percent(demo_model: Path) -> None:
    """Held-out greedy accuracy of the warm start lands in the band the demo needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    d = cfg.data
    _, test = generate_splits(
        d.synthetic_train_size,
        d.synthetic_test_size,
        d.seed,
        **d.synthetic_knobs(),
    )
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    acc = greedy_accuracy(model, AutoTokenizer.from_pretrained(demo_model), test)
    assert 0.2 <= acc <= 0.6, acc
    info = json.loads((demo_model / "grpoflow_tiny.json").read_text())
    assert info["digest"] == tiny_spec_for(cfg.model, cfg.data).digest()


def test_bootstrap_is_deterministic_and_cached(tmp_path: Path) -> None:
    spec = TinyModelSpec(
        hidden_size=32,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate_size=64,
        train_size=600,
        test_size=50,
        val_examples=50,
        sft_max_steps=3,
        eval_every=100,
        sft_batch_size=8,
    )
    a = bootstrap_tiny_model(tmp_path / "a", spec)
    b = bootstrap_tiny_model(tmp_path / "b", spec)

    from safetensors.torch import load_file

    assert weights_checksum(load_file(a / "model.safetensors")) == weights_checksum(
        load_file(b / "model.safetensors")
    )
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    stamp = (a / "grpoflow_tiny.json").stat().st_mtime_ns
    bootstrap_tiny_model(tmp_path / "a", spec)  # same spec: reused, not rebuilt
    assert (a / "grpoflow_tiny.json").stat().st_mtime_ns == stamp


def test_verify_model_dir_names_what_is_missing(tmp_path: Path, demo_model: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        verify_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        verify_model_dir(tmp_path / "empty")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((demo_model / "config.json").read_text())
    with pytest.raises(ModelError, match="no weights"):
        verify_model_dir(partial)
    (partial / "model.safetensors").write_bytes((demo_model / "model.safetensors").read_bytes())
    with pytest.raises(ModelError, match="tokenizer"):
        verify_model_dir(partial)


def test_model_references_that_are_neither_dirs_nor_hub_ids(tmp_path: Path) -> None:
    """Hub downloads and the content-keyed cache are tested in test_model_cache.py."""
    for path in ("./missing/dir", "/abs/missing", "just-a-name", "a/b/c", "gs://bucket/m"):
        bad = load_config(None, [f"model.path={path}"])
        with pytest.raises(ModelError, match="neither an existing directory nor a hub id"):
            snapshot_model(bad.model, bad.data, tmp_path)
