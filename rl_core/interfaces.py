"""The three interfaces the GRPO loop is written against.

- :class:`RolloutPlane` generates samples and takes new weights: the HTTP plane
  (:class:`rl_core.rollout.http.HttpPlane`: engines behind SGLang's API, embedded or real
  SGLang) and the in-process plane (:class:`rl_core.rollout.inprocess.InProcessPlane`: the
  same engine core, no HTTP).
- :class:`Trainer` computes log-probs, trains, and hands out its weights: the torch trainer,
  the megatron trainer, and :class:`rl_core.training.distributed.TrainerGroup` (either, on
  Ray ranks). The weight side comes from :class:`rl_core.weight_sync.source.WeightSource`.
- :class:`WeightSync` is one transport of weights from a trainer to a plane (disk, Ray's
  object store, a ``torch.distributed`` broadcast, in-process tensors); every caller moves
  weights through :func:`rl_core.weight_sync.sync_weights`, the one update sequence.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from rl_core.engine.sampling import SamplingParams
from rl_core.types import Batch, Sample

__all__ = ["RolloutPlane", "Trainer", "WeightSync"]


class RolloutPlane(Protocol):
    """Engines that sample, as one: generate, pause for an update, verify, resume."""

    weight_version: int  # the version every sample is checked against (set by sync_weights)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], *,
        partial: bool = False, images: Sequence[tuple[bytes, ...]] | None = None,
        routing_keys: Sequence[str] | None = None,
    ) -> list[Sample]:
        """One sample per prompt, in order (a group is ``n`` copies of a prompt); ``images``:
        each prompt's images (encoded bytes; its image pads expanded), carried on its sample.
        ``partial``: a weight update may interrupt the call; an interrupted sample comes back
        aborted with its tokens so far, each sample tagged (``weight_version``) with the
        version that produced its tokens (:mod:`rl_core.rollout.stream` continues it).
        ``routing_keys``: each prompt's session (an episode): prompts of one key go to one
        engine, where the earlier turns' prefix is cached (session affinity)."""

    def paused(self) -> AbstractContextManager[list[Any]]:
        """Pause every engine, abort what is in flight and flush its cache; yield the
        engines to update (their handles for the transport); resume them on exit, always."""

    def verify(self, version: int, checksum: str | None) -> None:
        """Raise :class:`~rl_core.weight_sync.WeightSyncError` unless every engine serves
        ``version`` and (when ``checksum`` is given and the engine can tell) those weights."""

    def health(self) -> dict[str, Any]:
        """Engines in service, restarted, awaiting weights; what a status page shows."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None: ...
    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...
    def close(self) -> None: ...


class Trainer(Protocol):
    """One training backend, on one rank or many."""

    global_step: int  # optimizer steps applied
    needs_old_logp: bool  # the update is off the sampling policy within a step
    has_ref_model: bool  # reference log-probs exist (the KL term is on)

    def compute_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor: ...
    def train_step(self, batch: Batch) -> dict[str, float]: ...
    def export_weights(self) -> dict[str, torch.Tensor]: ...
    def write_weights(self, path: str | Path) -> str | None:
        """The policy as HF safetensors under ``path``; the checksum of what was written,
        computed where it was written (never by pulling the model to the caller)."""

    def save_pretrained(self, path: str | Path) -> Path: ...
    def save_state(self, path: str | Path) -> Path: ...
    def load_state(self, path: str | Path) -> None: ...
    def shutdown(self) -> None: ...


class WeightSync(Protocol):
    """One transport: stage the trainer's weights (outside the pause), load them into the
    paused engines, bring back a restarted engine."""

    def stage(self, trainer: Trainer, version: int) -> Any:
        """Make ``version`` available to the engines; returns what :meth:`load` needs, with
        the trainer's checksum as ``.checksum``."""

    def load(self, staged: Any, engines: list[Any], version: int) -> None: ...
    def resync(self, engine: Any) -> bool:
        """Bring a restarted engine to the current weights; False: at the next update."""

    def close(self) -> None: ...
