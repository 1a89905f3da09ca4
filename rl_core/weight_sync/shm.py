"""``rollout.weight_sync: shm``: weights through shared memory to engine processes on this host.

The trainer side keeps two segments (files in ``/dev/shm``, each the size of the weights) and
writes version ``v`` into segment ``v % 2`` with one ``memcpy`` per tensor, hashing each
tensor while the next is copied. The engine maps the segment and *serves its parameters from
it* (``/update_weights_from_shared_memory``: each parameter becomes a view of the mapping at
its offset, no copy), so a sync moves every byte once. Staging writes the segment the engines
do not serve (they serve the other one), so it can overlap generation; the load inside the
pause only re-points the engines' parameters. Measured: docs/benchmarks.md, "Weight sync".
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from rl_core.weight_sync.checksum import CHECKSUM_ALGORITHM

__all__ = ["SegmentWriter", "layout_of", "map_segment", "views"]

log = logging.getLogger(__name__)

ALIGN = 64  # every tensor starts on a cache line

Layout = list[dict[str, Any]]  # [{"name", "dtype", "shape", "offset", "alias"?}]


def layout_of(weights: Mapping[str, torch.Tensor]) -> tuple[Layout, int]:
    """Where each tensor of ``weights`` lives in a segment, and the segment's size. A tensor
    that shares storage with an earlier one (a tied LM head) is an alias of it, stored once."""
    out: Layout = []
    seen: dict[tuple[int, int], str] = {}
    size = 0
    for name in sorted(weights):
        t = weights[name]
        key = (t.data_ptr(), t.numel())
        if key in seen:
            out.append({"name": name, "alias": seen[key]})
            continue
        seen[key] = name
        out.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape), "offset": size})
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return out, max(size, ALIGN)


def map_segment(path: str | Path, size: int, *, private: bool = False) -> torch.Tensor:
    """The segment at ``path`` as a uint8 tensor of ``size`` bytes mapped from the file:
    shared (the writer's; created if new) or ``private`` (a reader's copy-on-write mapping:
    its writes stay its own; the file must exist)."""
    path = Path(path)
    if not path.exists():
        if private:
            raise FileNotFoundError(f"no shared-memory segment {path}")
        with open(path, "wb") as f:
            f.truncate(size)
    elif path.stat().st_size < size:
        raise ValueError(f"shared-memory segment {path} holds {path.stat().st_size} bytes, "
                         f"the weights need {size}")
    return torch.from_file(str(path), shared=not private, size=size, dtype=torch.uint8)


def views(buffer: torch.Tensor, layout: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Every name of ``layout`` as a tensor viewing ``buffer`` (aliases: the same view)."""
    out: dict[str, torch.Tensor] = {}
    for e in layout:
        if "alias" in e:
            continue
        dtype = getattr(torch, e["dtype"])
        shape = [int(s) for s in e["shape"]]
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        start = int(e["offset"])
        if start < 0 or start + n > buffer.numel():
            raise ValueError(f"{e['name']}: bytes {start}..{start + n} lie outside the segment "
                             f"({buffer.numel()} bytes)")
        out[e["name"]] = buffer[start : start + n].view(dtype).view(shape)
    for e in layout:
        if "alias" in e:
            out[e["name"]] = out[e["alias"]]
    return out


def _segment_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SegmentWriter:
    """The trainer side: two segments, written in turn (see the module docstring)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else _segment_dir()
        self.prefix = f"grpoflow-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.layout: Layout | None = None
        self.size = 0
        self._buffers: dict[int, torch.Tensor] = {}

    def path(self, version: int) -> Path:
        return self.directory / f"{self.prefix}-{version % 2}"

    def write(self, weights: Mapping[str, torch.Tensor], version: int) -> tuple[Path, str]:
        """Write ``weights`` into version ``version``'s segment; its path and the weights'
        :func:`~rl_core.weight_sync.weights_checksum` (computed from the segment)."""
        layout, size = layout_of(weights)
        if layout != self.layout:  # a new shape of weights (the first write): new segments
            self.close()
            self.layout, self.size = layout, size
        slot = version % 2
        if slot not in self._buffers:
            self._buffers[slot] = map_segment(self.path(version), size)
        target = views(self._buffers[slot], layout)
        return self.path(version), _copy_and_hash(weights, target)

    def close(self) -> None:
        """Unlink the segments (engines that mapped one keep their mapping until they drop it)."""
        for slot in list(self._buffers):
            with_path = self.directory / f"{self.prefix}-{slot}"
            with_path.unlink(missing_ok=True)
        self._buffers.clear()
        self.layout = None


def _copy_and_hash(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> str:
    """Copy each tensor into ``target`` (one ``memcpy``; both release the GIL) while a thread
    hashes the ones already copied, in :func:`weights_checksum`'s order and format."""
    names = sorted(source)
    done: list[threading.Event] = [threading.Event() for _ in names]
    h = xxhash.xxh3_128()
    failed: list[BaseException] = []

    def hash_all() -> None:
        try:
            for i, name in enumerate(names):
                done[i].wait()
                if failed:
                    return
                t = target[name]
                h.update(name.encode())
                h.update(str(t.dtype).encode())
                h.update(str(tuple(t.shape)).encode())
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            failed.append(e)

    hasher = threading.Thread(target=hash_all, name="weights-hash", daemon=True)
    hasher.start()
    try:
        copied: set[int] = set()
        for i, name in enumerate(names):
            src, dst = source[name].detach(), target[name]
            if dst.data_ptr() not in copied:  # an alias was written with its owner
                copied.add(dst.data_ptr())
                if src.device.type == "cpu" and src.is_contiguous() and src.dtype == dst.dtype:
                    ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
                else:
                    dst.copy_(src)
            done[i].set()
    except BaseException as e:
        failed.append(e)
        for ev in done:
            ev.set()
        raise
    finally:
        hasher.join()
    if failed:
        raise failed[0]
    return f"{CHECKSUM_ALGORITHM}:{h.hexdigest()}"
