"""On-policy distillation: a teacher plane scores the student's samples token by token.

The student samples as in GRPO; a second rollout plane serving the teacher (``teacher.path``;
embedded engines on CPU, SGLang on GPUs) scores every sampled token by prefill only (SGLang's
``max_new_tokens: 0`` + ``logprob_start_len``, :meth:`~rl_core.rollout.http.HttpPlane.score`).
Each token's advantage is then

    A_t = task_weight * A_grpo + kl_weight * (log p_teacher(y_t) - log p_student(y_t))

where ``log p_student`` is what the rollout engine reported for the token (the sampling
policy), so the second term is the per-token *reverse* KL's negative estimate: tokens the
teacher finds likelier than the student are pushed up, the others down (on-policy
distillation: Agarwal et al. 2024, Qwen3, Thinking Machines 2025). ``task_weight: 0`` is pure
distillation; GRPO's clipping, the loss aggregation and the rollout corrections apply as
they do to GRPO's advantages.

The teacher and the student must share a tokenizer (their vocabularies are compared when the
planes come up: a mismatch names both models). Never imports Prefect or MLflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from rl_core.types import Batch, Sample

__all__ = ["TEACHER_LOGPROBS", "TeacherConfig", "check_tokenizers", "distill_advantages",
           "score_with_teacher"]

TEACHER_LOGPROBS = "teacher_logprobs"  # Sample.meta key


class TeacherConfig(BaseModel):
    """On-policy distillation (``path`` set): docs/distillation.md."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    path: str | None = Field(None, description="The teacher: HF hub id, local HF directory or "
                             "an `embedded:` model; None = no distillation.")
    engine: Literal["embedded", "sglang", "local"] = Field(
        "embedded", description="What serves the teacher (as rollout.engine).")
    num_engines: int = Field(1, ge=1)
    kl_weight: float = Field(1.0, ge=0.0, description="Weight of the per-token reverse-KL "
                             "advantage log p_teacher - log p_student.")
    task_weight: float = Field(0.0, ge=0.0, description="Weight of the task reward's GRPO "
                               "advantage (0: pure distillation).")

    @property
    def enabled(self) -> bool:
        return self.path is not None


def check_tokenizers(student: Any, teacher: Any, student_path: str, teacher_path: str) -> None:
    """Refuse a teacher whose vocabulary differs from the student's (token ids would mean
    different strings, so its log-probs would score other text)."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a == b:
        return
    differ = sorted(t for t in set(a) | set(b) if a.get(t) != b.get(t))
    raise ValueError(
        f"teacher.path {teacher_path!r} has another tokenizer than the student "
        f"{student_path!r}: vocabularies of {len(b)} and {len(a)} tokens, {len(differ)} "
        f"tokens differ (e.g. {differ[:5]}). On-policy distillation scores the student's "
        "token ids with the teacher, so both must use the same tokenizer: pick a teacher of "
        "the same model family")


def score_with_teacher(plane: Any, samples: Sequence[Sample]) -> dict[str, float]:
    """Store the teacher's log-prob of every completion token in ``sample.meta`` (one
    scoring request per prompt group); the step's distillation metrics: the reverse KL
    estimate (mean over tokens of log p_student - log p_teacher) and both mean log-probs."""
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    for prompt, group in groups.items():
        scoring = [s for s in group if s.completion_ids]
        scores = plane.score(list(prompt), [s.completion_ids for s in scoring]) if scoring else []
        for s, lp in zip(scoring, scores, strict=True):
            s.meta[TEACHER_LOGPROBS] = lp
        for s in group:
            s.meta.setdefault(TEACHER_LOGPROBS, [])
    teacher = [x for s in samples for x in s.meta[TEACHER_LOGPROBS]]
    student = [x for s in samples for x in s.logprobs]
    n = max(len(teacher), 1)
    return {"distill/reverse_kl": (sum(student) - sum(teacher)) / n,
            "distill/teacher_logp_mean": sum(teacher) / n,
            "distill/student_logp_mean": sum(student) / n}


def distill_advantages(batch: Batch, samples: Sequence[Sample], cfg: TeacherConfig) -> torch.Tensor:
    """Per-token advantages (B, L-1) for ``batch`` (laid out from ``samples``, whose
    ``advantages`` are GRPO's per sample)."""
    if batch.advantages.dim() != 1:
        raise ValueError("distill_advantages takes the batch with GRPO's per-sample advantages")
    teacher = torch.zeros_like(batch.rollout_logp)
    for i, s in enumerate(samples):
        lp = s.meta.get(TEACHER_LOGPROBS)
        if lp is None or len(lp) != len(s.completion_ids):
            raise ValueError(f"sample {s.meta.get('id', i)}: the teacher scored "
                             f"{None if lp is None else len(lp)} of {len(s.completion_ids)} tokens")
        start = len(s.prompt_ids) - 1
        teacher[i, start : start + len(lp)] = torch.tensor(lp, dtype=torch.float32)
    mask = batch.response_mask
    gap = (teacher - batch.rollout_logp) * mask  # log p_teacher - log p_student, per token
    return cfg.task_weight * batch.advantages[:, None] * mask + cfg.kl_weight * gap
