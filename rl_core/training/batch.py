"""The training batch: rollout samples laid out as tensors the trainer consumes.

Layout (right-padded, one row per sample): ``input_ids = prompt + response``; position
``t`` of every (B, L-1) tensor scores token ``t + 1`` given tokens ``<= t``, so
``response_mask[:, t]`` is true where token ``t + 1`` is a generated token. Token ids are
int32 and masks bool (they dominate the rollout -> training transfer at scale); log-probs
float32.

Never imports Prefect or MLflow; holds no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

__all__ = ["TrainBatch", "build_train_batch"]


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) int32
    attention_mask: torch.Tensor  # (B, L) bool
    response_mask: torch.Tensor  # (B, L-1) bool
    rollout_logp: torch.Tensor  # (B, L-1) float32, 0 outside the response
    advantages: torch.Tensor  # (B,) float32
    old_logp: torch.Tensor | None = None  # (B, L-1), trainer log-probs before the update
    ref_logp: torch.Tensor | None = None  # (B, L-1), reference-policy log-probs

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor) -> TrainBatch:
        """Rows ``index``, trimmed to the longest selected sequence."""
        width = int(self.attention_mask[index].sum(-1).max())
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
            elif value.dim() == 1:
                out[f.name] = value[index]
            elif f.name in ("input_ids", "attention_mask"):
                out[f.name] = value[index, :width]
            else:
                out[f.name] = value[index, : width - 1]
        return TrainBatch(**out)


def build_train_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    rollout_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float] | torch.Tensor,
    pad_token_id: int,
) -> TrainBatch:
    """Lay out samples as a right-padded :class:`TrainBatch`."""
    n = len(prompts)
    if not n == len(responses) == len(rollout_logprobs) == len(advantages):
        raise ValueError("prompts, responses, log-probs and advantages differ in length")
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((n, width), pad_token_id, dtype=torch.int32)
    attn = torch.zeros((n, width), dtype=torch.bool)
    resp = torch.zeros((n, max(width - 1, 1)), dtype=torch.bool)
    rlogp = torch.zeros((n, max(width - 1, 1)), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, rollout_logprobs, strict=True)):
        if len(lp) != len(r):
            raise ValueError(f"sample {i}: {len(r)} response tokens but {len(lp)} log-probs")
        if len(p) == 0:
            raise ValueError(f"sample {i}: empty prompt (nothing would score its first token)")
        seq = list(p) + list(r)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
        attn[i, : len(seq)] = True
        start = len(p) - 1
        resp[i, start : start + len(r)] = True
        rlogp[i, start : start + len(r)] = torch.tensor(list(lp), dtype=torch.float32)
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    return TrainBatch(ids, attn, resp, rlogp, adv)
