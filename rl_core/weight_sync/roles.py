"""Per-role LoRA adapters (``train.lora.per_role``): one adapter per role, each synced by name.

:class:`RoleAdapterSync` wraps one adapter transport per role (:class:`~.transports.TensorSync`
on the in-process plane, :class:`~.transports.DiskSync` on the HTTP plane, each built with the
role's adapter name ``<train.lora.name>-<role>``). A sync stages every role's adapter (the
trainer's ``exporting(role)`` picks which), loads them all in the one pause, and verifies each
by its own checksum (``plane.verify`` with the plane's ``lora_name`` set to that adapter); the
outer :func:`~rl_core.weight_sync.sync_weights` then checks the version. After it the plane
carries ``role_adapters`` (role -> adapter name), which the multi-role episode runner reads to
send each role's turns to its adapter, and ``lora_name`` is the first role's adapter (what the
weight probe and any caller that names no role get). Planes without a trainer (evaluation of a
per-role export) serve the export's ``adapters/<role>/`` by :meth:`serve_exported`.
docs/lora.md, "Per-role adapters".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from rl_core.weight_sync.checksum import weights_checksum
from rl_core.weight_sync.transports import Staged, TensorSync

__all__ = ["RoleAdapterSync"]


class RoleAdapterSync:
    """One adapter transport per role, behind the one transport interface."""

    def __init__(self, plane: Any, transports: dict[str, Any]) -> None:  # noqa: ANN401
        if not transports:
            raise ValueError("RoleAdapterSync needs one transport per role")
        self.plane, self.transports = plane, dict(transports)
        self.adapters = {role: t.lora_name for role, t in self.transports.items()}

    def stage(self, trainer: Any, version: int) -> Staged:  # noqa: ANN401
        parts: dict[str, Staged] = {}
        for role, transport in self.transports.items():
            with trainer.exporting(role):
                parts[role] = transport.stage(trainer, version)
        metrics: dict[str, float] = {}
        for staged in parts.values():
            for k, v in staged.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v
        # checksum None: each adapter was verified by its own at load; the outer check: version
        return Staged(parts, None, sum(s.nbytes for s in parts.values()), metrics)

    def load(self, staged: Staged, engines: Any, version: int) -> None:  # noqa: ANN401
        for role, transport in self.transports.items():
            transport.load(staged.payload[role], engines, version)
        try:
            for role, part in staged.payload.items():
                self.plane.lora_name = self.adapters[role]
                self.plane.verify(version, part.checksum)
        finally:
            self.plane.lora_name = next(iter(self.adapters.values()))
        self.plane.role_adapters = dict(self.adapters)

    def serve_exported(self, model_dir: str | Path) -> bool:
        """Load each role's adapter of a per-role export (``model_dir/adapters/<role>/``, a
        PEFT directory each) onto the engines, verified by checksum, at the plane's version;
        False (nothing loaded) when the export has not every role's adapter."""
        root = Path(model_dir) / "adapters"  # rl_core.training.lora.ROLE_ADAPTERS_DIR
        if not all((root / r / "adapter_model.safetensors").is_file() for r in self.transports):
            return False
        parts = {}
        for role, transport in self.transports.items():
            tensors = load_file(str(root / role / "adapter_model.safetensors"))
            payload: Any = root / role
            if isinstance(transport, TensorSync):  # in process: the tensors and their config
                transport._config = json.loads((root / role / "adapter_config.json").read_text())
                payload = tensors
            parts[role] = Staged(payload, weights_checksum(tensors))
        with self.plane.paused() as engines:
            self.load(Staged(parts, None), engines, self.plane.weight_version)
        return True

    def resync(self, target: Any) -> bool:  # noqa: ANN401
        return all([t.resync(target) for t in self.transports.values()])

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
