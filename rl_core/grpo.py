"""The pieces of one GRPO step, as plain functions over samples.

    prompts -> rollout (n samples per prompt) -> rewards -> group advantages -> train batch

Each function is one verb of the step and is what a Prefect task in ``tasks/`` calls.
Samples carry the ``weight_version`` that produced them and a per-sample sampling seed
derived from (run seed, step, prompt, sample index), so a re-run of a step's rollout
after a failure produces the same samples.

Never imports Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rl_core.algorithms import group_advantages
from rl_core.data import Record
from rl_core.rewards import RewardResult, RewardRunner
from rl_core.rollout.sampler import Completion, SamplingParams
from rl_core.training.batch import TrainBatch, build_train_batch

__all__ = [
    "RolloutEngine",
    "Sample",
    "advantages_for",
    "rollout_groups",
    "sample_seed",
    "score_samples",
    "split_informative_groups",
    "summarize_samples",
    "to_train_batch",
]


class RolloutEngine(Protocol):
    """What the loop needs from the rollout plane (in-process or over HTTP)."""

    weight_version: int

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]: ...


@dataclass
class Sample:
    """One completion of one prompt, with everything the rest of the step needs."""

    uid: str
    group: int
    record_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    text: str
    answer: str
    weight_version: int
    reward: float = 0.0
    correct: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"


def sample_seed(seed: int, step: int, record_id: str, index: int) -> int:
    """A 62-bit sampling seed that depends only on what the sample *is*."""
    blob = f"{seed}:{step}:{record_id}:{index}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 2


def rollout_groups(
    engine: RolloutEngine,
    records: Sequence[Record],
    prompt_ids: Sequence[Sequence[int]],
    *,
    n: int,
    params: SamplingParams,
    step: int,
    seed: int,
) -> list[Sample]:
    """Generate ``n`` samples for each prompt; groups are contiguous, prompt-major."""
    flat_prompts, flat_params, keys = [], [], []
    for g, (rec, ids) in enumerate(zip(records, prompt_ids, strict=True)):
        for j in range(n):
            flat_prompts.append(ids)
            flat_params.append(
                SamplingParams(**{**params.__dict__, "seed": sample_seed(seed, step, rec.id, j)})
            )
            keys.append((g, rec, j))
    version = engine.weight_version
    completions = engine.generate(flat_prompts, flat_params)
    return [
        Sample(
            uid=f"{step}:{rec.id}:{j}",
            group=g,
            record_id=rec.id,
            prompt_ids=list(c.prompt_ids),
            output_ids=list(c.output_ids),
            logprobs=list(c.output_logprobs),
            finish_reason=c.finish_reason,
            text=c.text or "",
            answer=rec.answer,
            weight_version=version,
        )
        for (g, rec, j), c in zip(keys, completions, strict=True)
    ]


def score_samples(
    samples: list[Sample], runner: RewardRunner, step: int | None = None
) -> RewardResult:
    """Score every sample in place; reward-function failures score 0 and are counted
    (``step``: calls of one step, e.g. dynamic sampling's rounds, count as one step towards
    ``reward.max_failed_steps``)."""
    result = runner.score([s.text for s in samples], [s.answer for s in samples], step=step)
    for s, r, ok in zip(samples, result.scores, result.correct, strict=True):
        s.reward, s.correct = float(r), bool(ok)
    return result


def split_informative_groups(
    samples: Sequence[Sample], n: int
) -> tuple[list[Sample], list[Sample]]:
    """DAPO's dynamic-sampling filter: (groups whose rewards differ, groups whose rewards
    are all equal). An all-equal group has zero advantage everywhere: it adds no policy
    gradient, only compute. Groups are contiguous runs of ``n``; order is kept."""
    kept: list[Sample] = []
    dropped: list[Sample] = []
    for i in range(0, len(samples), n):
        group = samples[i : i + n]
        (kept if len({s.reward for s in group}) > 1 else dropped).extend(group)
    return kept, dropped


def advantages_for(samples: Sequence[Sample], n: int, mode: str) -> torch.Tensor:
    """Group-relative advantages (GRPO or Dr.GRPO) for contiguous groups of ``n``."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return group_advantages(rewards, n, mode=mode)  # type: ignore[arg-type]


def to_train_batch(
    samples: Sequence[Sample], advantages: torch.Tensor, pad_token_id: int
) -> TrainBatch:
    """Samples and their advantages as a right-padded training batch."""
    return build_train_batch(
        [s.prompt_ids for s in samples],
        [s.output_ids for s in samples],
        [s.logprobs for s in samples],
        advantages,
        pad_token_id,
    )


def summarize_samples(samples: Sequence[Sample], n: int) -> dict[str, float]:
    """Reward, accuracy, length and group-variance statistics of one step's samples."""
    rewards = [s.reward for s in samples]
    lengths = [len(s.output_ids) for s in samples]
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "accuracy": statistics.fmean(float(s.correct) for s in samples),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_max": float(max(lengths)),
        "truncation_rate": statistics.fmean(float(s.truncated) for s in samples),
        "zero_std_group_frac": statistics.fmean(float(len(set(g)) == 1) for g in groups),
        "response_tokens": float(sum(lengths)),
    }
