"""Several reward functions, weighted: ``reward.fn`` (the task reward, whose score decides
``correct``) plus ``reward.format_weight``'s format bonus and each ``reward.extra`` entry.

`RewardSet` scores a batch with every function (each its own `RewardRunner`: isolated, bounded,
its own fault budget) and sums ``weight * score``; a sample whose task reward failed scores 0,
as with one function. Each function's scores come back by name in
``RewardResult.components`` and are logged as ``reward/<name>`` (docs/data-and-rewards.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rl_core.data.records import AnswerCheck, numeric_answer
from rl_core.rewards.results import RewardResult
from rl_core.rewards.runner import BUILTIN_REWARDS, RewardRunner

if TYPE_CHECKING:
    from rl_core.config import RewardConfig
    from rl_core.rewards.judge import JudgeRunner

__all__ = ["RewardSet", "RewardTerm", "answer_check", "answer_kind", "term_name"]

def answer_kind(reward: RewardConfig) -> str:
    """``number`` when ``reward.fn`` needs a numeric answer (``gsm8k``), else ``any`` (every
    other reward takes any non-null answer): what data preparation refuses a row for
    (``tasks.setup.prepare_data``, :func:`answer_check`)."""
    return "number" if reward.fn.strip() == "gsm8k" else "any"


def answer_check(kind: str) -> AnswerCheck | None:
    """The row check of an :func:`answer_kind` (None: any non-null answer)."""
    return numeric_answer if kind == "number" else None


def term_name(fn: str, name: str | None = None) -> str:
    """A function's metric name: ``name``, else the builtin's name or the function's."""
    return name or fn.strip().rpartition(":")[2].rpartition(".")[2]


@dataclass
class RewardTerm:
    name: str
    weight: float
    runner: RewardRunner | JudgeRunner


class RewardSet:
    """The run's reward: ``terms[0]`` is the task reward (``correct`` is its score against
    ``pass_threshold``), the rest add ``weight * score``. `score` has `RewardRunner.score`'s
    contract; a term's spent fault budget raises its `RewardFunctionError`."""

    def __init__(self, terms: Sequence[RewardTerm]) -> None:
        if not terms:
            raise ValueError("a RewardSet needs at least one reward function")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions need distinct names, got {names}; give each "
                             "reward.extra entry a name")
        self.terms = list(terms)
        self.pass_threshold = terms[0].runner.pass_threshold

    @classmethod
    def from_config(cls, reward: RewardConfig, judge: JudgeRunner | None = None) -> RewardSet:
        """``reward.fn`` (with ``reward.args``), the format bonus when ``format_weight`` is
        set, and each ``reward.extra`` entry; every knob from the section. With ``reward.fn:
        judge`` the caller starts the judge and passes it: it is the task reward and adds the
        format bonus itself."""
        def runner(fn: str, args: Mapping[str, Any], threshold: float) -> RewardRunner:
            builtin = fn.strip() in BUILTIN_REWARDS
            return RewardRunner(fn, timeout_s=reward.timeout_s, args=args,
                                memory_limit_mb=None if builtin else reward.memory_limit_mb,
                                max_failed_steps=reward.max_failed_steps,
                                pass_threshold=threshold)

        specs = [] if judge else [(term_name(reward.fn), 1.0, reward.fn, reward.args,
                                   reward.pass_threshold)]
        if reward.format_weight and not judge:
            specs.append(("format", reward.format_weight, "format", {}, 1.0))
        specs += [(term_name(e.fn, e.name), e.weight, e.fn, e.args, 1.0) for e in reward.extra]
        terms: list[RewardTerm] = [RewardTerm("judge", 1.0, judge)] if judge else []
        try:
            for name, weight, fn, args, threshold in specs:
                terms.append(RewardTerm(name, weight, runner(fn, args, threshold)))
            return cls(terms)
        except BaseException:
            for t in terms:
                t.runner.close()
            raise

    def score(self, completions: Sequence[str], answers: Sequence[Any], *,
              step: int | None = None, budget: bool = True,
              record_ids: Sequence[str] | None = None, prompts: Sequence[Any] | None = None,
              columns: Sequence[Mapping[str, Any]] | None = None) -> RewardResult:
        """Every function's scores, weighted and summed (see the class)."""
        results = [t.runner.score(completions, answers, step=step, budget=budget,
                                  record_ids=record_ids, prompts=prompts, columns=columns)
                   for t in self.terms]
        first = results[0]
        if len(results) == 1:
            first.components = {self.terms[0].name: list(first.raw)}
            return first
        out = RewardResult(scores=[], correct=list(first.correct),
                           failed=[any(r.failed[i] for r in results if r.failed)
                                   for i in range(len(completions))])
        for i in range(len(completions)):
            if first.failed[i]:
                out.scores.append(0.0)  # the task reward failed: the sample scores 0
                continue
            total = first.scores[i]
            for term, result in zip(self.terms[1:], results[1:], strict=True):
                total += term.weight * result.scores[i]
            out.scores.append(total if math.isfinite(total) else 0.0)
        for r in results:
            out.num_errors += r.num_errors
            out.num_timeouts += r.num_timeouts
            out.errors += r.errors[: max(0, 5 - len(out.errors))]
            out.last_error = out.last_error or r.last_error
        out.failed_streak = max(r.failed_streak for r in results)
        out.raw = list(first.raw)
        out.components = {t.name: list(r.raw) for t, r in zip(self.terms, results, strict=True)}
        return out

    def close(self) -> None:
        for t in self.terms:
            t.runner.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

