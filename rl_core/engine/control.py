"""The embedded engine's control surface: weights (disk, tensors, a broadcast group, in
place), memory release, LoRA adapters and the cache. Each change runs at the scheduler's safe
point (``self._call``) of :class:`~rl_core.engine.core.EmbeddedEngine`, which mixes this in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_core.engine import faults
from rl_core.engine.lora import parse_adapter, read_adapter
from rl_core.engine.requests import EngineRequestError
from rl_core.models import read_weights
from rl_core.weight_sync import process_group as pgroup
from rl_core.weight_sync import shm
from rl_core.weight_sync.delta import apply_delta, is_delta

__all__ = ["MEMORY_TAGS", "EngineControl", "EngineRequestError", "EngineStateError"]

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineStateError(RuntimeError):
    """An operation the engine cannot perform in its current state (closed, no such group)."""


class EngineControl:
    """Weights, memory and LoRA of an :class:`~rl_core.engine.core.EmbeddedEngine` (a mixin:
    the engine provides the model state and ``_call``, its safe-point executor)."""

    def flush_cache(self) -> bool:
        """Drop cached KV state; False (nothing done) while requests run or wait."""
        def do() -> bool:
            with self._cond:
                if self._running or self._waiting:
                    return False
            self._reset_batch(free=True)
            self._empty_device_cache()
            self._stale_version = None  # a test's stale_cache fault ends with its load
            return True

        return self._call(do, "flush_cache")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the KV cache (``kv_cache``: running requests are retracted, recomputed on
        resume) and move the weights to a host buffer (``weights``: the parameters become
        empty, the model cannot run until :meth:`resume_memory`; weights and checksum do not
        change). ``cuda_graph`` is accepted (no-op)."""
        wanted = self._tags(tags)

        def do() -> None:
            if "kv_cache" in wanted:
                self._retract_all()
                self._kv.free()
                self._kv_released = True
            if "weights" in wanted and self._weights.offloaded is None:
                self._weights.offload()
                self._kv.weights_changed()
            self._empty_device_cache()

        self._call(do, "release_memory")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`release_memory` for ``tags`` (all when None)."""
        wanted = self._tags(tags)

        def do() -> None:
            if "weights" in wanted and self._weights.offloaded is not None:
                self._weights.restore(self.device)
                self._kv.weights_changed()
            if "kv_cache" in wanted:
                self._kv_released = False

        self._call(do, "resume_memory")

    def _empty_device_cache(self) -> None:
        # Dropped tensors are freed by reference counting; only a CUDA caching allocator
        # keeps the memory until asked (a full gc.collect() here costs ~0.5 s per call).
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def memory_released(self) -> dict[str, bool]:
        return {"weights": self._weights.offloaded is not None, "kv_cache": self._kv_released}

    @staticmethod
    def _tags(tags: Sequence[str] | None) -> set[str]:
        wanted = set(tags) if tags else set(MEMORY_TAGS)
        if unknown := wanted - set(MEMORY_TAGS):
            raise EngineRequestError(f"unknown memory tags {sorted(unknown)}; known {MEMORY_TAGS}")
        return wanted

    def update_weights_from_disk(
            self, model_path: str | Path, weight_version: str | int | None = None, *,
            abort_all_requests: bool = False) -> str:
        """Load every weight from a Hugging Face safetensors directory; returns the checksum.
        Names are the model's state_dict names (tied aliases may be absent); nothing changes
        if any name is unknown, missing or of the wrong shape. A grpoflow delta directory
        (``rollout.weight_sync_delta``) changes what changed since the served weights."""
        if is_delta(model_path):
            try:
                named = apply_delta(model_path, self._weights.named(), self._weights.checksum)
            except ValueError as e:
                raise EngineRequestError(str(e)) from None
            return self._update(named, weight_version, abort_all_requests, f"delta {model_path}")
        try:
            named = read_weights(model_path)
        except FileNotFoundError as e:
            raise EngineRequestError(str(e)) from None
        checksum = self._update(named, weight_version, abort_all_requests, str(model_path), True)
        self.model_path = str(model_path)
        return checksum

    def update_weights_from_shared_memory(
            self, path: str, layout: list[dict[str, Any]], size: int,
            weight_version: str | int | None = None) -> str:
        """Serve the weights in the shared-memory segment at ``path`` (``rollout.weight_sync:
        shm``): the parameters become views of a private (copy-on-write) mapping of it, no
        copy, and nothing the engine writes reaches the trainer's segment
        (rl_core/weight_sync/shm.py); returns the checksum. The trainer writes a segment only
        while no engine serves it."""
        try:
            named = shm.views(shm.map_segment(path, size, private=True), layout)
        except (FileNotFoundError, ValueError, AttributeError, KeyError, TypeError) as e:
            raise EngineRequestError(f"shared-memory weights {path}: {e}") from None
        if parts := self._weights.mismatches(named, complete=True):
            raise EngineRequestError(f"weights from {path} do not match the model "
                                     f"({'; '.join(parts)}); nothing was loaded")

        def apply() -> str:
            self._lora.activate(None)
            self._weights.attach(named)
            return self._loaded(weight_version, named)

        return self._call(apply, f"update weights from shared memory {path}")

    def update_weights_from_tensors(
            self, named: Mapping[str, torch.Tensor], weight_version: str | int | None = None, *,
            abort_all_requests: bool = False) -> str:
        """Load some or all weights from named tensors (a bucket); returns the checksum."""
        return self._update(dict(named), weight_version, abort_all_requests, "tensors")

    def update_weight_version(self, new_version: str | int, *,
                              abort_all_requests: bool = True) -> str:
        """Set ``weight_version`` without touching weights (SGLang aborts all by default)."""
        if abort_all_requests:
            self.abort(abort_all=True)
        version = str(new_version)

        def apply() -> None:
            if faults.claim(version, ("lora_off",)):  # a test's fault: adapters applied no more
                self._lora.activate(None)
                for adapter in self._lora.loaded.values():
                    adapter.deltas = {}
            self.weight_version = version

        self._call(apply, "update_weight_version")
        return version

    def weights_changed_in_place(self, new_version: str | int) -> None:
        """The served parameters were changed by their owner (a trainer sharing them, see
        :func:`~rl_core.rollout.inprocess.shared_view`): at a safe point, drop what was derived
        from them (packed weights, the checksum) and serve them as ``new_version``."""

        def apply() -> None:
            self._weights.invalidate()
            stale = faults.claim(new_version, ("stale_cache",)) is not None  # a test's fault
            self._weights_changed(new_version, keep_derived=stale)

        self._call(apply, "weights_changed_in_place")

    def _weights_changed(self, version: str | int | None, *, keep_derived: bool = False) -> None:
        """At a safe point, after the weights changed: drop the KV layout's packed copy of
        them (``keep_derived``: a test's ``stale_cache`` fault) and serve ``version``."""
        if not keep_derived:
            self._kv.weights_changed()
        if version is not None:
            self.weight_version = str(version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> None:
        """Join the trainer's broadcast group as rank ``rank_offset`` (one rank: TP = 1);
        blocks until every rank has joined (bounded by ``weight_sync_timeout_s``)."""
        if group_name in self._groups:
            raise EngineStateError(f"weight update group {group_name!r} already exists")
        if backend != "gloo" and self.device.type == "cpu":
            raise EngineRequestError(f"backend {backend!r} needs an accelerator; an engine on cpu "
                                     "joins weight update groups with backend 'gloo'")
        pg = pgroup.init_custom_process_group(
            master_address=master_address, master_port=master_port, rank=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
            timeout_s=self.weight_sync_timeout_s)
        self._groups[group_name] = (pg, backend)

    def update_weights_from_distributed(
            self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
            group_name: str = "weight_update_group", weight_version: str | int | None = None, *,
            load_format: str | None = None, abort_all_requests: bool = False) -> str:
        """Receive one broadcast per tensor from group rank 0, in ``names`` order, then load.
        All tensors are received before any check, so a trainer is never left blocked in a
        broadcast; a mismatch then fails the call with nothing loaded."""
        if group_name not in self._groups:
            raise EngineStateError(
                f"no weight update group {group_name!r}; call init_weights_update_group first")
        if load_format not in (None, "direct"):
            raise EngineRequestError(
                f"load_format {load_format!r} is not supported for distributed updates by the "
                "embedded engine; send one broadcast per tensor (load_format null)")
        pg, backend = self._groups[group_name]
        named = pgroup.receive_named_tensors(names, dtypes, shapes, pg,
                                             device=self.device if backend != "gloo" else "cpu",
                                             timeout_s=self.weight_sync_timeout_s)
        return self._update(named, weight_version, abort_all_requests, f"group {group_name!r}")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        if group_name not in self._groups:
            raise EngineStateError(f"no weight update group {group_name!r}")
        pgroup.destroy_process_group(self._groups.pop(group_name)[0])

    def checksum(self, lora_name: str | None = None) -> str:
        """The base weights' :func:`~rl_core.weight_sync.weights_checksum`, cached per change
        (an adapter merged for a batch does not change it), or adapter ``lora_name``'s."""
        return self._weights.checksum if lora_name is None else self._lora.get(lora_name).checksum

    # ------------------------------------------------------------------ LoRA (engine/lora.py)

    def load_lora_adapter(self, lora_name: str, lora_path: str | Path | None = None, *,
                          tensors: Mapping[str, torch.Tensor] | None = None,
                          config: Mapping[str, Any] | None = None) -> str:
        """Hold an adapter under ``lora_name``: a PEFT directory, or ``tensors`` + ``config``
        (in process); its checksum. A name already loaded is refused (unload it first)."""
        if tensors is None:
            config, tensors = read_adapter(lora_path or "")
        adapter = parse_adapter(lora_name, config or {}, tensors, self._weights.shapes,
                                None if lora_path is None else str(lora_path))
        self._call(lambda: self._lora.add(adapter), f"load LoRA adapter {lora_name!r}")
        return adapter.checksum

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Drop adapter ``lora_name``; refused while running requests use it."""
        self._call(lambda: self._lora.remove(lora_name, len(self._running)),
                   f"unload LoRA adapter {lora_name!r}")

    def _update(self, named: dict[str, torch.Tensor], version: str | int | None, abort_all: bool,
                source: str, complete: bool = False) -> str:
        """Check ``named`` against the model, then copy it in at a safe point; the checksum."""
        if parts := self._weights.mismatches(named, complete=complete):
            raise EngineRequestError(f"weights from {source} do not match the model "
                                     f"({'; '.join(parts)}); nothing was loaded")
        if abort_all:
            self.abort(abort_all=True)

        def apply() -> str:
            self._lora.activate(None)  # the base weights change; adapters re-merge on them
            self._weights.copy_in(named)
            return self._loaded(version, named)

        return self._call(apply, f"update weights from {source}")

    def _loaded(self, version: str | int | None, named: Mapping[str, torch.Tensor]) -> str:
        """After new weights are in: serve ``version`` (a test's fault taken here); checksum."""
        fault = faults.claim(version, (*faults.CORRUPTING, "stale_cache"), lambda k: (
            k == "stale_cache" or faults.touches(k, self.model, named)))
        if fault == "stale_cache":  # kept for every bucket of this version
            self._stale_version = str(version)
        stale = getattr(self, "_stale_version", None) == str(version)
        self._weights_changed(version, keep_derived=stale)
        if fault in faults.CORRUPTING:  # a test's fault: applied at resume, after the
            self._pending_fault = fault  # load and the checksum (core.resume)
        return self._weights.checksum
