"""``rollout.weight_sync: distributed``: trainer rank 0 broadcasts to every engine.

SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed`` protocol (as
slime, verl and OpenRLHF drive it): engines join as ranks 1, 2, ...; each update is one
broadcast per tensor in the posted order, one POST per bucket (``rollout.weight_sync_bucket_mb``)
and engine. The group is (re)opened whenever its member processes change; a restarted engine
waits out of service until then (docs/reliability.md, "Failure model: the weight sync"). Every
wait is bounded by ``rollout.weight_sync_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rl_core.weight_sync.checksum import WeightSyncError
from rl_core.weight_sync.transports import Staged

__all__ = ["BroadcastSync", "buckets"]

log = logging.getLogger(__name__)


Bucket = tuple[list[str], list[str], list[list[int]]]  # names, dtypes, shapes


def buckets(layout: dict[str, tuple[str, list[int]]], bucket_bytes: int) -> list[Bucket]:
    """The tensors of ``layout`` (name -> dtype, shape), in order, cut into buckets of at
    most ``bucket_bytes`` (a bigger tensor is a bucket of its own), each as ``names, dtypes,
    shapes`` (what ``/update_weights_from_distributed`` takes)."""
    out: list[Bucket] = []
    size = 0
    for name, (dtype, shape) in layout.items():
        nbytes = _nbytes(dtype, shape)
        if not out or (size + nbytes > bucket_bytes and out[-1][0]):
            out.append(([], [], []))
            size = 0
        for part, value in zip(out[-1], (name, dtype, list(shape)), strict=True):
            part.append(value)
        size += nbytes
    return out


def _failures(urls: list[str], results: list[Any]) -> list[str]:
    return [f"{u}: {r}" for u, r in zip(urls, results, strict=True) if isinstance(r, Exception)]


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


class BroadcastSync:
    """The engines' side of a trainer → engines broadcast group (see the module docstring)."""

    def __init__(self, plane: Any, backend: str, timeout_s: float, bucket_bytes: int) -> None:
        self.plane, self.backend, self.timeout_s = plane, backend, timeout_s
        self.bucket_bytes = bucket_bytes
        self._group: tuple[str, tuple[str, ...]] | None = None  # name, members
        self._seq = 0
        self._buckets: list[Bucket] = []
        self._layout_bytes = 0
        self._trainer: Any = None
        self._synced_step: int | None = None

    @property
    def num_buckets(self) -> int:
        """How many ``/update_weights_from_distributed`` calls one sync makes per engine."""
        return len(self._buckets)

    def stage(self, trainer: Any, version: int) -> Staged:
        targets = tuple(self.plane.pool.update_targets())
        if self._group is None or self._group[1] != self._members(targets) or (
                self._trainer is not trainer):
            self._open(trainer, list(targets))
        return Staged((trainer, targets), None, float(self._layout_bytes * len(targets)))

    def load(self, staged: Staged, urls: list[str], version: int) -> None:
        trainer, targets = staged.payload
        if tuple(urls) != targets or self._group is None:
            self._close()
            raise WeightSyncError(f"the engines changed during the weight update "
                                  f"({list(targets)} -> {urls})")
        try:
            staged.checksum = self._broadcast(trainer, self._group[0], urls, version)
        except BaseException:
            self._close()  # a broken broadcast leaves the group unusable: reopen next time
            raise
        self._synced_step = getattr(trainer, "global_step", None)

    def resync(self, url: str) -> bool:
        """A restarted engine serves the base model: fine before the first update; after it,
        the engine waits out of service for the next broadcast."""
        return self.plane.pool.weight_version is None

    def rejoin(self) -> None:
        """Before sampling: bring restarted engines to the current weights when the trainer
        still holds them (it has not trained since the last broadcast)."""
        from rl_core.weight_sync import sync_weights

        trainer = self._trainer
        if trainer is None or getattr(trainer, "global_step", None) != self._synced_step:
            return  # they rejoin at the next update
        log.warning("re-broadcasting weight_version %s for restarted engine(s) %s",
                    self.plane.weight_version, self.plane.pool.awaiting_urls())
        sync_weights(trainer, self.plane, self, self.plane.weight_version)

    def close(self) -> None:
        self._close()

    # ------------------------------------------------------------------ the group

    def _members(self, urls: Any) -> tuple[str, ...]:
        """``url#restarts`` of each engine: who is in a group, process by process."""
        restarts = {e.url: e.restarts for e in self.plane.pool.engines}
        return tuple(f"{u}#{restarts.get(u, 0)}" for u in urls)

    def _open(self, trainer: Any, urls: list[str]) -> None:
        """Close any previous group; open a new one: rank 0 the trainer, then ``urls``."""
        self._close()
        if not urls:
            raise WeightSyncError("rollout.weight_sync=distributed: no engine to update")
        t0 = time.perf_counter()
        layout = trainer.weight_layout()  # names, dtypes, shapes: never the weights
        self._buckets = buckets(layout, self.bucket_bytes)
        self._layout_bytes = sum(_nbytes(d, s) for d, s in layout.values())
        self._seq += 1
        name = f"grpoflow-weights-{os.getpid()}-{self._seq}"
        address, port = trainer.weight_broadcast_endpoint()
        world, t = 1 + len(urls), self.timeout_s
        client = self.plane.pool.client

        async def join_all() -> list[Any]:
            return await asyncio.gather(*(
                client.aio.init_weights_update_group(address, port, i + 1, world, group_name=name,
                                                     backend=self.backend, url=u, timeout_s=t + 10)
                for i, u in enumerate(urls)), return_exceptions=True)

        with ThreadPoolExecutor(1, thread_name_prefix="weight-group") as ex:
            host = ex.submit(trainer.open_weight_broadcast, address, port, world, name,
                             self.backend, t)
            joined = client.run(join_all(), timeout_s=t + 20.0)
            host_error: BaseException | None = None
            try:
                host.result(timeout=t + 30.0)
            except BaseException as e:  # noqa: BLE001 - reported below with the engines'
                host_error = e
        errors = _failures(urls, joined)
        if host_error is not None or errors:
            with contextlib.suppress(Exception):
                trainer.close_weight_broadcast(name)
            for u, r in zip(urls, joined, strict=True):
                if not isinstance(r, Exception):
                    with contextlib.suppress(Exception):
                        client.destroy_weights_update_group(name, url=u)
            raise WeightSyncError(
                f"rollout.weight_sync=distributed: opening weight update group {name} at "
                f"{address}:{port} ({self.backend}, {world} ranks) failed: "
                + "; ".join(errors + ([f"trainer: {host_error}"] if host_error else []))
                + ". Engines must reach the trainer's rank 0 at that address (firewall, "
                "cluster network) and the backend must match the devices (gloo on CPU)."
            ) from host_error
        self._group, self._trainer = (name, self._members(urls)), trainer
        log.info("weight update group %s: trainer + %d engine(s) over %s in %.2fs", name,
                 len(urls), self.backend, time.perf_counter() - t0)

    def _broadcast(self, trainer: Any, name: str, urls: list[str], version: int) -> str | None:
        """Engines receive bucket by bucket (one POST each, in order) while the trainer
        broadcasts every tensor in the same order; the checksum of what it sent."""
        client, t = self.plane.pool.client, self.timeout_s

        async def receive(url: str) -> None:
            for names, dtypes, shapes in self._buckets:
                await client.aio.update_weights_from_distributed(
                    names, dtypes, shapes, group_name=name, weight_version=version, url=url,
                    timeout_s=t + 10.0)

        async def receive_all() -> list[Any]:
            return await asyncio.gather(*(receive(u) for u in urls), return_exceptions=True)

        with ThreadPoolExecutor(1, thread_name_prefix="weight-broadcast") as ex:
            sending = ex.submit(trainer.broadcast_weights, name)
            received = client.run(receive_all(), timeout_s=t + 20.0)
            sender_error: BaseException | None = None
            try:
                checksum = sending.result(timeout=t + 30.0)
            except BaseException as e:  # noqa: BLE001 - reported below with the engines'
                sender_error = e
        errors = _failures(urls, received)
        if sender_error is not None:
            errors.append(f"trainer (rank 0): {sender_error}")
        if errors:
            raise WeightSyncError(f"weight broadcast over group {name} failed: "
                                  + "; ".join(errors)) from sender_error
        return checksum

    def _close(self) -> None:
        """Leave the group on the trainer and the engines (best effort)."""
        if self._group is None:
            return
        (name, members), self._group = self._group, None
        if self._trainer is not None:
            with contextlib.suppress(Exception):
                self._trainer.close_weight_broadcast(name)
        pool = self.plane.pool
        if pool.client is None:
            return
        live = set(pool.in_service_urls()) | set(pool.awaiting_urls())
        for u in (m.rsplit("#", 1)[0] for m in members):
            if u in live:
                with contextlib.suppress(Exception):
                    pool.client.destroy_weights_update_group(name, url=u)
