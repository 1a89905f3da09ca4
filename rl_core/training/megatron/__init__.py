"""The megatron-core training backend (``train.backend: megatron``); docs/megatron.md.

:class:`~rl_core.training.megatron.trainer.MegatronTrainer` is imported lazily: importing
megatron-core takes seconds, and the torch backend never needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MegatronTrainer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTrainer":
        from rl_core.training.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(name)
