"""The in-process rollout engine (``rollout.engine: local``): a model copy plus the sampler.

It is the rollout plane in its smallest form and offers the calls the HTTP engines offer
(generate with per-sample seeds, versioned weight updates that report a checksum, weight
version and checksum queries), so the loop above it does not change when the engine moves
behind SGLang's HTTP API.

Never imports Prefect or MLflow; never touches the trainer's model object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_core.models import eos_token_ids, torch_dtype
from rl_core.rollout.sampler import Completion, SamplingParams, generate
from rl_core.weight_sync import WeightSyncError, weights_checksum

__all__ = ["LocalEngine"]


class LocalEngine:
    """A rollout engine in the calling process."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        micro_batch_size: int = 256,
        device: str = "cpu",
    ) -> None:
        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=trust_remote_code
        )
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.weight_version = 0
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model, model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """One completion per prompt (token ids, log-probs, finish reason, text)."""
        return generate(
            self.model,
            prompts,
            params,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            tokenizer=self.tokenizer,
            micro_batch_size=self.micro_batch_size,
        )

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> str:
        """Load ``weights`` (HF names), set ``weight_version``; returns the new checksum."""
        missing, unexpected = self.model.load_state_dict(dict(weights), strict=False)
        if unexpected or [k for k in missing if k not in self._tied_names()]:
            raise ValueError(f"weight update: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.weight_version = version
        return self.checksum()

    def sync_from(self, trainer: Any, version: int) -> dict[str, float]:
        """Load ``trainer.export_weights()`` as ``version``; the checksums must agree."""
        started = time.perf_counter()
        weights = trainer.export_weights()
        expected = weights_checksum(weights)
        got = self.update_weights(weights, version)
        if got != expected:
            raise WeightSyncError(
                f"weight sync to version {version}: the engine serves checksum {got[:21]} but "
                f"the trainer exported {expected[:21]}; refusing to sample from stale weights"
            )
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        return {"sync_seconds": time.perf_counter() - started, "sync_bytes": float(nbytes)}

    def checksum(self) -> str:
        return weights_checksum(self.model.state_dict())

    def _tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
