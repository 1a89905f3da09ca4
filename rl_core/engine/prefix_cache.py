"""A prefix cache for the embedded engine: the KV of finished requests, reused by later prompts
that start with the same tokens (SGLang's radix cache, as a flat LRU of sequences).

A multi-turn episode's next prompt is its last prompt, the model's turn and an observation:
with the cache, the engine computes only the new tokens. Entries are per-layer K/V copies of
a finished request's computed tokens (its prompt and every output token but the last, which
was never fed), evicted least-recently-used beyond ``max_tokens``; a lookup finds the entry
sharing the longest prefix with a prompt (at least ``min_tokens``, and never the prompt's last
token, whose logits the request needs). Anything that changes the weights (an update, a LoRA
switch) empties it. Used only by the scheduler thread, with the ``slots`` KV layout
(docs/rollout.md, "Prefix cache"); ``stats`` feed ``/server_info`` and ``cached_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "PrefixHit"]


@dataclass(eq=False)
class _Entry:
    ids: torch.Tensor  # (n,) int64: the tokens whose K/V are kept
    keys: list[torch.Tensor]  # per layer (kv_heads, n, head_dim)
    values: list[torch.Tensor]


@dataclass(frozen=True)
class PrefixHit:
    """The first ``length`` tokens of a prompt, found cached: their per-layer K and V."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixCache:
    """The LRU of finished sequences' KV (see the module docstring)."""

    def __init__(self, max_tokens: int, min_tokens: int = 8) -> None:
        if max_tokens < 0 or min_tokens < 1:
            raise ValueError("prefix cache: max_tokens >= 0 and min_tokens >= 1")
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next, self.tokens = 0, 0
        self.stats = {"prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
                      "prefix_cache_inserted": 0, "prefix_cache_evicted": 0}

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> PrefixHit | None:
        """The cached entry sharing the longest prefix with ``ids`` (at most ``len(ids) - 1``
        tokens), or None below ``min_tokens``; counted in ``stats``."""
        if not self.enabled:
            return None
        self.stats["prefix_cache_queried_tokens"] += len(ids)
        query = torch.tensor(ids, dtype=torch.long)
        best, best_len = None, 0
        for key, entry in self._entries.items():
            m = min(len(entry.ids), len(ids) - 1)
            if m <= best_len:
                continue
            differ = (entry.ids[:m] != query[:m]).nonzero()
            common = int(differ[0]) if len(differ) else m
            if common > best_len:
                best, best_len = key, common
        if best is None or best_len < self.min_tokens:
            return None
        self._entries.move_to_end(best)
        entry = self._entries[best]
        self.stats["prefix_cache_hit_tokens"] += best_len
        return PrefixHit(best_len, [k[:, :best_len] for k in entry.keys],
                         [v[:, :best_len] for v in entry.values])

    def insert(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep ``ids``' K/V (per layer (kv_heads, len(ids), head_dim), copied by the caller);
        entries it extends are dropped (it covers them), then the least recently used go until
        the cache fits ``max_tokens``."""
        n = len(ids)
        if not self.enabled or n < self.min_tokens or n > self.max_tokens:
            return
        new = torch.tensor(ids, dtype=torch.long)
        for key, entry in list(self._entries.items()):
            m = len(entry.ids)
            if m <= n and torch.equal(entry.ids, new[:m]):
                self._drop(key)
        self._entries[self._next] = _Entry(new, keys, values)
        self._next, self.tokens = self._next + 1, self.tokens + n
        self.stats["prefix_cache_inserted"] += 1
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
            self.stats["prefix_cache_evicted"] += 1

    def _drop(self, key: int) -> None:
        self.tokens -= len(self._entries.pop(key).ids)

    def clear(self) -> None:
        """Forget every entry (the weights changed, or memory is being freed)."""
        self._entries.clear()
        self.tokens = 0
