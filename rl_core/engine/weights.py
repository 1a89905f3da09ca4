"""The weights an engine serves: state_dict names, tied aliases, host offload and the checksum.

:class:`ServedWeights` checks incoming named tensors against the model's names and shapes,
copies them in (fused MoE experts also by their per-expert checkpoint names, into their
slices), moves the weights to a host buffer and back, and caches their checksum (recomputed
after each copy; offload and restore keep it). Only the engine's scheduler thread changes the
weights, at a safe point. Never reads files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from rl_core.weight_sync import weights_checksum

__all__ = ["ServedWeights"]

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up|down)_proj$")
Part = tuple[str, int, slice | None]  # canonical fused name, expert, rows (None: all)


def _expert_parts(name: str, shape: tuple[int, ...]) -> dict[str, tuple[Part, tuple[int, ...]]]:
    """The per-expert checkpoint names that make up fused expert tensor ``name`` (none for
    any other tensor), each with its slice and shape."""
    m = _FUSED.match(name)
    if m is None or len(shape) != 3:
        return {}
    experts, rows, cols = shape
    out: dict[str, tuple[Part, tuple[int, ...]]] = {}
    for e in range(experts):
        base = f"{m['prefix']}.{e}."
        if m["proj"] == "down":
            out[base + "down_proj.weight"] = ((name, e, None), (rows, cols))
        else:
            half = rows // 2
            out[base + "gate_proj.weight"] = ((name, e, slice(0, half)), (half, cols))
            out[base + "up_proj.weight"] = ((name, e, slice(half, rows)), (half, cols))
    return out


class ServedWeights:
    """The named weights of ``model`` and their cached checksum (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._tensors: dict[str, torch.Tensor] = {}  # canonical name -> Parameter / buffer
        self._canonical: dict[str, str] = {}  # state_dict name -> canonical name
        seen: dict[int, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            canon = seen.setdefault(id(t), name)
            self._canonical[name] = canon
            self._tensors.setdefault(canon, t)
        self._shapes = {n: tuple(self._tensors[c].shape) for n, c in self._canonical.items()}
        self._parts: dict[str, Part] = {}  # per-expert name -> slice of a fused tensor
        self._part_shapes: dict[str, tuple[int, ...]] = {}
        self._parts_of: dict[str, int] = {}  # fused canonical name -> how many parts
        for canon, t in self._tensors.items():
            for part, (where, shape) in _expert_parts(canon, tuple(t.shape)).items():
                self._parts[part], self._part_shapes[part] = where, shape
                self._parts_of[canon] = self._parts_of.get(canon, 0) + 1
        self.offloaded: dict[str, torch.Tensor] | None = None  # canonical name -> host tensor
        self._checksum: str | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every state_dict name and its shape."""
        return self._shapes

    @property
    def checksum(self) -> str:
        """:func:`~rl_core.weight_sync.weights_checksum` of the weights, computed on first use
        after a change."""
        if self._checksum is None:
            self._checksum = weights_checksum(self.named())
        return self._checksum

    def invalidate(self) -> None:
        """The tensors changed in place: the checksum is recomputed when next asked for."""
        self._checksum = None

    def named(self) -> dict[str, torch.Tensor]:
        """Every state_dict name and its tensor (from the host buffer while offloaded)."""
        src = self.offloaded
        return {n: (src[c] if src is not None else self._tensors[c].data)
                for n, c in self._canonical.items()}

    def mismatches(self, named: Mapping[str, torch.Tensor], *, complete: bool) -> list[str]:
        """What keeps ``named`` from loading: unknown names, wrong shapes and (``complete``:
        every weight must be given, tied aliases excepted) missing names. Empty if none."""
        unknown = sorted(n for n in named if n not in self._canonical and n not in self._parts)
        expected = {**self._part_shapes, **self._shapes}
        shapes = [f"{n}: got {tuple(t.shape)}, model has {expected[n]}"
                  for n, t in named.items()
                  if n in expected and tuple(t.shape) != expected[n]]
        covered = {self._canonical[n] for n in named if n in self._canonical}
        parts: dict[str, int] = {}
        for n in named:
            if n in self._parts:
                parts[self._parts[n][0]] = parts.get(self._parts[n][0], 0) + 1
        covered |= {c for c, k in parts.items() if k == self._parts_of[c]}
        missing = sorted(set(self._tensors) - covered) if complete else []
        found = (("unknown names", unknown), ("missing names", missing),
                 ("shape mismatches", shapes))
        return [f"{what} {names[:10]}" for what, names in found if names]

    def copy_in(self, named: Mapping[str, torch.Tensor]) -> None:
        """Copy ``named`` (checked by :meth:`mismatches`) into the weights."""
        src = self.offloaded
        for name, t in named.items():
            if name in self._parts:
                canon, expert, rows = self._parts[name]
                whole = src[canon] if src is not None else self._tensors[canon].data
                (whole[expert] if rows is None else whole[expert, rows]).copy_(t)
                continue
            canon = self._canonical[name]
            (src[canon] if src is not None else self._tensors[canon].data).copy_(t)
        self.invalidate()

    def attach(self, named: Mapping[str, torch.Tensor]) -> int:
        """Serve ``named`` (checked by :meth:`mismatches`, complete) in place of the weights:
        each parameter of the same dtype and device becomes that tensor (a view of a shared
        segment: no copy); the rest are copied in. How many were attached."""
        if self.offloaded is not None:
            self.copy_in(named)
            return 0
        attached = 0
        for name, t in named.items():
            if name in self._parts:  # a per-expert slice of a fused tensor: copied
                self.copy_in({name: t})
                continue
            served = self._tensors[self._canonical[name]]
            if served.dtype == t.dtype and served.device == t.device:
                served.data = t
                attached += 1
            else:
                served.data.copy_(t)
        self.invalidate()
        return attached

    def offload(self) -> None:
        """Move every tensor to a host buffer; the model's parameters become empty."""
        backup = {}
        for canon, t in self._tensors.items():
            backup[canon] = t.data if t.device.type == "cpu" else t.data.to("cpu")
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.offloaded = backup

    def restore(self, device: torch.device) -> None:
        """Undo :meth:`offload`: the host buffer's tensors back on ``device``."""
        assert self.offloaded is not None
        for canon, t in self._tensors.items():
            t.data = self.offloaded[canon].to(device)
        self.offloaded = None
