"""A content checksum of a model's named weights, computed the same way on both planes.

SHA-256 over (name, dtype, shape, raw bytes) in sorted-name order. Tied weights that share
storage (``lm_head.weight`` tied to the embeddings) are hashed under each name, so both
sides must export the same names; :func:`weights_checksum` skips names in ``ignore``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

__all__ = ["WeightSyncError", "weights_checksum"]


class WeightSyncError(RuntimeError):
    """A weight sync that did not deliver the trainer's weights (or did not finish in time)."""


def weights_checksum(weights: Mapping[str, torch.Tensor], ignore: Iterable[str] = ()) -> str:
    """SHA-256 hex digest of ``weights`` (independent of dict order)."""
    skip = set(ignore)
    h = hashlib.sha256()
    for name in sorted(weights):
        if name in skip:
            continue
        t = weights[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        # View as bytes: works for bf16, which numpy cannot represent.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
