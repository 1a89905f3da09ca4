"""A content checksum of a model's named weights, computed the same way on both planes.

XXH3-128 over (name, dtype, shape, raw bytes) in sorted-name order, straight from each
tensor's memory: ``xxh3-128:<32 hex digits>``. Tied weights are hashed under each name, so
both sides must export the same names. It catches wrong bytes, not an adversary controlling
both planes (why XXH3, not SHA-256: docs/reliability.md, "Failure model: the weight sync").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

__all__ = ["CHECKSUM_ALGORITHM", "WeightSyncError", "weights_checksum"]

CHECKSUM_ALGORITHM = "xxh3-128"


class WeightSyncError(RuntimeError):
    """A weight sync that did not deliver the trainer's weights (or did not finish in time)."""


def weights_checksum(weights: Mapping[str, torch.Tensor], ignore: Iterable[str] = ()) -> str:
    """``xxh3-128:<hex>`` digest of ``weights`` (independent of dict order)."""
    skip = set(ignore)
    h = xxhash.xxh3_128()
    for name in sorted(weights):
        if name in skip:
            continue
        t = weights[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        # The tensor's bytes as a buffer (works for bf16, which numpy cannot represent).
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return f"{CHECKSUM_ALGORITHM}:{h.hexdigest()}"
