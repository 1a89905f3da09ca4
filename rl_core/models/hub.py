"""Resolving a model reference to a verified local Hugging Face directory.

``model.path`` may be ``embedded:tiny`` (built here by :mod:`rl_core.models.tiny`), a local
HF directory, or a Hugging Face hub id (downloaded with ``huggingface_hub``, the real loader;
tests replace the download with a local fixture because nothing can be fetched here). Every
result is verified to load (config, tokenizer, weights) before anything else starts.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rl_core.config import DataConfig, ModelConfig
from rl_core.models.tiny import TinyModelSpec, bootstrap_tiny_model

__all__ = ["ModelError", "resolve_model", "tiny_spec_for", "verify_model_dir"]

log = logging.getLogger(__name__)

EMBEDDED_TINY = "embedded:tiny"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]


class ModelError(ValueError):
    """A model reference that cannot be used; the message names the path and the fix."""


def tiny_spec_for(model: ModelConfig, data: DataConfig) -> TinyModelSpec:
    """The tiny model is warm-started on the same synthetic task the run trains on."""
    return TinyModelSpec(
        hidden_size=model.tiny_hidden_size,
        layers=model.tiny_layers,
        heads=model.tiny_heads,
        kv_heads=model.tiny_kv_heads,
        intermediate_size=model.tiny_intermediate_size,
        vocab_size=model.tiny_vocab_size,
        **data.synthetic_knobs(),
        data_seed=data.seed,
        train_size=data.synthetic_train_size,
        test_size=data.synthetic_test_size,
        sft_max_steps=model.tiny_sft_steps,
        target_accuracy=model.tiny_target_accuracy,
        seed=model.seed,
    )


def verify_model_dir(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """Check that ``path`` holds a loadable HF causal LM: config, tokenizer, weights."""
    from transformers import AutoConfig, AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p} has no config.json; is model.path an HF model directory?")
    try:
        AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - report any loader failure with the path
        raise ModelError(f"{p}/config.json does not load: {exc}") from exc
    weights = list(p.glob("*.safetensors")) + list(p.glob("pytorch_model*.bin"))
    if not weights:
        raise ModelError(f"{p} has no weights (*.safetensors or pytorch_model*.bin)")
    vocab_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((p / f).is_file() for f in vocab_files):
        # transformers would build an empty tokenizer from the model type alone.
        raise ModelError(
            f"{p} has no tokenizer ({', '.join(vocab_files)}); copy the tokenizer files "
            "of the base model into it"
        )
    try:
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(
            f"{p}: the tokenizer does not load ({exc}); a model directory needs "
            "tokenizer.json or the tokenizer files of its family"
        ) from exc
    if tok.eos_token_id is None:
        raise ModelError(f"{p}: the tokenizer has no eos_token; set it in tokenizer_config.json")
    return p


def resolve_model(
    model: ModelConfig,
    data: DataConfig,
    cache_dir: str | Path,
    *,
    token: str | None = None,
) -> tuple[Path, bool]:
    """Return (local verified directory, whether it came from the cache)."""
    cache = Path(cache_dir)
    if model.path == EMBEDDED_TINY:
        spec = tiny_spec_for(model, data)
        out = cache / "models" / f"tiny-{spec.digest()}"
        cached = (out / "grpoflow_tiny.json").is_file()
        if not cached:
            log.info("building the embedded tiny model in %s (first run only)", out)

        def progress(step: int, loss: float, acc: float | None) -> None:
            if acc is not None:
                log.info(
                    "  warm start step %d: loss %.3f, validation greedy accuracy %.3f "
                    "(stops at %.2f)", step, loss, acc, spec.target_accuracy,
                )

        bootstrap_tiny_model(out, spec, progress=progress)
        return verify_model_dir(out), cached
    local = Path(model.path).expanduser()
    if local.exists():
        return verify_model_dir(local, trust_remote_code=model.trust_remote_code), True
    if model.path.startswith(("/", ".", "~")) or model.path.count("/") != 1:
        raise ModelError(
            f"model.path={model.path!r} is neither an existing directory nor a hub id "
            "(`org/name`); fix the path or use embedded:tiny"
        )
    from huggingface_hub import snapshot_download

    target = cache / "models" / "hub" / model.path.replace("/", "--")
    marker = target / ".grpoflow_complete"
    cached = marker.is_file()
    if not cached:
        snapshot_download(
            repo_id=model.path,
            local_dir=target,
            allow_patterns=_HUB_PATTERNS,
            token=token,
        )
        verify_model_dir(target, trust_remote_code=model.trust_remote_code)
        marker.write_text(json.dumps({"repo_id": model.path}))
    return verify_model_dir(target, trust_remote_code=model.trust_remote_code), cached
