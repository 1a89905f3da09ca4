"""The two records a GRPO step carries: :class:`Sample` and :class:`Batch`.

A :class:`Sample` is made once by the rollout plane from the engine's own token ids (never
re-tokenized) and is what the reward scores, the ledger records and the loss trains on;
``loss_mask`` marks generated completion tokens (0: tool or environment text). A :class:`Batch`
is right-padded tensors, one row per sample: position ``t`` of every (B, L-1) tensor scores
token ``t + 1``; ids int32, masks bool, log-probs float32. MoE routing travels as SGLang returns
it (``routed_experts``, docs/moe.md). Never imports Prefect or MLflow; holds no model.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

__all__ = ["TEMPLATE_SEGMENTS", "Batch", "Sample", "decode_routed_experts",
           "encode_routed_experts", "expand_segments", "pad_routed_experts"]

# ``Sample.meta`` key: an episode's earlier segments, each a Sample of its own (docs/agents.md,
# 'Reasoning templates': ``agent.template_mismatch: new_sample``).
TEMPLATE_SEGMENTS = "template_segments"


def encode_routed_experts(ids: np.ndarray | torch.Tensor) -> str:
    """SGLang's ``routed_experts``: the base64 of ``ids`` as C-ordered int32."""
    arr = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(data: str) -> np.ndarray:
    """The flat int32 array of a ``routed_experts`` string (reshape it to [-1, layers, k])."""
    return np.frombuffer(base64.b64decode(data), dtype=np.int32)


def pad_routed_experts(data: str, rows: int, total: int) -> str:
    """``routed_experts`` that cover ``rows`` tokens, extended with -1 rows (the trainer's
    own routing) to ``total``: a multi-turn episode's routing is its last model turn's
    request (every token before it, re-routed in that request's prefill), and tokens after
    it (an environment's last observation) have none."""
    ids = decode_routed_experts(data)
    if rows <= 0 or ids.size % rows or total < rows:
        raise ValueError(f"routed_experts holds {ids.size} expert ids, not {rows} tokens' "
                         f"(to pad to {total})")
    out = np.full((total, ids.size // rows), -1, dtype=np.int32)
    out[:rows] = ids.reshape(rows, -1)
    return encode_routed_experts(out)


@dataclass
class Sample:
    """One rollout of one prompt, from generation to the loss."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # per completion token, as the engine sampled it
    finish_reason: dict[str, Any] = field(default_factory=dict)  # SGLang's shape
    weight_version: int = 0  # the policy version that generated it
    text: str = ""
    loss_mask: list[int] | None = None  # None: every completion token is the model's
    uid: str = ""  # ``step:record:index``: the ledger's key
    group: int = 0  # samples of one prompt share a group
    record_id: str = ""
    answer: Any = ""  # the record's reference answer (any type)
    # The record's prompt (text or chat messages) and every column of its row, for the reward
    # (a batched function's ``prompts`` and ``**columns``) and the sample tables.
    prompt: Any = field(default=None, repr=False)
    columns: dict[str, Any] = field(default_factory=dict, repr=False)
    reward: float = 0.0
    correct: bool = False
    meta: dict[str, Any] = field(default_factory=dict, repr=False)  # the engine's meta_info
    # Per completion token, the weight version that produced it (an episode's turns, or a
    # partial rollout continued after an update); None: every token is ``weight_version``'s.
    versions: list[int] | None = None
    # MoE routing of every token but the last (SGLang's base64 int32 [seq_len - 1, moe_layers,
    # top_k], module docstring); None: not asked for (train.moe.routing_replay off) or dense.
    routed_experts: str | None = field(default=None, repr=False)
    # The prompt's images as encoded bytes (PNG, JPEG, ...), in the order of its image pads:
    # the record's, then any an episode's observations added (docs/vlm.md).
    images: tuple[bytes, ...] = field(default=(), repr=False)
    # False: an infrastructure failure (an environment, sandbox or reward function that failed
    # after its retries; docs/agents.md, 'Failures are not rewards'): its reward is not a
    # score, so it takes no part in its group's statistics and trains on nothing.
    valid: bool = True

    @property
    def outcome(self) -> str:
        """``success`` (correct), ``task_failure`` (scored, not correct) or
        ``infra_failure`` (not :attr:`valid`)."""
        return "infra_failure" if not self.valid else "success" if self.correct else "task_failure"

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    @classmethod
    def from_sglang(cls, prompt_ids: Sequence[int], body: dict[str, Any]) -> Sample:
        """One ``/generate`` answer. Token ids come from ``output_token_logprobs`` entries
        ``[logprob, token_id, text]`` when present (as slime and AReaL read them), else from
        ``output_ids``; the engine's ``weight_version`` label stays in ``meta``."""
        meta = dict(body.get("meta_info") or {})
        routed = meta.pop("routed_experts", None)  # kept once, in its own field
        entries = meta.get("output_token_logprobs") or []
        if entries:
            ids, logprobs = [int(e[1]) for e in entries], [float(e[0]) for e in entries]
        else:
            ids, logprobs = [int(t) for t in body.get("output_ids") or []], []
        return cls(list(prompt_ids), ids, logprobs, dict(meta.get("finish_reason") or {}),
                   text=body.get("text") or "", meta=meta, routed_experts=routed)

    def ledger_row(self, trained: bool) -> dict[str, Any]:
        """What the sample ledger keeps: which prompt, which weights, what it scored."""
        row = {"uid": self.uid, "weight_version": self.weight_version, "reward": self.reward,
               "tokens": len(self.completion_ids), "trained": trained}
        if self.versions and min(self.versions) != max(self.versions):  # a partial rollout
            row["versions"] = [min(self.versions), max(self.versions)]
        if self.meta.get("stale"):  # finished too late for rollout.max_staleness
            row["stale"] = True
        if self.meta.get("unused"):  # streamed, not trained when the run ended
            row["unused"] = True
        if not self.valid:  # an infrastructure failure: masked out of the step
            row["valid"] = False
        if (episode := self.meta.get("episode")) is not None:  # a multi-turn episode
            row.update(episode=episode["status"], turns=episode["turns"],
                       tool_calls=episode["tool_calls"])
        return row


@dataclass
class Batch:
    """Samples as right-padded training tensors (see the module docstring)."""

    input_ids: torch.Tensor  # (B, L) int32
    attention_mask: torch.Tensor  # (B, L) bool
    response_mask: torch.Tensor  # (B, L-1) bool: the tokens the loss trains on
    rollout_logp: torch.Tensor  # (B, L-1) float32, 0 outside the response
    advantages: torch.Tensor  # (B,) float32
    old_logp: torch.Tensor | None = None  # (B, L-1), trainer log-probs before the update
    ref_logp: torch.Tensor | None = None  # (B, L-1), reference-policy log-probs
    prompt_lens: torch.Tensor | None = None  # (B,) int64: rows sharing a prompt pack together
    # (B, L-1, moe_layers * top_k) int16: the rollout's experts per token (module docstring)
    routed_experts: torch.Tensor | None = None
    # Per row, its images as encoded bytes, in the order of its image pads (a vision-language
    # model's trainer turns them into pixels); None: no row has any.
    images: list[tuple[bytes, ...]] | None = None
    # Per row, the role whose adapter trains on it (``train.lora.per_role``; docs/lora.md);
    # None: one policy for every row.
    roles: list[str] | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: torch.Tensor) -> Batch:
        """Rows ``index``, trimmed to the longest selected sequence."""
        width = int(self.attention_mask[index].sum(-1).max())
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("images", "roles"):
                out[f.name] = None if value is None else [value[i] for i in index.tolist()]
            elif value is None or value.dim() == 1:
                out[f.name] = None if value is None else value[index]
            elif f.name in ("input_ids", "attention_mask"):
                out[f.name] = value[index, :width]
            else:
                out[f.name] = value[index, : width - 1]
        return Batch(**out)

    @classmethod
    def from_samples(
        cls, samples: Sequence[Sample], advantages: Sequence[float] | torch.Tensor, pad_id: int
    ) -> Batch:
        """Lay out ``samples`` (each with its advantage) as one right-padded batch."""
        n = len(samples)
        if n != len(advantages):
            raise ValueError(f"{n} samples but {len(advantages)} advantages")
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        ids = torch.full((n, width), pad_id, dtype=torch.int32)
        attn = torch.zeros((n, width), dtype=torch.bool)
        resp = torch.zeros((n, max(width - 1, 1)), dtype=torch.bool)
        rlogp = torch.zeros((n, max(width - 1, 1)), dtype=torch.float32)
        for i, s in enumerate(samples):
            p, r = s.prompt_ids, s.completion_ids
            if len(s.logprobs) != len(r):
                raise ValueError(f"sample {i}: {len(r)} tokens but {len(s.logprobs)} log-probs")
            if s.loss_mask is not None and len(s.loss_mask) != len(r):
                raise ValueError(f"sample {i}: {len(r)} tokens but {len(s.loss_mask)} mask values")
            if not p:
                raise ValueError(f"sample {i}: empty prompt (nothing would score its first token)")
            ids[i, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.int32)
            attn[i, : len(p) + len(r)] = True
            start = len(p) - 1
            mask = torch.ones(len(r), dtype=torch.bool) if s.loss_mask is None else (
                torch.tensor(s.loss_mask, dtype=torch.bool))
            if not s.valid:  # an infrastructure failure trains on nothing (no KL either)
                mask = torch.zeros(len(r), dtype=torch.bool)
            resp[i, start : start + len(r)] = mask
            rlogp[i, start : start + len(r)] = torch.tensor(s.logprobs, dtype=torch.float32) * mask
        return cls(ids, attn, resp, rlogp, torch.as_tensor(advantages, dtype=torch.float32),
                   prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples]),
                   routed_experts=_routed_layout(samples, rlogp.shape[1]),
                   images=[tuple(s.images) for s in samples]
                   if any(s.images for s in samples) else None)


def expand_segments(samples: Sequence[Sample], advantages: Sequence[float] | torch.Tensor
                    ) -> tuple[list[Sample], torch.Tensor]:
    """``samples`` and, after them, every episode's earlier segments
    (``meta[TEMPLATE_SEGMENTS]``) as rows of their own, each with its episode's advantage,
    reward and validity: the group's statistics saw the episode once, and every token it
    generated trains with that advantage. Without segments: the input as it is."""
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    extra = [(i, seg) for i, s in enumerate(samples) for seg in s.meta.get(TEMPLATE_SEGMENTS, ())]
    if not extra:
        return list(samples), adv
    for i, seg in extra:
        seg.reward, seg.correct, seg.valid = samples[i].reward, samples[i].correct, samples[i].valid
    rows = [*samples, *(seg for _, seg in extra)]
    return rows, torch.cat([adv, adv[torch.tensor([i for i, _ in extra])]])


def _routed_layout(samples: Sequence[Sample], columns: int) -> torch.Tensor | None:
    """``Batch.routed_experts`` from the samples' ``routed_experts`` (None if none has any;
    rows of a sample without them are -1: the trainer routes those tokens itself)."""
    if all(s.routed_experts is None for s in samples):
        return None
    flat: list[np.ndarray | None] = []
    width = None
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            flat.append(None)
            continue
        ids = decode_routed_experts(s.routed_experts)
        rows = len(s.prompt_ids) + len(s.completion_ids) - 1
        if rows <= 0 or ids.size % rows or (width is not None and ids.size // rows != width):
            raise ValueError(f"sample {i}: routed_experts holds {ids.size} expert ids, not "
                             f"{rows} tokens x {width or 'moe_layers * top_k'}")
        width = ids.size // rows
        flat.append(ids.reshape(rows, width))
    out = torch.full((len(samples), columns, width or 1), -1, dtype=torch.int16)
    for i, ids in enumerate(flat):
        if ids is not None:
            out[i, : ids.shape[0]] = torch.from_numpy(ids.astype(np.int16))
    return out
