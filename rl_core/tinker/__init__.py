"""The compute behind grpoflow's Tinker-compatible service (docs/tinker.md): many users' LoRA
adapters on one base model, trained and sampled in this process. The HTTP protocol (sessions,
futures, protobuf) lives in :mod:`grpoflow.tinker`; this package knows nothing of it.

The types below are the interface between the two: token ids and numpy arrays in, numpy
arrays and plain dicts out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["AdamParams", "Datum", "LOSSES", "REFUSED_LOSSES", "SampledSequence",
           "SamplingParams", "TinkerError"]

# The losses forward_backward takes (tinker's names); docs/tinker.md gives each formula.
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
# Tinker's other names, each with why it is refused and what to use instead.
REFUSED_LOSSES = {
    "stable_reinforce": "Tinker has not published its objective, and it trains on sampler "
                        "records (sampling with record_stability_info=True, provenance spans "
                        "on each datum) that this server does not keep; use ppo, cispo or "
                        "gspo (docs/tinker.md)",
}


class TinkerError(ValueError):
    """A request the service refuses (the HTTP layer answers 400 with this message)."""


@dataclass(frozen=True)
class Datum:
    """One training example: the model input's token ids (text chunks concatenated) and the
    loss inputs, each a numpy array aligned with ``tokens`` (position ``i`` predicts
    ``target_tokens[i]``): ``target_tokens`` int64, ``weights`` / ``logprobs`` /
    ``advantages`` float32, 1-D ``[len(tokens)]`` (``target_tokens`` and ``weights`` may be
    2-D ``[len(tokens), K]``)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamParams:
    """tinker.AdamParams: AdamW (decoupled weight decay); ``grad_clip_norm`` 0: no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class SamplingParams:
    """tinker.SamplingParams: ``stop`` as token ids or strings; ``seed`` None: random.
    ``ignore_eos``: EOS does not end a sample either (the SDK's ``stop=[]``, "no stop at all";
    the HTTP layer passes ``stop=[]`` as ``stop=()`` without it today: docs/tinker.md)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[int, ...] | tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class SampledSequence:
    """One sample: its token ids, each token's log-prob, and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
