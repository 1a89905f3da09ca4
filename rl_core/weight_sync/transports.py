"""The plane side of the weight transports: how staged weights reach the paused engines.

HTTP plane (``rollout.weight_sync``): :class:`DiskSync` (``disk``: HF safetensors, then
``/update_weights_from_disk``), :class:`ShmSync` (``shm``: shared memory on one host, served
without a copy), :class:`ObjectStoreSync` (``object_store``: Ray's object store to each engine's
actor) and :class:`~rl_core.weight_sync.broadcast.BroadcastSync` (``distributed``).
In-process plane: :class:`TensorSync` (tensors copied) and :class:`SharedSync` (``shared``: the
engine reads the trainer's parameters). With LoRA, disk and tensors move the adapter only. Each
keeps what it last delivered, so :meth:`resync` brings a restarted engine back; waits are bounded.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.weight_sync.checksum import WeightSyncError, weights_checksum
from rl_core.weight_sync.delta import DeltaEncoder, is_delta

log = logging.getLogger(__name__)

__all__ = ["DiskSync", "ObjectStoreSync", "SharedSync", "ShmSync", "Staged", "TensorSync"]


@dataclass
class Staged:
    """Weights made available to the engines: what :meth:`load` needs and their checksum."""

    payload: Any
    checksum: str | None
    nbytes: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # the transport's own


class DiskSync:
    """``disk``: a safetensors directory per version; only the newest is kept. With a
    ``delta`` encoder (``rollout.weight_sync_delta``) a version is written as the changes
    since the one the engines hold (:mod:`rl_core.weight_sync.delta`)."""

    def __init__(self, plane: Any, staging_dir: str | Path, timeout_s: float,
                 lora_name: str | None = None, delta: DeltaEncoder | None = None) -> None:
        self.plane, self.staging_dir, self.timeout_s = plane, Path(staging_dir), timeout_s
        self.lora_name, self.delta = lora_name, delta
        self.current: tuple[Path, int] | None = None

    def stage(self, trainer: Any, version: int) -> Staged:
        target = self.staging_dir / f"v{version:06d}"
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        metrics: dict[str, float] = {}
        if self.delta is None:
            checksum = trainer.write_weights(tmp)
        else:
            self.delta.confirm(self.plane.weight_version)
            checksum, metrics = self.delta.write(trainer.export_weights(), version, tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        nbytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
        if metrics:
            metrics["sync_delta_fraction"] = nbytes / max(metrics["sync_full_bytes"], 1.0)
        return Staged(target, checksum, nbytes, metrics)

    def _whole(self, path: Path, version: int) -> Path:
        """``path`` if it holds a whole model, else the whole of ``version`` written beside it
        (a delta cannot load onto an engine that does not hold its base)."""
        if self.delta is None or not is_delta(path):
            return path
        weights = self.delta.weights_of(version)
        if weights is None:
            raise WeightSyncError(f"weight_version {version} was sent as a delta and its whole "
                                  "weights are no longer held; the next sync is a full one")
        from safetensors.torch import save_file

        whole = self.staging_dir / f"v{version:06d}-whole"
        if not (whole / "model.safetensors").is_file():
            whole.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(whole / "model.safetensors"))
        return whole

    def load(self, staged: Staged, urls: list[str], version: int) -> None:
        if self.lora_name is None:
            def each(path: Path) -> None:
                self.plane.pool.each(urls, "update_weights_from_disk", lambda aio, u: (
                    aio.update_weights_from_disk(str(path), version, url=u,
                                                 timeout_s=self.timeout_s)), self.timeout_s + 10.0)

            try:
                each(staged.payload)
            except WeightSyncError as e:
                if self.delta is None or not is_delta(staged.payload):
                    raise
                # an engine that no longer holds the base (a reload after a failed probe)
                log.warning("delta weight update refused (%s); loading version %d whole", e,
                            version)
                each(self._whole(staged.payload, version))
        else:
            self.plane.pool.each(urls, "load_lora_adapter", lambda aio, u: self._swap(
                aio, u, staged.payload, version), self.timeout_s + 10.0)
            self.plane.lora_name = self.lora_name
        self.current = (staged.payload, version)
        for old in self.staging_dir.glob("v*"):
            if old != staged.payload:
                shutil.rmtree(old, ignore_errors=True)

    async def _swap(self, aio: Any, url: str, path: Path, version: int) -> None:
        """SGLang's adapter update: unload the old one (if any), load, relabel the version."""
        assert self.lora_name is not None
        await aio.unload_lora_adapter(self.lora_name, url=url, missing_ok=True)
        await aio.load_lora_adapter(self.lora_name, str(path), url=url, timeout_s=self.timeout_s)
        await aio.update_weight_version(version, url=url)

    def resync(self, url: str) -> bool:
        if self.current is not None:
            path, version = self.current
            client = self.plane.pool.client
            if self.lora_name is None:  # a restarted engine holds the base model: whole
                client.update_weights_from_disk(str(self._whole(path, version)), version, url=url)
            else:
                client.run(self._swap(client.aio, url, path, version), timeout_s=self.timeout_s)
        return True

    def close(self) -> None:
        pass


class ObjectStoreSync:
    """``object_store``: through Ray's object store to each engine's actor."""

    def __init__(self, plane: Any, staging_dir: str | Path, timeout_s: float) -> None:
        self.plane, self.staging_dir, self.timeout_s = plane, Path(staging_dir), timeout_s
        self.current: tuple[Any, int] | None = None

    def stage(self, trainer: Any, version: int) -> Staged:
        ref, checksum, nbytes = trainer.put_weights()
        return Staged(ref, checksum, float(nbytes))

    def load(self, staged: Staged, urls: list[str], version: int) -> None:
        self._load_on(urls, staged.payload, version)
        self.current = (staged.payload, version)

    def resync(self, url: str) -> bool:
        if self.current is not None:
            self._load_on([url], *self.current)
        return True

    def _load_on(self, urls: list[str], ref: Any, version: int) -> None:
        import ray

        actors = {e.url: getattr(e.proc, "actor", None) for e in self.plane.pool.engines}
        missing = [u for u in urls if actors.get(u) is None]
        if missing:
            raise WeightSyncError(f"rollout.weight_sync=object_store needs engines that are Ray "
                                  f"actors (cluster.mode=ray); {missing} are not")
        t = self.timeout_s
        flush = getattr(self.plane, "pause_mode", "abort") == "abort"  # none while requests are held
        calls = [actors[u].load_weights.remote(ref, str(version), str(self.staging_dir), t, flush)
                 for u in urls]
        try:
            ray.get(calls, timeout=t)
        except Exception as e:  # an actor died or refused: name it, the pool takes it out
            raise WeightSyncError(f"object_store weight load on {urls} failed: {e}") from e

    def close(self) -> None:
        self.current = None


class ShmSync:
    """``shm``: engine processes on this host serve the weights from shared memory
    (:mod:`rl_core.weight_sync.shm`): staging writes the segment no engine serves, the load
    points every engine at it."""

    def __init__(self, plane: Any, timeout_s: float, directory: str | Path | None = None) -> None:
        from rl_core.weight_sync.shm import SegmentWriter

        self.plane, self.timeout_s = plane, timeout_s
        self.writer = SegmentWriter(directory)
        self.current: tuple[str, int] | None = None

    def stage(self, trainer: Any, version: int) -> Staged:
        path, checksum = self.writer.write(trainer.export_weights(), version)
        return Staged(str(path), checksum, float(self.writer.size))

    def _call(self, path: str, version: int) -> Any:
        layout, size = self.writer.layout, self.writer.size
        return lambda aio, u: aio.update_weights_from_shared_memory(
            path, layout, size, version, url=u, timeout_s=self.timeout_s)

    def load(self, staged: Staged, urls: list[str], version: int) -> None:
        self.plane.pool.each(urls, "update_weights_from_shared_memory",
                             self._call(staged.payload, version), self.timeout_s + 10.0)
        self.current = (staged.payload, version)

    def resync(self, url: str) -> bool:
        if self.current is not None:
            pool = self.plane.pool
            pool.client.run(self._call(*self.current)(pool.client.aio, url),
                            timeout_s=self.timeout_s + 10.0)
        return True

    def close(self) -> None:
        self.writer.close()


class TensorSync:
    """The in-process plane: the engine core copies the trainer's tensors at a safe point
    (``lora_name``: holds them as that LoRA adapter)."""

    def __init__(self, plane: Any = None, lora_name: str | None = None) -> None:
        self.plane, self.lora_name = plane, lora_name
        self._config: dict[str, Any] | None = None  # the staged adapter's config (LoRA)

    def stage(self, trainer: Any, version: int) -> Staged:
        weights = trainer.export_weights()
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        self._config = trainer.adapter_config() if self.lora_name else None
        return Staged(weights, weights_checksum(weights), float(nbytes))

    def load(self, staged: Staged, engines: list[Any], version: int) -> None:
        weights, config = staged.payload, self._config
        for engine in engines:
            if self.lora_name is None:
                engine.update_weights_from_tensors(weights, version)
                continue
            with contextlib.suppress(ValueError):  # AdapterError: not loaded yet
                engine.unload_lora_adapter(self.lora_name)
            engine.load_lora_adapter(self.lora_name, tensors=weights, config=config)
            engine.update_weight_version(version, abort_all_requests=False)
        if self.lora_name is not None:
            self.plane.lora_name = self.lora_name

    def resync(self, engine: Any) -> bool:
        return True

    def close(self) -> None:
        pass


class SharedSync:
    """``shared``: the in-process engine serves the trainer's own parameter storage. The
    load checks that every served weight still aliases the trainer's (else it fails loudly),
    then the engine drops what it derived from the old values and serves ``version``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def stage(self, trainer: Any, version: int) -> Staged:
        return Staged(trainer.model, None, 0.0)

    def load(self, staged: Staged, engines: list[Any], version: int) -> None:
        owned = {n: p.data_ptr() for n, p in staged.payload.named_parameters()}
        for engine in engines:
            served = dict(engine.model.named_parameters())
            stale = sorted(n for n, ptr in owned.items()
                           if n not in served or served[n].data_ptr() != ptr)
            if stale:
                raise WeightSyncError(
                    f"rollout.weight_sync=shared: the engine no longer serves the trainer's "
                    f"parameters {stale[:5]} (the trainer replaced them); use "
                    "rollout.weight_sync=disk, or restart the planes")
            engine.weights_changed_in_place(version)

    def resync(self, engine: Any) -> bool:
        return True

    def close(self) -> None:
        self.trainer = None
