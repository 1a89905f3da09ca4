"""The pieces of one GRPO step, as plain functions over :class:`~rl_core.types.Sample`\\ s.

    prompts -> rollout (n samples per prompt) -> rewards -> group advantages -> Batch

Each function is one verb a task in ``tasks/`` calls. Samples carry their ``weight_version``
and a sampling seed from (run seed, step, prompt, sample index), so a re-run of a step's
rollout produces the same samples. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from rl_core.algorithms.advantages import group_advantages
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams, sample_seed
from rl_core.interfaces import RolloutPlane
from rl_core.rewards import RewardResult, Scorer
from rl_core.types import Batch, Sample, expand_segments

__all__ = ["AdvantageSource", "EpisodeKind", "GroupRelative", "SingleTurn", "advantages_for", "rollout_groups", "score_samples",
           "split_informative_groups", "summarize_samples"]


class EpisodeKind(Protocol):
    """What a rollout plays per task: one completion (:class:`SingleTurn`), or a multi-turn
    episode of an environment or an agent program (``rl_core.agents.kind.AgentEpisodes``).
    The step and evaluation call only these."""

    def episodes(self, records: Sequence[Record], prompt_ids: Sequence[Sequence[int]], *,
                 n: int, params: SamplingParams, step: int, seed: int) -> list[Sample]:
        """``n`` attempts at each record, groups contiguous and prompt-major."""

    def score(self, samples: Sequence[Sample], rewards: Scorer, *,
              pass_threshold: float, step: int | None = None, budget: bool = True
              ) -> RewardResult:  # fmt: skip
        """Set each sample's ``reward`` and ``correct``; the result holds them (``scores``,
        ``correct``) and the reward function's failure counts."""

    def check(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The kind's own metrics of a step's samples (may raise when a budget is spent)."""

    def close(self) -> None: ...


class SingleTurn:
    """One completion per attempt, scored by the run's reward."""

    def __init__(self, plane: RolloutPlane) -> None:
        self.plane = plane

    def episodes(self, records: Sequence[Record], prompt_ids: Sequence[Sequence[int]], *,
                 n: int, params: SamplingParams, step: int, seed: int) -> list[Sample]:
        return rollout_groups(self.plane, records, prompt_ids, n=n, params=params, step=step,
                              seed=seed)  # fmt: skip

    def score(self, samples: Sequence[Sample], rewards: Scorer, *,
              pass_threshold: float, step: int | None = None, budget: bool = True
              ) -> RewardResult:  # fmt: skip
        return score_samples(samples, rewards, step=step, budget=budget)

    def check(self, samples: Sequence[Sample]) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class AdvantageSource(Protocol):
    """Where a step's advantages come from, once the samples are scored: GRPO's
    group-relative ones (:class:`GroupRelative`), or on-policy distillation's per-token ones
    (``rl_core.teacher.Distillation``). The step calls only these."""

    pass_name: str | None  # the source's own pass over the scored samples (a task), or None

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The pass (e.g. the teacher's log-probs of the sampled tokens); its metrics."""

    def batch(self, samples: Sequence[Sample], pad_id: int) -> Batch:
        """``samples`` laid out as a training batch with their advantages."""

    def close(self) -> None: ...


class GroupRelative:
    """GRPO's (``algorithm.advantage``: ``grpo`` or ``drgrpo``) per-sample advantages
    within each prompt's group of ``n``."""

    pass_name: str | None = None

    def __init__(self, n: int, mode: str) -> None:
        self.n, self.mode = n, mode

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        return {}

    def batch(self, samples: Sequence[Sample], pad_id: int, segments: bool = True) -> Batch:
        """``segments``: an episode's earlier segments as rows of their own, with its
        advantage (:func:`~rl_core.types.expand_segments`; docs/agents.md, 'Reasoning
        templates')."""
        advantages = advantages_for(samples, self.n, self.mode)
        if segments:
            return Batch.from_samples(*expand_segments(samples, advantages), pad_id)
        return Batch.from_samples(samples, advantages, pad_id)

    def close(self) -> None:
        pass


def rollout_groups(plane: RolloutPlane, records: Sequence[Record],
                   prompt_ids: Sequence[Sequence[int]], *, n: int, params: SamplingParams,
                   step: int, seed: int) -> list[Sample]:
    """``n`` samples of each prompt; groups are contiguous, prompt-major."""
    keys = [(g, rec, j) for g, rec in enumerate(records) for j in range(n)]
    pictured = any(rec.images for rec in records)
    samples = plane.generate(
        [prompt_ids[g] for g, _, _ in keys],
        [replace(params, seed=sample_seed(seed, step, rec.id, j)) for _, rec, j in keys],
        **({"images": [rec.images for _, rec, _ in keys]} if pictured else {}),
    )
    for (g, rec, j), s in zip(keys, samples, strict=True):
        s.uid, s.group, s.record_id, s.answer = f"{step}:{rec.id}:{j}", g, rec.id, rec.answer
        s.prompt, s.columns = rec.question, dict(rec.columns)
    return samples


def score_samples(
    samples: Sequence[Sample], runner: Scorer, step: int | None = None,
    budget: bool = True,
) -> RewardResult:
    """Score every sample in place; a reward-function failure (an error or a timeout) scores 0,
    is counted, and marks its sample not ``valid`` (masked out of the group's statistics and
    the loss: an infrastructure failure is not a reward). ``step``: calls of one step, e.g.
    dynamic sampling's rounds, count as one step towards ``reward.max_failed_steps``. A judge
    also reads each sample's question (by record id)."""
    result = runner.score([s.text for s in samples], [s.answer for s in samples], step=step,
                          budget=budget, record_ids=[s.record_id for s in samples],
                          prompts=[s.prompt for s in samples],
                          columns=[s.columns for s in samples])
    failed = result.failed or [False] * len(samples)
    for s, r, ok, bad in zip(samples, result.scores, result.correct, failed, strict=True):
        s.reward, s.correct, s.valid = float(r), bool(ok), not bad
    return result


def split_informative_groups(
    samples: Sequence[Sample], n: int
) -> tuple[list[Sample], list[Sample]]:
    """DAPO's dynamic-sampling filter: (groups whose rewards differ, groups whose rewards are
    all equal). An all-equal group has zero advantage everywhere: it adds no policy gradient,
    only compute; only valid samples' rewards count (an infrastructure failure's 0 is not a
    reward). Groups are contiguous runs of ``n``; order is kept."""
    kept: list[Sample] = []
    dropped: list[Sample] = []
    for i in range(0, len(samples), n):
        group = samples[i : i + n]
        (kept if len({s.reward for s in group if s.valid}) > 1 else dropped).extend(group)
    return kept, dropped


def advantages_for(samples: Sequence[Sample], n: int, mode: str) -> torch.Tensor:
    """Group-relative advantages (GRPO or Dr.GRPO) for contiguous groups of ``n``, over each
    group's valid samples (:attr:`Sample.valid`)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    valid = torch.tensor([s.valid for s in samples], dtype=torch.bool)
    return group_advantages(rewards, n, mode=mode, valid=valid)  # type: ignore[arg-type]


def summarize_samples(samples: Sequence[Sample], n: int) -> dict[str, float]:
    """Reward, accuracy, length and group-variance statistics of one step's samples; the
    reward's over the valid samples (an infrastructure failure has none), and the share of
    each outcome class (``outcome/<class>_frac``: :attr:`Sample.outcome`)."""
    rewards = [s.reward for s in samples if s.valid] or [0.0]
    lengths = [len(s.completion_ids) for s in samples]
    groups = [{s.reward for s in samples[i : i + n] if s.valid}
              for i in range(0, len(samples), n)]
    outcomes = [s.outcome for s in samples]
    return {
        **{f"outcome/{c}_frac": outcomes.count(c) / len(samples)
           for c in ("success", "task_failure", "infra_failure")},
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "accuracy": statistics.fmean(float(s.correct) for s in samples),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_max": float(max(lengths)),
        "truncation_rate": statistics.fmean(float(s.truncated) for s in samples),
        "zero_std_group_frac": statistics.fmean(float(len(g) <= 1) for g in groups),
        "response_tokens": float(sum(lengths)),
        "prompt_tokens": float(sum(len(s.prompt_ids) for s in samples)),
    }
