"""LoRA adapters in the embedded engine, by SGLang's protocol: loaded by name, chosen per request.

An adapter is a PEFT directory (or its tensors and config in memory). The engine serves one by
*merging* ``scaling * B @ A`` into the base weights at a safe point, one adapter per running
batch (SGLang with ``--max-loras-per-batch 1``); its checksum is that of the tensors as the
trainer names them, so a sync is verified like a full one (docs/lora.md). Refused with the
reason: DoRA, per-module ranks or alphas, ``fan_in_fan_out``, trained biases,
``modules_to_save``, targets that are not linear weights. Never unpickles.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rl_core.weight_sync import weights_checksum

__all__ = ["Adapter", "AdapterError", "Adapters", "parse_adapter", "read_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter the engine cannot serve (the message says why and what to change)."""


@dataclass
class Adapter:
    """A parsed adapter: per target weight name, ``(A (r, in), B (out, r))`` and the scaling."""

    name: str
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float
    rank: int
    checksum: str
    path: str | None = None


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and tensors of a PEFT adapter directory."""
    path = Path(path)
    cfg, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg.is_file() or not weights.is_file():
        raise AdapterError(f"{path}: not a LoRA adapter directory (expected {ADAPTER_CONFIG} "
                           f"and {ADAPTER_WEIGHTS}, as peft's save_pretrained writes)")
    return json.loads(cfg.read_text()), load_file(weights)


def parse_adapter(name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                  shapes: Mapping[str, tuple[int, ...]], path: str | None = None) -> Adapter:
    """Check ``config``/``tensors`` against the model's weight ``shapes`` (state_dict names)."""
    where = path or f"adapter {name!r}"
    why = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        why.append(f"peft_type is {config.get('peft_type')!r}, not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == bad:
            why.append(f"{key} is set")
    if config.get("bias", "none") != "none":
        why.append(f"bias is {config.get('bias')!r} (trained biases are not served)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            why.append(f"{key} is set")
    if why:
        raise AdapterError(f"{where}: the embedded engine cannot serve it: {'; '.join(why)}")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A/B weight")
        parts.setdefault(m["module"] + ".weight", {})[m["ab"]] = t
    deltas = {}
    for weight, ab in parts.items():
        if weight not in shapes or len(shapes[weight]) != 2:
            raise AdapterError(f"{where}: it targets {weight!r}, which is not a linear weight "
                               "of the served model (another base model?)")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {weight} has lora_{next(iter(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[weight]
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise AdapterError(f"{where}: {weight}: A {tuple(a.shape)} and B {tuple(b.shape)} "
                               f"do not fit a ({out}, {inp}) weight at rank {rank}")
        deltas[weight] = (a, b)
    if not deltas:
        raise AdapterError(f"{where}: no LoRA weights")
    return Adapter(name, deltas, scaling, rank, weights_checksum(dict(tensors)), path)


class Adapters:
    """The adapters an engine holds and which one its weights serve now (merged).
    ``live()``: the served weights by state_dict name (the host buffer while offloaded);
    ``changed()`` runs after every merge or unmerge. Only the scheduler thread calls
    :meth:`activate`, at a safe point."""

    def __init__(self, live: Callable[[], dict[str, torch.Tensor]],
                 changed: Callable[[], None]) -> None:
        self.live, self.changed = live, changed
        self.loaded: dict[str, Adapter] = {}
        self.active: str | None = None
        self._base: dict[str, torch.Tensor] = {}  # weight name -> its base values

    def add(self, adapter: Adapter) -> None:
        """Hold ``adapter`` under its name; a name already loaded is refused (SGLang's rule:
        unload it first)."""
        if adapter.name in self.loaded:
            raise AdapterError(f"LoRA adapter {adapter.name!r} is already loaded; unload it "
                               "first")
        self.loaded[adapter.name] = adapter

    def get(self, name: str) -> Adapter:
        if name not in self.loaded:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: "
                               f"{sorted(self.loaded) or 'none'})")
        return self.loaded[name]

    def remove(self, name: str, running: int = 0) -> None:
        """Drop adapter ``name``; refused while it serves ``running`` requests."""
        self.get(name)
        if self.active == name:
            if running:
                raise AdapterError(f"LoRA adapter {name!r} serves {running} running "
                                   "request(s); pause or abort them first")
            self.activate(None)
        del self.loaded[name]

    def activate(self, name: str | None) -> bool:
        """Serve adapter ``name`` (None: the base model); True if the weights changed."""
        if name == self.active:
            return False
        live = self.live()
        with torch.no_grad():
            for weight, base in self._base.items():
                live[weight].copy_(base)
            self._base = {}
            if name is not None:
                adapter = self.loaded[name]
                for weight, (a, b) in adapter.deltas.items():
                    w = live[weight]
                    self._base[weight] = w.clone()
                    delta = (b.to(torch.float32) @ a.to(torch.float32)) * adapter.scaling
                    w.add_(delta.to(device=w.device, dtype=w.dtype))
        self.active = name
        self.changed()
        return True

    def describe(self) -> list[dict[str, Any]]:
        """What ``/v1/models``-style listings show: name, path, rank, checksum."""
        return [{"lora_name": a.name, "lora_path": a.path, "rank": a.rank,
                 "checksum": a.checksum, "active": a.name == self.active}
                for a in self.loaded.values()]
