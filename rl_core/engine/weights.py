"""The weights an engine serves: state_dict names, tied aliases, host offload and the checksum.

:class:`ServedWeights` maps every state_dict name to its tensor (tied names such as
``lm_head.weight`` share one), checks incoming named tensors against those names and shapes,
copies them in, moves the weights to a host buffer and back, and keeps their XXH3 checksum
(:func:`rl_core.weight_sync.weights_checksum`), computed on first use and after each copy (release
and restore move the same bytes: the checksum stands). Only the engine's scheduler thread
changes the weights (at a safe point). Never imports Prefect or MLflow; never reads files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rl_core.weight_sync import weights_checksum

__all__ = ["ServedWeights"]


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
        unknown = sorted(n for n in named if n not in self._canonical)
        shapes = [f"{n}: got {tuple(t.shape)}, model has {self._shapes[n]}"
                  for n, t in named.items()
                  if n in self._shapes and tuple(t.shape) != self._shapes[n]]
        covered = {self._canonical[n] for n in named if n in self._canonical}
        missing = sorted(set(self._tensors) - covered) if complete else []
        found = (("unknown names", unknown), ("missing names", missing),
                 ("shape mismatches", shapes))
        return [f"{what} {names[:10]}" for what, names in found if names]

    def copy_in(self, named: Mapping[str, torch.Tensor]) -> None:
        """Copy ``named`` (checked by :meth:`mismatches`) into the weights."""
        src = self.offloaded
        for name, t in named.items():
            canon = self._canonical[name]
            (src[canon] if src is not None else self._tensors[canon].data).copy_(t)
        self.invalidate()

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
