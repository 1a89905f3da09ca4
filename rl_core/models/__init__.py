"""Models: the embedded tiny demo model, resolving model references, shared loading helpers.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["eos_token_ids", "load_policy_model", "read_weights", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``model.dtype`` as a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype={name!r}; allowed values: {sorted(_DTYPES)}") from None


def load_policy_model(path: str | Path, **kwargs: Any) -> torch.nn.Module:  # noqa: ANN401
    """A checkpoint's generating model: the causal LM, or for a vision-language checkpoint (a
    ``vision_config`` in its config) the image-text-to-text model with its vision tower."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rl_core.models.vlm import is_vision_config

    config = AutoConfig.from_pretrained(
        path, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))
    cls = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    return cls.from_pretrained(path, **kwargs)


def eos_token_ids(tokenizer: Any, model: Any, source: object) -> list[int]:
    """Every id that ends generation: the tokenizer's EOS and generation_config's."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in gen if isinstance(gen, list) else [gen]:
        if e is not None:
            ids.add(int(e))
    if not ids:
        raise ValueError(
            f"{source}: the tokenizer has no eos_token and generation_config.json "
            "no eos_token_id; generation could never stop"
        )
    return sorted(ids)


def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a Hugging Face model directory, by the
    names ``transformers`` runs the model with (an MoE checkpoint's per-expert tensors are
    fused as it fuses them: :func:`rl_core.models.moe.fuse_expert_weights`)."""
    from safetensors.torch import load_file

    from rl_core.models.moe import fuse_expert_weights

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory (expected a safetensors model dir)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors load)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return fuse_expert_weights(weights)
