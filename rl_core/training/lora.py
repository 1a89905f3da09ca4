"""LoRA on the torch backend through ``peft``: wrap, name, write, merge (``train.lora``).

:func:`apply_lora` wraps the model (only the adapters train). The weights' three forms, each
from the full state_dict: :func:`adapter_tensors` (peft's names: sync, checkpoint, checksum),
:func:`merged_tensors` (the HF export) and :func:`model_keys` (for restores). QLoRA:
:func:`quantization`, the 4-bit base's ``BitsAndBytesConfig``. ``train.lora.per_role``: one
adapter per role (:func:`role_adapter_names`), each form taken per adapter name. docs/lora.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rl_core.config import LoraConfig

__all__ = ["ADAPTER_DIR", "ROLE_ADAPTERS_DIR", "adapter_config", "adapter_tensors", "apply_lora",
           "base_tensors", "merged_tensors", "model_keys", "quantization", "role_adapter_names", "write_adapter"]

ADAPTER_DIR = "adapter"  # beside the merged model in an export
ROLE_ADAPTERS_DIR = "adapters"  # train.lora.per_role: adapters/<role>/ in an export or checkpoint
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
    """``model``'s 4-bit layers kept off bitsandbytes' AVX512-BF16 CPU repack, which breaks
    the next training forward (docs/lora.md, "QLoRA"): every CPU runs the portable kernel;
    GPUs never consult the switch."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def role_adapter_names(cfg: LoraConfig, roles: Sequence[str]) -> dict[str, str]:
    """``train.lora.per_role``: each role's adapter name (on the engines and in the trainer's
    peft model): ``<train.lora.name>-<role>``."""
    return {role: f"{cfg.name}-{role}" for role in roles}


def apply_lora(model: torch.nn.Module, cfg: LoraConfig,
               adapters: Sequence[str] = (_ADAPTER,)) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``cfg.target_modules`` (B = 0: it starts as the base);
    ``adapters``: their names, one set per name (the first is active)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    if missing := sorted(set(cfg.target_modules) - names):
        raise ValueError(f"train.lora.target_modules {missing} match no linear layer of the "
                         f"model (its linear layers: {sorted(names)})")
    # A vision-language model's tower has layers of the same names (gate/up/down_proj): the
    # adapters go on its language model only.
    vision = getattr(getattr(model, "model", None), "visual", None) is not None
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none",
                              use_rslora=cfg.use_rslora, task_type="CAUSAL_LM",
                              exclude_modules=r".*\bvisual\..*" if vision else None)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        wrapped = get_peft_model(model, peft_cfg, adapter_name=adapters[0])
        for name in adapters[1:]:  # per role: one more set, same config (peft's add_adapter)
            wrapped.add_adapter(name, peft_cfg)
        return wrapped


def scaling(cfg: LoraConfig) -> float:
    """PEFT's ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)."""
    return cfg.alpha / (math.sqrt(cfg.rank) if cfg.use_rslora else cfg.rank)


def adapter_config(model: Any, adapter: str = _ADAPTER) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` content (JSON types only)."""
    raw = model.peft_config[adapter].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v))
            for k, v in raw.items()}


def adapter_tensors(full: Mapping[str, torch.Tensor],
                    adapter: str = _ADAPTER) -> dict[str, torch.Tensor]:
    """The LoRA tensors of adapter ``adapter`` in a wrapped model's state_dict, under peft's
    saved names (which do not name the adapter)."""
    marker = f".{adapter}.weight"
    return {k.replace(marker, ".weight"): v.detach() for k, v in full.items()
            if (".lora_A." in k or ".lora_B." in k) and k.endswith(marker)}


def model_keys(adapter: Mapping[str, torch.Tensor], name: str = _ADAPTER
               ) -> dict[str, torch.Tensor]:
    """Inverse of :func:`adapter_tensors`: the wrapped model's state_dict names."""
    return {k.removesuffix(".weight") + f".{name}.weight": v for k, v in adapter.items()}


def base_tensors(full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's own weights in a wrapped model's state_dict, under the base's names."""
    return {k.removeprefix(_PREFIX).replace(".base_layer.", "."): v.detach().clone()
            for k, v in full.items() if ".lora_" not in k}


def merged_tensors(full: Mapping[str, torch.Tensor], cfg: LoraConfig,
                   base: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's weights with each adapter merged in, under the base model's names;
    ``base``: the base's own weights by those names (QLoRA: the full-precision ones), else
    the wrapped model's."""
    out = base_tensors(full) if base is None else {k: v.detach().clone() for k, v in base.items()}
    lora = adapter_tensors(full)
    for k, a in lora.items():
        if ".lora_A." not in k:
            continue
        b = lora[k.replace(".lora_A.", ".lora_B.")]
        target = k.removeprefix(_PREFIX).replace(".lora_A.weight", ".weight")
        w = out[target]
        w += (scaling(cfg) * (b.float() @ a.float())).to(w.dtype)
    return out


def write_adapter(model: Any, path: str | Path, tensors: Mapping[str, torch.Tensor],
                  adapter: str = _ADAPTER) -> None:
    """A PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.peft_config[adapter].save_pretrained(str(path))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
