"""A content checksum of a model's named weights, computed the same way on both planes.

XXH3-128 over (name, dtype, shape, raw bytes) in sorted-name order, hashed straight from
each tensor's memory (no copy). XXH3 is not a cryptographic hash: it guards against wrong
bytes (a corrupted bucket, a stale or half-applied update, a mismatched layout), not against
an adversary who controls both planes. It replaced SHA-256 because the weight sync hashes
every byte twice (trainer and engine): at 0.65 GB/s SHA-256 took most of a product sync
(docs/benchmarks.md, "Weight sync"); XXH3 runs at memory speed.

Tied weights that share storage (``lm_head.weight`` tied to the embeddings) are hashed
under each name, so both sides must export the same names; :func:`weights_checksum` skips
names in ``ignore``. Digests read ``xxh3-128:<32 hex digits>``.
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
