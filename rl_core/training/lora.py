"""LoRA on the torch backend through ``peft``: wrap, name, write, merge (``train.lora``).

The trainer wraps its model with :func:`apply_lora` (only the adapters train). Its weights
then have three forms, each from the model's full state_dict (whole on the sending rank):

- :func:`adapter_tensors`: the LoRA A/B tensors under the names ``peft`` saves them with
  (``base_model.model.<module>.lora_A.weight``): what a weight sync sends, what the engine's
  ``/load_lora_adapter`` reads, what a checkpoint keeps, and what the checksum covers;
- :func:`merged_tensors`: the base model with ``scaling * B @ A`` added to every target, under
  the base model's own names: the exported Hugging Face checkpoint;
- :func:`model_keys`: adapter tensors renamed back to the wrapped model's state_dict names,
  for restoring a checkpoint.

QLoRA (``train.lora.quantize``): :func:`quantization` is the ``BitsAndBytesConfig`` the trainer
loads its frozen base with (4-bit NF4/FP4, bitsandbytes, on CPU, CUDA and ROCm). The adapter
trains on the dequantized base; the engines keep serving the full-precision base with the
adapter on top, and the merged export adds the adapter to the full-precision base read from
``model.path`` (a 4-bit base has no exact full-precision weights to merge into).

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rl_core.config import LoraConfig

__all__ = ["ADAPTER_DIR", "adapter_config", "adapter_tensors", "apply_lora", "merged_tensors",
           "model_keys", "quantization", "write_adapter"]

ADAPTER_DIR = "adapter"  # beside the merged model in an export
_PREFIX, _ADAPTER = "base_model.model.", "default"


def quantization(cfg: LoraConfig, compute_dtype: torch.dtype) -> Any:
    """The ``BitsAndBytesConfig`` of a QLoRA base (``cfg.quantize``), or None."""
    if not cfg.quantize:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"train.lora.quantize={cfg.quantize!r} needs bitsandbytes: "
                          "pip install 'grpoflow[qlora]' (or set train.lora.quantize: null)"
                          ) from exc
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.quantize,
                              bnb_4bit_use_double_quant=cfg.double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def unpacked_4bit(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s 4-bit layers never switch to bitsandbytes' AVX512-BF16 CPU layout.

    On CPUs with AVX512-BF16, ``Linear4bit`` repacks its weight in place at its first
    no-grad, eval-mode forward (log-prob scoring) and then runs another kernel: it needs
    every input width to be a multiple of its block (64), and a training forward after the
    repack fails inside bitsandbytes (an in-place bias add on a view; measured with 0.50.2).
    Off, every CPU runs the same portable kernel (what machines without AVX512-BF16 run);
    on GPUs the switch is never consulted."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``cfg.target_modules`` (B = 0: it starts as the base)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    if missing := sorted(set(cfg.target_modules) - names):
        raise ValueError(f"train.lora.target_modules {missing} match no linear layer of the "
                         f"model (its linear layers: {sorted(names)})")
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none",
                              use_rslora=cfg.use_rslora, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        return get_peft_model(model, peft_cfg)


def scaling(cfg: LoraConfig) -> float:
    """PEFT's ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)."""
    return cfg.alpha / (math.sqrt(cfg.rank) if cfg.use_rslora else cfg.rank)


def adapter_config(model: Any) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` content (JSON types only)."""
    raw = model.peft_config[_ADAPTER].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v))
            for k, v in raw.items()}


def adapter_tensors(full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a wrapped model's state_dict, under peft's saved names."""
    marker = f".{_ADAPTER}.weight"
    return {k.replace(marker, ".weight"): v.detach() for k, v in full.items()
            if (".lora_A." in k or ".lora_B." in k) and k.endswith(marker)}


def model_keys(adapter: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`adapter_tensors`: the wrapped model's state_dict names."""
    return {k.removesuffix(".weight") + f".{_ADAPTER}.weight": v for k, v in adapter.items()}


def merged_tensors(full: Mapping[str, torch.Tensor], cfg: LoraConfig,
                   base: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's weights with each adapter merged in, under the base model's names;
    ``base``: the base's own weights by those names (QLoRA: the full-precision ones), else
    the wrapped model's."""
    out: dict[str, torch.Tensor] = {}
    if base is not None:
        out = {k: v.detach().clone() for k, v in base.items()}
    for k, v in full.items() if base is None else ():
        if ".lora_" in k:
            continue
        out[k.removeprefix(_PREFIX).replace(".base_layer.", ".")] = v.detach().clone()
    lora = adapter_tensors(full)
    for k, a in lora.items():
        if ".lora_A." not in k:
            continue
        b = lora[k.replace(".lora_A.", ".lora_B.")]
        target = k.removeprefix(_PREFIX).replace(".lora_A.weight", ".weight")
        w = out[target]
        w += (scaling(cfg) * (b.float() @ a.float())).to(w.dtype)
    return out


def write_adapter(model: Any, path: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """A PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.peft_config[_ADAPTER].save_pretrained(str(path))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
