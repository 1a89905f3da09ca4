"""What the service needs from its compute: :class:`Backend`, a structural type that
``rl_core.tinker.backend.LoraBackend`` satisfies (LoRA training and sampling of many users'
adapters on a few base models, in this process).

The service calls a backend's training and model methods from one worker thread per base
model (:mod:`.futures`), never from two threads for the same base model at once; ``sample``
and ``compute_logprobs`` come from the base model's sampling threads, several at once and
alongside that worker's calls (so that tenants' samples can share the engine's batches). A
method raises :class:`rl_core.tinker.TinkerError` for a request the user can fix; the service
turns it into a failed future of category ``user`` (any other exception: category
``server``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rl_core.tinker import AdamParams, Datum, SampledSequence, SamplingParams

__all__ = ["Backend", "LineageTracker", "MetricsTracker", "require_tinker"]


@runtime_checkable
class Backend(Protocol):
    """LoRA training and sampling on the base models it serves (see the module docstring)."""

    def base_model_names(self) -> list[str]:
        """The names clients pass as ``base_model``."""
        ...

    def tokenizer_dir(self, base_model: str) -> str:
        """A local directory ``transformers.AutoTokenizer`` loads (``get_info``'s tokenizer)."""
        ...

    def create_model(self, model_id: str, base_model: str, rank: int, *, seed: int | None = None,
                     train_mlp: bool = True, train_attn: bool = True,
                     train_unembed: bool = True) -> dict[str, Any]:
        """A fresh adapter (and its AdamW state) named ``model_id``."""
        ...

    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str,
                         config: Mapping[str, float] | None, forward_only: bool,
                         ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Per-datum float32 log-probs shaped like ``target_tokens``, and metrics keyed
        ``name:reduction`` (``loss:sum`` among them); accumulates gradients unless
        ``forward_only``."""
        ...

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """Apply and clear the accumulated gradients."""
        ...

    def save_state(self, model_id: str, out_dir: Path, with_optimizer: bool = True) -> None:
        """Adapter weights (and optimizer state) into ``out_dir``."""
        ...

    def load_state(self, model_id: str, src_dir: Path, with_optimizer: bool) -> None:
        """Replace ``model_id``'s adapter (and optimizer state) with a saved one."""
        ...

    def saved_config(self, src_dir: Path) -> dict[str, Any]:
        """The configuration a saved state was created with (``base_model``, ``rank``, ...)."""
        ...

    def save_sampler_weights(self, model_id: str, out_dir: Path) -> None:
        """The adapter as ``sample`` reads it, into ``out_dir``."""
        ...

    def sample(self, base_model: str, adapter_dir: Path | None, prompt: list[int],
               num_samples: int, params: SamplingParams) -> list[SampledSequence]:
        """``num_samples`` continuations of ``prompt`` (base model alone when no adapter)."""
        ...

    def compute_logprobs(self, base_model: str, adapter_dir: Path | None,
                         tokens: list[int]) -> list[float | None]:
        """Each token's log-prob given the ones before it (``None`` for the first)."""
        ...

    def close(self) -> None:
        """Release the models."""
        ...


class MetricsTracker(Protocol):
    """Where training metrics go (optional): called on the worker thread after each
    ``forward_backward`` (step: optimizer steps so far) and ``optim_step`` (step: its
    number), with the run (model) id; an exception is logged and ignored."""

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None: ...


class LineageTracker(MetricsTracker, Protocol):
    """A tracker that also records lineage (:class:`grpoflow.tinker.lineage.MlflowLineage`).
    The service calls each method a tracker has (any may be missing), on the base model's
    worker thread in the order the work ran, except ``close``; none may block on a remote
    server, and an exception is logged and ignored. ``run_id`` is the training client's model
    id (also its training run id)."""

    def start_run(self, run_id: str, params: Mapping[str, Any],
                  tags: Mapping[str, str]) -> None:
        """A training client was created (``params``: base model, rank, seed, train flags,
        tenant, ``resumed_from``; ``tags``: the service's ids)."""
        ...

    def log_call(self, run_id: str, op: str, step: int, info: Mapping[str, float]) -> None:
        """What the service measured about one call ``op`` (``forward``,
        ``forward_backward``, ``optim_step``): ``seconds`` it ran, ``queue_seconds`` it waited
        and, for ``optim_step``, its hyperparameters."""
        ...

    def log_checkpoint(self, run_id: str, kind: str, name: str, path: Path,
                       tinker_path: str) -> None:
        """A checkpoint was committed: ``kind`` ``weights`` (save_state) or
        ``sampler_weights``, in directory ``path``."""
        ...

    def end_run(self, run_id: str, status: str) -> None:
        """The training client is gone: ``FINISHED`` (its session ended) or ``KILLED`` (the
        service stopped)."""
        ...

    def close(self) -> None:
        """The service stops: send what is queued, within the tracker's own bound."""
        ...


def require_tinker() -> Any:  # noqa: ANN401 - the SDK's generated protobuf module
    """The Tinker SDK's generated protobuf module (``tinker.proto.tinker_public_pb2``): the
    wire schema the service speaks. ``tinker`` is an optional dependency of grpoflow."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:
        raise ImportError("the Tinker-compatible service needs the Tinker SDK's protobuf "
                          "schema: pip install 'grpoflow[tinker]'") from exc
    return tinker_public_pb2
