"""Deterministic, resumable prompt sampling: which dataset indices each step trains on.

The whole state is ``(seed, epoch, position)``; epoch ``e`` is
``numpy.random.default_rng([seed, e]).permutation(num_items)``, so a restored state draws
exactly the batches the original run would have (docs/configuration.md, 'Data'). Never uses
global random state, does I/O, or imports prefect or mlflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["PromptSampler"]

_STATE_KEYS = ("seed", "epoch", "position")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class PromptSampler:
    """Batches of dataset indices; each epoch is a seeded permutation of ``range(num_items)``. A
    batch may span an epoch boundary; a used-up epoch moves to ``(epoch + 1, 0)`` at once. That
    the dataset is unchanged across a resume is the caller's check (``num_items`` is not state)."""

    def __init__(self, num_items: int, batch_size: int, seed: int) -> None:
        self._num_items = _check_int("num_items", num_items, 1)
        self._batch_size = _check_int("batch_size", batch_size, 1)
        self._seed = _check_int("seed", seed, 0)
        self._epoch = self._position = 0
        self._cache: tuple[int, np.ndarray] | None = None

    @property
    def num_items(self) -> int:
        return self._num_items

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    @property
    def epoch_progress(self) -> float:
        """Fraction of the current epoch already drawn, in [0, 1)."""
        return self._position / self._num_items

    def permutation(self, epoch: int) -> list[int]:
        """The visiting order of ``epoch``: a pure function of (seed, epoch, num_items)."""
        return [int(i) for i in self._order(_check_int("epoch", epoch, 0))]

    def _order(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            order = np.random.default_rng([self._seed, epoch]).permutation(self._num_items)
            self._cache = (epoch, order)
        return self._cache[1]

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` indices, continuing across epoch boundaries."""
        batch: list[int] = []
        while len(batch) < self._batch_size:
            order = self._order(self._epoch)
            take = min(self._batch_size - len(batch), self._num_items - self._position)
            batch.extend(int(i) for i in order[self._position : self._position + take])
            self._position += take
            if self._position == self._num_items:
                self._epoch += 1
                self._position = 0
        return batch

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "epoch", "position"}``: everything needed to continue the sequence."""
        return {"seed": self._seed, "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the saved seed wins over the constructor's). ``position``
        must be within [0, num_items]; ``num_items`` means the start of the next epoch. Raises
        ValueError on missing keys or bad values, leaving the sampler unchanged."""
        missing = [k for k in _STATE_KEYS if k not in state]
        extra = sorted(set(state) - set(_STATE_KEYS))
        if missing or extra:
            raise ValueError(f"sampler state must have exactly the keys {list(_STATE_KEYS)}; "
                             f"missing {missing}, unexpected {extra}")
        seed, epoch, position = (_check_int(f"sampler state {k}", state[k], 0) for k in _STATE_KEYS)
        if position > self._num_items:
            raise ValueError(
                f"sampler state position {position} is beyond num_items={self._num_items}; "
                "the checkpoint was taken on a larger dataset: load the same data (compare "
                "records digests) or start the sampler fresh")
        if position == self._num_items:
            epoch, position = epoch + 1, 0
        self._seed, self._epoch, self._position = seed, epoch, position
        self._cache = None

    def __repr__(self) -> str:
        return (f"PromptSampler(num_items={self._num_items}, batch_size={self._batch_size}, "
                f"seed={self._seed}, epoch={self._epoch}, position={self._position})")
