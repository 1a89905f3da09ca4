"""The trainer side of every weight transport: :class:`WeightSource`, mixed into each trainer.

A trainer provides ``export_weights()`` (the policy by HF name) and ``_write_hf(path, weights)``;
this class turns them into ``write_weights`` (``disk``), ``put_weights`` (``object_store``) and
the rank-0 side of a broadcast group (``distributed``: one broadcast per tensor, by checkpoint
name, docs/moe.md), taking the checksum where the weights are written. Every rank of a
multi-rank trainer calls them (the export may be a collective); only the rank whose
``_sends_weights`` is true writes, puts or broadcasts. Every wait is bounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_core.models.moe import hub_layout, names_experts_one_by_one
from rl_core.weight_sync import process_group as pgroup
from rl_core.weight_sync.checksum import weights_checksum

__all__ = ["WeightSource", "from_arrays", "to_arrays"]

log = logging.getLogger(__name__)


def to_arrays(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Named tensors as ``(numpy array, torch dtype name)`` for Ray's object store, where numpy
    arrays come out without a copy; 16-bit floats travel as their raw bits (numpy has no
    bfloat16). :func:`from_arrays` is the inverse."""
    out = {}
    for name, t in weights.items():
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        out[name] = (raw.numpy(), str(t.dtype).removeprefix("torch."))
    return out


def from_arrays(arrays: Mapping[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    """Tensors from :func:`to_arrays` (read-only object-store arrays are copied)."""
    out = {}
    for name, (a, dtype) in arrays.items():
        t = torch.from_numpy(np.array(a))
        out[name] = t.view(getattr(torch, dtype)) if dtype in ("bfloat16", "float16") else t
    return out


class WeightSource:
    """What every trainer offers the transports (see the module docstring)."""

    _sends_weights = True  # rank 0 of a multi-rank trainer
    _groups: dict[str, tuple[Any, str, float]] | None = None  # name -> (group, backend, bound)

    def export_weights(self) -> dict[str, torch.Tensor]:  # pragma: no cover - the trainer's
        raise NotImplementedError

    def _write_hf(self, path: Path, weights: dict[str, torch.Tensor]) -> None:  # pragma: no cover
        raise NotImplementedError

    def write_weights(self, path: str | Path) -> str | None:
        """The policy as HF safetensors in ``path``; the checksum of what was written."""
        weights = self.export_weights()
        checksum = weights_checksum(weights) if self._sends_weights else None
        self._write_hf(Path(path), weights)
        return checksum

    def save_pretrained(self, path: str | Path) -> Path:
        """The policy in HF format (config + safetensors): loadable by transformers, SGLang."""
        self.write_weights(path)
        return Path(path)

    def put_weights(self) -> tuple[Any, str, int] | None:
        """The policy in Ray's object store: ``(ref, checksum, bytes)`` on the sending rank."""
        weights = self.export_weights()
        if not self._sends_weights:
            return None
        import ray

        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        return ray.put(to_arrays(weights)), weights_checksum(weights), nbytes

    def weight_layout(self) -> dict[str, tuple[str, list[int]]]:
        """Name -> (dtype, shape) of every tensor a broadcast sends, in order (sending rank)."""
        weights = self._wire(self.export_weights())
        return {n: (str(t.dtype).removeprefix("torch."), list(t.shape))
                for n, t in weights.items()} if self._sends_weights else {}

    def _wire(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights`` as a broadcast sends them (see the module docstring)."""
        path = getattr(self, "model_path", None)
        return hub_layout(weights) if path and names_experts_one_by_one(path) else weights

    def weight_broadcast_endpoint(self, host: str = "127.0.0.1") -> tuple[str, int]:
        """Where engines rendezvous with this trainer: ``host`` and a port free on it."""
        from rl_core.host import free_port

        return host, free_port(host)

    def open_weight_broadcast(self, master_address: str, master_port: int, world_size: int,
                              group_name: str, backend: str = "gloo",
                              timeout_s: float = 120.0) -> None:
        """Host weight-update group ``group_name`` as rank 0 (blocks until engines join)."""
        if not self._sends_weights:
            return
        self._groups = self._groups if self._groups is not None else {}
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} is already open")
        t0 = time.monotonic()
        pg = pgroup.init_custom_process_group(
            master_address=master_address, master_port=master_port, rank=0,
            world_size=world_size, group_name=group_name, backend=backend, timeout_s=timeout_s,
        )
        self._groups[group_name] = (pg, backend, timeout_s)
        log.info("weight update group %s: %d rank(s) joined at %s:%d (%s) in %.2fs", group_name,
                 world_size, master_address, master_port, backend, time.monotonic() - t0)

    def broadcast_weights(self, group_name: str) -> str | None:
        """Broadcast the policy to ``group_name`` (checkpoint names); its checksum (rank 0)."""
        weights = self.export_weights()  # every rank takes part
        if not self._sends_weights:
            return None
        try:
            pg, backend, timeout_s = (self._groups or {})[group_name]
        except KeyError:
            raise ValueError(f"no weight update group {group_name!r} is open") from None
        if backend == "gloo":
            weights = {n: t.detach().cpu() for n, t in weights.items()}
        pgroup.broadcast_named_tensors(self._wire(weights), pg, timeout_s=timeout_s)
        return weights_checksum(weights)

    def shutdown(self) -> None:
        """Leave every weight-update group (trainers with more to release extend this)."""
        self.close_weight_broadcast()

    def close_weight_broadcast(self, group_name: str | None = None) -> None:
        """Leave ``group_name`` (every weight-update group when None); unknown names are ignored."""
        groups = self._groups or {}
        for name in [group_name] if group_name else list(groups):
            entry = groups.pop(name, None)
            if entry is not None:
                try:
                    pgroup.destroy_process_group(entry[0])
                except Exception as e:  # a peer died: the group is gone either way
                    log.debug("weight update group %s: destroy failed: %s", name, e)
