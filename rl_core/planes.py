"""The two planes of a run (rollout engine + trainer) and the verified sync between them.

Prefect tasks never carry models in their results: the flow brings the planes up once and
passes a small :class:`PlanesHandle` around; tasks resolve it here. In local mode the planes
live in this process's registry; the Ray issue makes the handle hold actor handles instead,
with the same methods.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_core.config import ExperimentConfig
from rl_core.data import Record, encode_prompts
from rl_core.rewards import RewardRunner
from rl_core.rollout.local import LocalEngine
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.weight_sync import WeightSyncError, weights_checksum

__all__ = ["LocalPlanes", "PlanesHandle", "bring_up_local", "get_planes", "tear_down"]


@dataclass(frozen=True)
class PlanesHandle:
    """A small, picklable reference to a run's planes."""

    key: str


@dataclass
class LocalPlanes:
    """Rollout engine and trainer in this process, plus the tokenized prompt sets."""

    config: ExperimentConfig
    engine: LocalEngine
    trainer: TorchTrainer
    train_records: list[Record]
    train_prompts: list[list[int]]
    eval_records: list[Record]
    eval_prompts: list[list[int]]
    reward_runner: RewardRunner
    skipped_long_prompts: int = 0

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to the engine as ``version`` and verify the checksum."""
        started = time.perf_counter()
        weights = self.trainer.export_weights()
        expected = weights_checksum(weights)
        got = self.engine.update_weights(weights, version)
        if got != expected:
            raise WeightSyncError(
                f"weight sync to version {version}: the engine serves checksum {got[:12]} but "
                f"the trainer exported {expected[:12]}; refusing to sample from stale weights"
            )
        if self.engine.weight_version != version:
            raise WeightSyncError(
                f"weight sync: engine reports version {self.engine.weight_version}, "
                f"expected {version}"
            )
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        return {"sync_seconds": time.perf_counter() - started, "sync_bytes": float(nbytes)}


_REGISTRY: dict[str, LocalPlanes] = {}


def _encode_within_limit(
    engine: LocalEngine, records: list[Record], cfg: ExperimentConfig
) -> tuple[list[Record], list[list[int]], int]:
    ids = encode_prompts(
        engine.tokenizer,
        [r.question for r in records],
        system_prompt=cfg.data.system_prompt,
        use_chat_template=cfg.data.use_chat_template,
    )
    keep = [i for i, p in enumerate(ids) if len(p) <= cfg.data.max_prompt_tokens]
    return [records[i] for i in keep], [ids[i] for i in keep], len(records) - len(keep)


def bring_up_local(
    cfg: ExperimentConfig,
    model_path: str | Path,
    train_records: list[Record],
    eval_records: list[Record],
) -> PlanesHandle:
    """Load the engine and the trainer from ``model_path``; tokenize the prompt sets."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    engine = LocalEngine(
        model_path,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        micro_batch_size=cfg.rollout.micro_batch_size,
    )
    trainer = TorchTrainer(
        model_path,
        cfg.train,
        cfg.algorithm,
        temperature=cfg.rollout.temperature,
        max_response_len=cfg.rollout.max_new_tokens,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    train_records, train_prompts, skipped = _encode_within_limit(engine, train_records, cfg)
    if not train_records:
        raise ValueError(
            f"every training prompt is longer than data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens}; raise it or shorten the prompts"
        )
    eval_records, eval_prompts, skipped_eval = _encode_within_limit(engine, eval_records, cfg)
    key = uuid.uuid4().hex
    _REGISTRY[key] = LocalPlanes(
        cfg,
        engine,
        trainer,
        train_records,
        train_prompts,
        eval_records,
        eval_prompts,
        RewardRunner(
            cfg.reward.fn, timeout_s=cfg.reward.timeout_s, format_weight=cfg.reward.format_weight
        ),
        skipped_long_prompts=skipped + skipped_eval,
    )
    return PlanesHandle(key)


def get_planes(handle: PlanesHandle) -> LocalPlanes:
    try:
        return _REGISTRY[handle.key]
    except KeyError:
        raise LookupError(
            f"planes {handle.key} are not up in this process (torn down, or the flow "
            "restarted); bring them up again"
        ) from None


def tear_down(handle: PlanesHandle) -> None:
    planes = _REGISTRY.pop(handle.key, None)
    if planes is not None:
        planes.reward_runner.close()
