"""On-policy distillation: a teacher plane scores the student's samples token by token.

A second rollout plane serving ``teacher.path`` scores every sampled token by prefill only, and
each token's advantage becomes (``normalize``: the gap centred and scaled over the step first)

    A_t = task_weight * A_grpo + kl_weight * (log p_teacher(y_t) - log p_student(y_t))

``log p_student`` being the rollout engine's: the per-token reverse KL's negative estimate. The
forward KL, SFT on the teacher's samples, uses :func:`teacher_examples` (docs/distillation.md).
Teacher and student must share a tokenizer. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rl_core.types import Batch, Sample

if TYPE_CHECKING:
    from rl_core.config import TeacherConfig
    from rl_core.sft import Example, SFTDataConfig

__all__ = ["TEACHER_LOGPROBS", "Distillation", "check_tokenizers", "distill_advantages",
           "score_with_teacher", "teacher_examples"]

log = logging.getLogger(__name__)

TEACHER_LOGPROBS = "teacher_logprobs"  # Sample.meta key


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
    if cfg.normalize and mask.any():
        tokens = gap[mask]
        std = tokens.std(unbiased=False) if tokens.numel() > 1 else tokens.new_tensor(0.0)
        gap = (gap - tokens.mean()) / (std + 1e-6) * mask
    return cfg.task_weight * batch.advantages[:, None] * mask + cfg.kl_weight * gap


class Distillation:
    """On-policy distillation as an advantage source (``rl_core.grpo.AdvantageSource``): its
    pass is the teacher's log-prob of every sampled token on the teacher ``plane``; the
    advantages are :func:`distill_advantages` over ``task``'s (GRPO's group-relative ones)."""

    pass_name = "teacher-score"

    def __init__(self, plane: Any, cfg: TeacherConfig, task: Any) -> None:  # noqa: ANN401
        self.plane, self.cfg, self.task = plane, cfg, task

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        started = time.perf_counter()
        metrics = score_with_teacher(self.plane, samples)
        return {**metrics, "time/teacher": time.perf_counter() - started}

    def batch(self, samples: Sequence[Sample], pad_id: int) -> Batch:
        # The teacher scored each episode's last segment only: earlier segments (docs/agents.md,
        # 'Reasoning templates') are not rows here.
        out = self.task.batch(samples, pad_id, segments=False)
        out.advantages = distill_advantages(out, samples, self.cfg)
        return out

    def close(self) -> None:
        self.plane.close()


# ------------------------------------------------------------ the forward KL: teacher samples


def teacher_examples(plane: Any, tokenizer: Any, examples: Sequence[Example], d: SFTDataConfig,
                     chunk: int = 512) -> tuple[list[Example], dict[str, float]]:
    """``examples`` (prompt rows) with their completions replaced by ``plane``'s samples
    (``samples_per_prompt`` each, prompts rendered as the SFT step will with the student's
    ``tokenizer``); cut and empty samples dropped, ``keep: correct`` keeps what the gsm8k reward
    accepts. Returns the examples and counts (``samples``, ``kept``, ``truncated``, ``empty``,
    ``correct``, ``prompt_tokens``, ``completion_tokens``, ``seconds``)."""
    from rl_core.engine.sampling import SamplingParams, sample_seed
    from rl_core.rewards import gsm8k_reward
    from rl_core.sft import Example

    t = d.teacher
    if chat := next((e for e in examples if e.messages), None):
        raise ValueError(f"{chat.origin}: data.teacher.path samples completions for prompt "
                         "rows ({prompt, completion}); this row is a chat conversation. Map "
                         "its columns to prompt rows (data.prompt_field / completion_field) or "
                         "unset data.teacher.path")
    if pictured := next((e for e in examples if e.images), None):
        raise ValueError(f"{pictured.origin}: data.teacher.path samples completions for text "
                         "prompts only in this version, and this row has images; unset "
                         "data.teacher.path")
    started = time.perf_counter()
    prompts = {e.id: ids for e, ids in zip(
        examples, _encode([e.prompt or "" for e in examples], tokenizer, d), strict=True)}
    jobs = [(e, j) for e in examples for j in range(t.samples_per_prompt)]
    out: list[Example] = []
    counts = dict.fromkeys(("samples", "kept", "truncated", "empty", "correct",
                            "prompt_tokens", "completion_tokens"), 0.0)
    for at in range(0, len(jobs), chunk):
        part = jobs[at : at + chunk]
        params = [SamplingParams(temperature=t.temperature, top_p=t.top_p,
                                 max_new_tokens=t.max_new_tokens,
                                 seed=sample_seed(t.seed, 0, f"teacher:{e.id}", j))
                  for e, j in part]
        samples = plane.generate([prompts[e.id] for e, _ in part], params)
        for (e, j), s in zip(part, samples, strict=True):
            counts["samples"] += 1
            counts["prompt_tokens"] += len(s.prompt_ids)
            counts["completion_tokens"] += len(s.completion_ids)
            text = tokenizer.decode(s.completion_ids, skip_special_tokens=True)
            if s.truncated:
                counts["truncated"] += 1
                continue
            if not text.strip():
                counts["empty"] += 1
                continue
            right = gsm8k_reward(text, e.reference) == 1.0
            counts["correct"] += right
            if t.keep == "all" or right:
                out.append(Example(f"{e.id}#teacher{j}", f"{e.origin}, teacher sample {j + 1}",
                                   prompt=e.prompt, completion=text))
        log.info("teacher samples: %d of %d (%d kept)", at + len(part), len(jobs), len(out))
    counts["kept"] = float(len(out))
    counts["seconds"] = time.perf_counter() - started
    if not out:
        raise ValueError(
            f"data.teacher: none of the teacher's {counts['samples']:.0f} samples was kept "
            f"({counts['truncated']:.0f} cut at data.teacher.max_new_tokens="
            f"{t.max_new_tokens}, {counts['empty']:.0f} empty, {counts['correct']:.0f} correct "
            f"with data.teacher.keep={t.keep}); raise max_new_tokens or samples_per_prompt, "
            "or keep all")
    return out, counts


def _encode(prompts: Sequence[str], tokenizer: Any, d: SFTDataConfig) -> list[list[int]]:
    from rl_core.sft import prompt_text

    return [list(tokenizer(prompt_text(tokenizer, p, d), add_special_tokens=False)["input_ids"])
            for p in prompts]
