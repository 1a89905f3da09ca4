"""LoRA adapters in the embedded engine, by SGLang's protocol: loaded by name, chosen per request.

An adapter is a PEFT directory (or its tensors and config in memory); its checksum is that of
the tensors as the trainer names them, so a sync is verified like a full one (docs/lora.md).
With ``max_loras_per_batch`` 1 (the default) the engine serves one adapter per running batch by
*merging* ``scaling * B @ A`` into the base weights at a safe point (SGLang with
``--max-loras-per-batch 1``). With N > 1 nothing is merged: rows of up to N adapters and the
base model share a batch, and :class:`RowAdapters` adds ``scaling * (x A^T) B^T`` to each target
linear's output on the tokens of each adapter's rows (S-LoRA / punica style, unfused).
Refused with the reason: DoRA, per-module ranks or alphas, ``fan_in_fan_out``, trained biases,
``modules_to_save``, targets that are not linear weights. Never unpickles.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rl_core.weight_sync import weights_checksum

__all__ = ["WAIT", "Adapter", "AdapterError", "Adapters", "RowAdapters", "parse_adapter",
           "read_adapter"]

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


WAIT = ""  # Adapters.admit: the request waits for a place in the batch


class Adapters:
    """The adapters an engine holds and how its batches serve them. ``live()``: the served
    weights by state_dict name (the host buffer while offloaded); ``kv``: the running batch
    (engine/kv.py): its ``weights_changed()`` runs after every merge or unmerge, its
    ``row_loras`` are the running requests' adapters, and its ``lora`` is set to :attr:`rows`.
    ``max_per_batch`` 1: one adapter merged at a time (``active``); N > 1: none merged,
    :attr:`rows` applies up to N per batch to ``model``. Only the scheduler thread calls
    :meth:`activate` and :meth:`admit`, at a safe point."""

    def __init__(self, live: Callable[[], dict[str, torch.Tensor]], kv: Any,
                 model: torch.nn.Module | None = None, max_per_batch: int = 1) -> None:
        if max_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1, got {max_per_batch}")
        self.live, self.kv, self.max_per_batch = live, kv, int(max_per_batch)
        self.loaded: dict[str, Adapter] = {}
        self.active: str | None = None
        self._base: dict[str, torch.Tensor] = {}  # weight name -> its base values
        self.rows = None if max_per_batch == 1 else RowAdapters(model, self)
        kv.lora = self.rows

    def add(self, adapter: Adapter) -> None:
        """Hold ``adapter`` under its name; a name already loaded is refused (SGLang's rule:
        unload it first)."""
        if adapter.name in self.loaded:
            raise AdapterError(f"LoRA adapter {adapter.name!r} is already loaded; unload it "
                               "first")
        if self.rows is not None:
            self.rows.check(adapter)
        self.loaded[adapter.name] = adapter

    def get(self, name: str) -> Adapter:
        if name not in self.loaded:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: "
                               f"{sorted(self.loaded) or 'none'})")
        return self.loaded[name]

    def remove(self, name: str, running: int = 0) -> None:
        """Drop adapter ``name``; refused while it serves running requests (merged: the
        ``running`` requests of the batch it is merged for)."""
        self.get(name)
        if self.rows is not None:
            running = self.kv.row_loras.count(name)
        elif self.active != name:
            running = 0
        if running:
            raise AdapterError(f"LoRA adapter {name!r} serves {running} running "
                               "request(s); pause or abort them first")
        if self.active == name:
            self.activate(None)
        del self.loaded[name]
        if self.rows is not None:
            self.rows.forget(name)

    def admit(self, name: str | None, batch: set[str | None]) -> str | None:
        """May a request for adapter ``name`` join a batch serving ``batch`` (its requests'
        adapters, None the base)? None: yes (merged now if it is the batch's first);
        :data:`WAIT`: not before the batch changes (one adapter per batch: another one is
        merged; N: N others in it); else why it never will (its adapter was unloaded)."""
        if self.rows is None:
            if name == self.active:
                return None
            if batch:
                return WAIT
        elif name is None or name in batch:
            return None
        if name is not None and name not in self.loaded:
            return f"LoRA {name!r} unloaded"
        if self.rows is None:
            self.activate(name)
        elif len(batch - {None}) >= self.max_per_batch:
            return WAIT
        return None

    def shares_kv(self, name: str | None) -> bool:
        """Whether a request for ``name`` may reuse cached KV (several adapters per batch:
        only the base model's, the one the prefix cache holds)."""
        return self.rows is None or name is None

    def activate(self, name: str | None) -> bool:
        """Serve adapter ``name`` merged (None: the base model); True if the weights changed."""
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
        self.kv.weights_changed()
        return True

    def describe(self) -> list[dict[str, Any]]:
        """What ``/v1/models``-style listings show: name, path, rank, checksum."""
        return [{"lora_name": a.name, "lora_path": a.path, "rank": a.rank,
                 "checksum": a.checksum, "active": a.name == self.active}
                for a in self.loaded.values()]


class RowAdapters:
    """Unmerged adapters, per row of a batch. Before a forward the KV batch binds the rows'
    adapter names (:meth:`bind`); each target linear's output ``out = x W^T (+ b)`` then gets
    ``scaling_a * (x_a A_a^T) B_a^T`` added on the tokens ``x_a`` of adapter ``a``'s rows,
    one pair of small products per adapter in the batch (rows grouped by adapter). A KV batch
    that runs its own products calls :meth:`apply`; any other target ``nn.Linear`` of
    ``model`` gets a forward hook doing the same. Nothing is bound: nothing is added."""

    def __init__(self, model: torch.nn.Module | None, adapters: Adapters) -> None:
        if model is None:
            raise ValueError("several LoRA adapters per batch need the model")
        self.adapters = adapters
        self._module = {n + ".weight": m for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)}
        self._weight = {id(m): n for n, m in self._module.items()}
        self._hooked: set[str] = set()
        self._names: list[str | None] = []
        self._counts: list[int] | None = None
        self._thread: int | None = None  # the binding thread (hooks fire on no other)
        self._groups: dict[int, list[tuple[str, torch.Tensor | None]]] = {}
        # adapter name -> (its deltas, {linears -> (A^T (in, R), scaled block B^T (R, out))})
        self._mats: dict[str, tuple[Any, dict[tuple[int, ...], Any]]] = {}

    def check(self, adapter: Adapter) -> None:
        """Refuse an adapter with a target that is not an ``nn.Linear``'s weight (or is a
        routed expert's: it sees only some tokens); hook the targets the KV batch may run
        through their modules."""
        if bad := sorted(w for w in adapter.deltas if w not in self._module or ".experts." in w):
            raise AdapterError(f"LoRA adapter {adapter.name!r}: {', '.join(bad)} not the "
                               "weight of an nn.Linear; several adapters per batch add LoRA to "
                               "linear layers only (max_loras_per_batch 1 merges it instead)")
        for w in adapter.deltas:
            if w not in self._hooked:
                self._hooked.add(w)
                self._module[w].register_forward_hook(self._hook)

    def forget(self, name: str) -> None:
        """An unloaded adapter's products are dropped."""
        self._mats.pop(name, None)

    @contextlib.contextmanager
    def bind(self, names: list[str | None], counts: list[int] | None = None) -> Iterator[None]:
        """For the forwards inside: row ``i`` serves adapter ``names[i]`` (None: the base).
        ``counts``: each row's tokens, back to back in the forward's token order; None: every
        row has the same number (tokens split evenly in row order: (rows, T, ...) inputs)."""
        self._names, self._counts = list(names), counts
        self._groups = {}
        self._thread = threading.get_ident() if any(n is not None for n in names) else None
        try:
            yield
        finally:
            self._thread, self._names, self._counts = None, [], None

    def apply(self, linears: tuple[torch.nn.Module, ...], x: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
        """``out`` (the side-by-side outputs of ``linears`` on ``x``) plus each bound row's
        adapter on them."""
        if self._thread is None or threading.get_ident() != self._thread:
            return out
        flat = x.reshape(-1, x.shape[-1])
        y = out.reshape(flat.shape[0], -1)
        for name, idx in self._tokens(flat.shape[0], x.device):
            mats = self._products(name, linears, x)
            if mats is None:
                continue
            a, b = mats
            if idx is None:  # every row of the batch serves this adapter
                y.add_((flat @ a) @ b)
            else:
                y.index_add_(0, idx, (flat.index_select(0, idx) @ a) @ b)
        return y.view(out.shape)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...],
              out: torch.Tensor) -> torch.Tensor:
        return self.apply((module,), args[0], out)

    def _tokens(self, n: int, device: torch.device) -> list[tuple[str, torch.Tensor | None]]:
        """Per adapter of the bound rows, its rows' token indices among ``n`` (None: all)."""
        if (groups := self._groups.get(n)) is not None:
            return groups
        names, counts = self._names, self._counts
        if counts is None:
            if n % len(names):
                raise RuntimeError(f"{n} tokens do not split evenly over {len(names)} rows")
            counts = [n // len(names)] * len(names)
        if sum(counts) != n:
            raise RuntimeError(f"{n} tokens, but the bound rows hold {sum(counts)}")
        distinct = list(dict.fromkeys(x for x in names if x is not None))
        if len(distinct) == 1 and None not in names:
            groups = [(distinct[0], None)]
        else:
            code = torch.tensor([0 if x is None else distinct.index(x) + 1 for x in names])
            code = code.repeat_interleave(torch.tensor(counts))
            groups = [(x, (code == j + 1).nonzero().squeeze(1).to(device))
                      for j, x in enumerate(distinct)]
        self._groups[n] = groups
        return groups

    def _products(self, name: str, linears: tuple[torch.nn.Module, ...],
                  x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Adapter ``name`` on ``linears`` side by side: ``A^T`` of the targeted ones stacked
        (in, R) and their ``scaling * B^T`` block-diagonal (R, sum of out), or None if it
        targets none of them. Cached until the adapter (or its deltas) change."""
        adapter = self.adapters.loaded[name]
        deltas, cache = self._mats.get(name, (None, {}))
        if deltas is not adapter.deltas:
            cache = {}
            self._mats[name] = (adapter.deltas, cache)
        key = tuple(id(m) for m in linears)
        if key not in cache:
            parts = [(adapter.deltas.get(self._weight[id(m)]), m.out_features) for m in linears]
            if all(ab is None for ab, _ in parts):
                cache[key] = None
            else:
                rank, total = adapter.rank, sum(o for _, o in parts)
                a_t = torch.cat([ab[0] for ab, _ in parts if ab is not None]).t()
                b_t = torch.zeros(a_t.shape[1], total, dtype=torch.float32)
                r = col = 0
                for ab, o in parts:
                    if ab is not None:
                        b_t[r : r + rank, col : col + o] = ab[1].t().float() * adapter.scaling
                        r += rank
                    col += o
                cache[key] = (a_t.to(device=x.device, dtype=x.dtype).contiguous(),
                              b_t.to(device=x.device, dtype=x.dtype))
        return cache[key]
