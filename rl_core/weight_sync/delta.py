"""Delta weight sync: send only what changed since the version the engines hold.

Per tensor, against the last version every engine took: unchanged tensors are not sent; a
changed one goes as the smallest of its full bytes, sparse index/value pairs (the changed
elements), or the XOR of the bit patterns, byte-shuffled and zstd-compressed (most high bytes
of the XOR of two nearby floats are zero). Reconstruction is exact (bit patterns, not
arithmetic), and the sync's checksum of the full new weights verifies it. A full sync every
``full_every`` versions, and whenever the last update was not delivered (a failed sync, a
verification failure). The file: one ``delta.safetensors`` (entries ``<name>``, ``<name>.idx``
+ ``<name>.val``, ``<name>.xor``; the header names the base version and checksum and each
entry's encoding). docs/weight-sync.md, "Delta sync".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rl_core.weight_sync.checksum import weights_checksum

__all__ = ["DELTA_FILE", "DeltaEncoder", "apply_delta", "decode", "encode", "is_delta"]

DELTA_FILE = "delta.safetensors"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(_BITS[t.element_size()])


def _zstd() -> Any:  # noqa: ANN401
    import zstandard

    return zstandard


def encode(new: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
           ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """``new`` against ``base`` (same names, dtypes, shapes): the entries to send and, per
    changed tensor, its encoding (``full``, ``sparse`` or ``xor``), dtype and shape."""
    entries: dict[str, torch.Tensor] = {}
    how: dict[str, dict[str, Any]] = {}
    zc = _zstd().ZstdCompressor(level=1)
    for name, t in new.items():
        t = t.detach().contiguous().cpu()
        old = base[name]
        spec = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        xor = _bits(t) ^ _bits(old)
        count = int(torch.count_nonzero(xor))
        if count == 0:
            continue
        size = t.element_size()
        full = t.numel() * size
        wide = t.numel() >= 2**31
        sparse = count * ((8 if wide else 4) + size)
        packed = b""
        if sparse > full // 8:  # the XOR may be smaller: shuffle its bytes and compress it
            shuffled = xor.view(torch.uint8).reshape(-1, size).t().contiguous()
            packed = zc.compress(shuffled.numpy().tobytes())
        best = min(("full", full), ("sparse", sparse),
                   ("xor", len(packed) if packed else full + 1), key=lambda kv: kv[1])[0]
        if best == "full":
            entries[name] = t
        elif best == "sparse":
            changed = torch.nonzero(xor).reshape(-1)
            entries[f"{name}.idx"] = changed.to(torch.int64 if wide else torch.int32)
            entries[f"{name}.val"] = _bits(t)[changed].clone()
        else:
            entries[f"{name}.xor"] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
        how[name] = {**spec, "encoding": best}
    return entries, how


def decode(entries: Mapping[str, torch.Tensor], how: Mapping[str, Mapping[str, Any]],
           base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The changed tensors in full, from ``entries`` and the tensors ``base`` holds now."""
    zd = _zstd().ZstdDecompressor()
    out: dict[str, torch.Tensor] = {}
    for name, spec in how.items():
        old = base[name].detach().contiguous().cpu()
        dtype, shape = getattr(torch, spec["dtype"]), tuple(spec["shape"])
        if tuple(old.shape) != shape or old.dtype != dtype:
            raise ValueError(f"delta for {name}: {dtype} {shape}, the engine holds "
                             f"{old.dtype} {tuple(old.shape)}")
        if spec["encoding"] == "full":
            out[name] = entries[name]
            continue
        bits = _bits(old).clone()
        if spec["encoding"] == "sparse":
            bits[entries[f"{name}.idx"].long()] = entries[f"{name}.val"]
        else:
            size = old.element_size()
            raw = zd.decompress(entries[f"{name}.xor"].numpy().tobytes(),
                                max_output_size=old.numel() * size)
            planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(size, -1)
            bits ^= planes.t().contiguous().reshape(-1).view(bits.dtype)
        out[name] = bits.view(dtype).reshape(shape)
    return out


def is_delta(path: str | Path) -> bool:
    """Whether the weights directory ``path`` holds a delta (not a whole model)."""
    return (Path(path) / DELTA_FILE).is_file()


def apply_delta(path: str | Path, served: Mapping[str, torch.Tensor],
                served_checksum: str) -> dict[str, torch.Tensor]:
    """The changed tensors of the delta in ``path``, applied to ``served``; refuses a delta
    against weights other than the served ones (``ValueError``: a full sync is needed)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / DELTA_FILE), framework="pt") as f:
        meta = f.metadata() or {}
        entries = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    if meta.get("base_checksum") != served_checksum:
        raise ValueError(f"{path}: a delta against weight_version {meta.get('base_version')} "
                         f"({str(meta.get('base_checksum'))[:21]}), but the engine serves "
                         f"{served_checksum[:21]}: it needs a full sync")
    return decode(entries, json.loads(meta["encodings"]), served)


class DeltaEncoder:
    """The trainer side: the last version every engine took, and what to send next."""

    def __init__(self, full_every: int = 10) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.full_every = full_every
        self.base: dict[str, torch.Tensor] | None = None  # what the engines hold
        self.base_version: int | None = None
        self.base_checksum: str | None = None
        self._pending: tuple[int, dict[str, torch.Tensor], str] | None = None
        self._deltas = 0  # deltas sent since the last full sync

    def confirm(self, served_version: int) -> None:
        """The plane now serves ``served_version``: the pending update became the base if it
        was delivered; otherwise nothing is known about the engines (the next sync is full)."""
        if self._pending is not None:
            version, weights, checksum = self._pending
            if version == served_version:
                self.base, self.base_version, self.base_checksum = weights, version, checksum
            else:
                self.base = self.base_version = self.base_checksum = None
            self._pending = None

    def weights_of(self, version: int) -> dict[str, torch.Tensor] | None:
        """The whole weights of ``version`` if this encoder holds them (a restarted engine, or a
        reload onto an engine that no longer holds the base, needs them in full)."""
        if self._pending is not None and self._pending[0] == version:
            return self._pending[1]
        return self.base if self.base_version == version else None

    def write(self, weights: Mapping[str, torch.Tensor], version: int,
              path: str | Path) -> tuple[str, dict[str, float]]:
        """Write ``version`` to ``path``: a delta against the base when there is one and no
        full sync is due, else the whole model; its checksum and the sync's byte metrics (the
        caller adds ``sync_delta_fraction`` from the bytes it finds written)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        new = {n: t.detach().contiguous().cpu().clone() for n, t in weights.items()}
        checksum = weights_checksum(new)
        full_bytes = float(sum(t.numel() * t.element_size() for t in new.values()))
        delta = self.base is not None and self._deltas < self.full_every - 1
        if delta:
            assert self.base is not None
            entries, how = encode(new, self.base)
            save_file(entries, str(path / DELTA_FILE), metadata={
                "grpoflow_delta": "1", "base_version": str(self.base_version),
                "base_checksum": str(self.base_checksum), "encodings": json.dumps(how)})
            self._deltas += 1
        else:
            save_file(new, str(path / "model.safetensors"))
            self._deltas = 0
        self._pending = (version, new, checksum)
        return checksum, {"sync_full_bytes": full_bytes, "sync_delta": float(delta)}
