"""The trainer side of a distributed weight update: rank 0 of a trainer → engines group.

SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed`` protocol, the
one slime, verl and OpenRLHF drive: the trainer hosts a TCP rendezvous, every engine joins
as ``rank_offset`` (1, 2, ...), and each update is one broadcast per tensor from rank 0 in
the order of the names the engines were told. :class:`WeightSender` holds those groups for
whatever process owns the trainer's weights (the flow process for an in-process trainer,
rank 0's Ray actor for a :class:`~rl_core.training.distributed.TrainerGroup`).

The sender returns the checksum of exactly the tensors it broadcast, so the rollout plane can
verify every engine against what went over the wire. Every wait is bounded by the group's
timeout. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping

import torch

from rl_core.weight_sync import process_group as pgroup
from rl_core.weight_sync.checksum import weights_checksum

__all__ = ["BroadcastsWeights", "WeightSender", "free_endpoint", "weight_meta"]

log = logging.getLogger(__name__)


def free_endpoint(host: str) -> tuple[str, int]:
    """``(host, port)`` with a TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])


def weight_meta(
    weights: Mapping[str, torch.Tensor],
) -> tuple[list[str], list[str], list[list[int]]]:
    """``names, dtypes, shapes`` as ``/update_weights_from_distributed`` takes them."""
    names = list(weights)
    dtypes = [str(weights[n].dtype).removeprefix("torch.") for n in names]
    shapes = [list(weights[n].shape) for n in names]
    return names, dtypes, shapes


class WeightSender:
    """Rank 0 of named weight-update groups, hosted in this process."""

    def __init__(self) -> None:
        self._groups: dict[str, tuple[object, str, float]] = {}

    @property
    def groups(self) -> list[str]:
        return list(self._groups)

    def open(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        """Host group ``group_name``; returns once all ``world_size`` ranks have joined."""
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} is already open")
        t0 = time.monotonic()
        pg = pgroup.init_custom_process_group(
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )
        self._groups[group_name] = (pg, backend, timeout_s)
        log.info(
            "weight update group %s: %d rank(s) joined at %s:%d (%s) in %.2fs",
            group_name, world_size, master_address, master_port, backend,
            time.monotonic() - t0,
        )  # fmt: skip

    def send(self, group_name: str, weights: Mapping[str, torch.Tensor]) -> str:
        """Broadcast ``weights`` (in their order) to the group; their checksum."""
        try:
            pg, backend, timeout_s = self._groups[group_name]
        except KeyError:
            raise ValueError(f"no weight update group {group_name!r} is open") from None
        if backend == "gloo":
            weights = {n: t.detach().cpu() for n, t in weights.items()}
        pgroup.broadcast_named_tensors(weights, pg, timeout_s=timeout_s)  # type: ignore[arg-type]
        return weights_checksum(weights)

    def close(self, group_name: str | None = None) -> None:
        """Leave ``group_name`` (every group when None); unknown names are ignored."""
        for name in [group_name] if group_name else list(self._groups):
            entry = self._groups.pop(name, None) if name else None
            if entry is not None:
                try:
                    pgroup.destroy_process_group(entry[0])  # type: ignore[arg-type]
                except Exception as e:  # a peer died: the group is gone either way
                    log.debug("weight update group %s: destroy failed: %s", name, e)


class BroadcastsWeights:
    """The trainer side of distributed weight sync, for any trainer with ``export_weights``.

    Every rank of a multi-rank trainer calls these methods (the export may be a collective:
    FSDP2's gathers, megatron's TP/PP gathers); only the rank whose ``_sends_weights`` is
    true (rank 0) hosts the group and broadcasts.
    """

    _sends_weights = True
    _sender: WeightSender | None = None

    def export_weights(self) -> dict[str, torch.Tensor]:  # pragma: no cover - the trainer's
        raise NotImplementedError

    def weight_broadcast_endpoint(self, host: str = "127.0.0.1") -> tuple[str, int]:
        """Where engines rendezvous with this trainer: ``host`` and a port free on it."""
        return free_endpoint(host)

    def open_weight_broadcast(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        """Host weight-update group ``group_name`` as rank 0 (blocks until engines join)."""
        if self._sends_weights:
            self._weight_sender().open(
                master_address=master_address,
                master_port=master_port,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )

    def broadcast_weights(self, group_name: str) -> str | None:
        """Broadcast the policy to ``group_name``; the checksum of what was sent (rank 0)."""
        weights = self.export_weights()  # every rank takes part
        return self._weight_sender().send(group_name, weights) if self._sends_weights else None

    def close_weight_broadcast(self, group_name: str | None = None) -> None:
        """Leave ``group_name`` (every weight-update group when None)."""
        self._weight_sender().close(group_name)

    def _weight_sender(self) -> WeightSender:
        if self._sender is None:
            self._sender = WeightSender()
        return self._sender
