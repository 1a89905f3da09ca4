"""A weight-update process group beside (never instead of) the default one, SGLang's way.

As SGLang, slime, verl and OpenRLHF build it: a TCP rendezvous hosted by the trainer's rank 0,
a ``PrefixStore`` named after the group, and torch's private ``_new_process_group_helper``
(signature checked at call time). Both sides must build it alike, so the trainer's
(:func:`broadcast_named_tensors`) and the engine's (:func:`receive_named_tensors`) live here.
Wire order: one broadcast per tensor, in the posted names' order; every collective is bounded
by the group's timeout. Rank 0's store binds only the address peers are told. Never pickles.
"""

from __future__ import annotations

import inspect
import ipaddress
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["broadcast_named_tensors", "destroy_process_group", "host_tcp_store",
           "init_custom_process_group", "parse_dtype", "receive_named_tensors"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
           "bool": torch.bool}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` (the spellings trainers send) as a torch dtype."""
    key = name.removeprefix("torch.")
    try:
        return _DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def _is_unspecified(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_unspecified
    except ValueError:
        return False  # a host name


def _bound_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address:port`` (``port`` 0: the OS picks), not yet listening;
    a host name binds the first address it resolves to, the one its peers connect to."""
    if _is_unspecified(address):
        raise ValueError(
            f"a torch.distributed store must not bind {address!r} (every interface): pass the "
            "address its peers connect to (127.0.0.1 on one machine, the node's IP on a cluster)"
        )
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve store address {address!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore itself does
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind a torch.distributed store to {address}:{port}: "
                      f"{exc.strerror}") from None
    return sock


def host_tcp_store(address: str, port: int, world_size: int, *, timeout: timedelta,
                   wait_for_workers: bool) -> dist.TCPStore:
    """The master ``TCPStore`` of a group, listening on ``address:port`` only (a host name
    would listen on every interface; docs/reliability.md, "Security"). ``port`` 0: the OS
    picks (``store.port``); ``wait_for_workers`` blocks, bounded by ``timeout``. The store
    owns the bound socket from here (closed on destruction or a failed construction)."""
    fd = _bound_socket(address, port).detach()
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=fd, use_libuv=True)


def init_custom_process_group(*, master_address: str, master_port: int, rank: int,
                              world_size: int, group_name: str, backend: str = "gloo",
                              timeout_s: float = 60.0) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a named process group; blocks until all ranks join.
    Works whether or not the process has a default group; use the returned group with
    ``group=`` / ``group_src=`` arguments only."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:  # blocks until every rank has connected, bounded by the timeout
        store = host_tcp_store(master_address, int(master_port), world_size, timeout=timeout,
                               wait_for_workers=True)
    else:
        url = f"tcp://{master_address}:{int(master_port)}"
        store, rank, world_size = next(c10d.rendezvous(url, rank=rank, world_size=world_size,
                                                       timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout,
                                           **{options: None})
    # Group ranks are global ranks in this group's own world (SGLang's convention).
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(group: dist.ProcessGroup) -> None:
    """Tear down a group made by :func:`init_custom_process_group`."""
    dist.destroy_process_group(group)


def _broadcast(tensor: torch.Tensor, group: dist.ProcessGroup, timeout_s: float) -> None:
    work = dist.broadcast(tensor, group=group, group_src=0, async_op=True)
    if work is not None and not work.wait(timeout=timedelta(seconds=timeout_s)):
        raise TimeoutError(f"broadcast did not complete within {timeout_s:.0f} s")


def broadcast_named_tensors(named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
                            group: dist.ProcessGroup, *, timeout_s: float = 60.0) -> None:
    """Trainer side (group rank 0): one broadcast per tensor, in the given order."""
    for _, tensor in named.items() if isinstance(named, Mapping) else named:
        _broadcast(tensor.detach().contiguous(), group, timeout_s)


def receive_named_tensors(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
    group: dist.ProcessGroup, *, device: str | torch.device = "cpu", timeout_s: float = 60.0,
) -> dict[str, torch.Tensor]:
    """Engine side: receive the tensors rank 0 broadcasts for ``names``, in order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}")
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        buf = torch.empty(tuple(int(s) for s in shape), dtype=parse_dtype(dtype), device=device)
        _broadcast(buf, group, timeout_s)
        out[name] = buf
    return out
