"""What scoring returns and what it may cost: `RewardResult` (scores, correctness, counted
failures), the fault budget (`FailedStepStreak`: ``reward.max_failed_steps`` steps in a row
that failed every sample raise `RewardFunctionError`), and `ScoreBook`, the part of a runner
that turns per-sample outcomes into both; shared by `RewardRunner` and the judge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.rewards.math import format_reward

__all__ = ["FailedStepStreak", "Outcome", "RewardFunctionError", "RewardResult", "ScoreBook",
           "short"]

# Outcome of one call: ("ok", score) | ("error", message) | ("timeout", message or None) |
# ("skip", None): a batched function's None, no score for this sample (it counts 0, no error).
Outcome = tuple[str, Any]
MAX_ERROR_MESSAGES, MAX_MESSAGE_CHARS = 5, 200


class RewardFunctionError(RuntimeError):
    """A reward function failed every sample of ``steps`` consecutive steps: the run must stop.
    ``spec`` names the function, ``last_error`` is the last failure it reported."""

    def __init__(self, spec: str, steps: int, last_error: str) -> None:
        self.spec, self.steps, self.last_error = spec, steps, last_error
        super().__init__(
            f"reward function {spec!r} failed every sample of {steps} consecutive steps "
            f"(reward.max_failed_steps={steps}); last error: {last_error}. Fix the function "
            f"(try it by hand: from rl_core.rewards import load_reward_fn; "
            f"load_reward_fn({spec!r})(completion, answer)), raise reward.timeout_s or "
            "reward.memory_limit_mb if it timed out or ran out of memory, or set "
            "reward.max_failed_steps=0 to score such steps 0 and carry on.")

    def __reduce__(self):  # picklable across process boundaries (Prefect results, Ray)
        return (type(self), (self.spec, self.steps, self.last_error))


def short(message: str) -> str:
    message, cap = " ".join(message.split()), MAX_MESSAGE_CHARS
    return message if len(message) <= cap else message[: cap - 3] + "..."


@dataclass
class RewardResult:
    """Per-batch outcome of `RewardRunner.score`, aligned with the inputs: ``scores`` (fn plus
    the format bonus; 0.0 on failure), ``correct`` (fn's score >= ``pass_threshold``), failure
    counts and messages, ``failed_streak`` (this call's step included; not updated by
    ``budget=False`` calls). docs/agents.md, 'Reward functions'."""
    scores: list[float]
    correct: list[bool]
    num_errors: int = 0
    num_timeouts: int = 0
    errors: list[str] = field(default_factory=list)
    failed_streak: int = 0
    last_error: str | None = None
    components: dict[str, list[float | None]] = field(default_factory=dict)
    raw: list[float | None] = field(default_factory=list)  # the function's own score per sample
    failed: list[bool] = field(default_factory=list)  # per sample: an error or a timeout

    @property
    def all_failed(self) -> bool:
        """The batch is not empty and the function scored no sample (errors and timeouts)."""
        return bool(self.scores) and self.num_errors + self.num_timeouts == len(self.scores)

    def component_means(self) -> dict[str, float]:
        """``reward/<name>``: each function's mean score over the samples it scored."""
        out = {}
        for name, values in self.components.items():
            scored = [v for v in values if v is not None]
            if scored:
                out[f"reward/{name}"] = sum(scored) / len(scored)
        return out


class FailedStepStreak:
    """Consecutive steps whose every sample failed: the fault budget of the reward function
    (``reward.max_failed_steps``) and of the judge. A step fails once it has samples and none
    was scored; a later call of the same step that scores one clears it; an empty call proves
    nothing."""

    def __init__(self) -> None:
        self._step: object = None
        self._seen = self._scored = False
        self._done = 0  # failed steps in a row before the current one

    def count(self, result: RewardResult, step: object) -> int:
        """Count ``result`` (a call of ``step``); the streak, this step included (also set as
        ``result.failed_streak``)."""
        if step != self._step:  # a new step begins
            self._done = self._done + 1 if self._seen and not self._scored else 0
            self._step, self._seen, self._scored = step, False, False
        if result.scores:
            self._seen = True
            if not result.all_failed:
                self._scored, self._done = True, 0
        result.failed_streak = self._done + (1 if self._seen and not self._scored else 0)
        return result.failed_streak


class ScoreBook:
    """What `RewardRunner` and the judge share: outcomes to a `RewardResult` (the score plus
    the format bonus, ``correct`` at ``pass_threshold``, failures 0 and counted) and the fault
    budget (``max_failed_steps`` steps in a row that failed every sample raise)."""

    format_weight: float
    pass_threshold: float
    max_failed_steps: int
    _stats: dict[str, int]
    _streak: FailedStepStreak
    _failed_streak: int
    _fatal: RewardFunctionError | None

    def _fatal_error(self, steps: int, last: str) -> RewardFunctionError:
        raise NotImplementedError

    def _timeout_note(self) -> str:
        return "timed out"

    def _format_score(self, completion: str) -> float:
        try:
            return format_reward(completion) if self.format_weight else 0.0
        except Exception:
            return 0.0

    def _assemble(self, completions: Sequence[str], outcomes: list[Outcome]) -> RewardResult:
        result = RewardResult(scores=[], correct=[])
        for i, (completion, (kind, value)) in enumerate(zip(completions, outcomes, strict=True)):
            result.correct.append(kind == "ok" and value >= self.pass_threshold)
            result.raw.append(value if kind == "ok" else None)
            result.failed.append(kind in ("error", "timeout"))
            if kind == "skip":
                kind, value = "ok", 0.0
            if kind == "ok":
                total = value + self.format_weight * self._format_score(completion)
                if math.isfinite(total):
                    result.scores.append(total)
                    continue
                kind, value = "error", f"score {value} + format bonus is not finite"
                result.failed[-1] = True
            result.scores.append(0.0)
            if kind == "timeout":
                result.num_timeouts += 1
            else:
                result.num_errors += 1
            result.last_error = short(f"sample {i}: {value or self._timeout_note()}")
            if len(result.errors) < MAX_ERROR_MESSAGES:
                result.errors.append(result.last_error)
        return result

    def _count_failed_call(self, result: RewardResult, step: object) -> None:
        """Count the call in the fault budget (`FailedStepStreak`); raise when it is spent."""
        if result.scores and result.all_failed:
            self._stats["all_failed_calls"] += 1
        self._failed_streak = self._streak.count(result, step)
        if self.max_failed_steps and self._failed_streak >= self.max_failed_steps:
            self._fatal = self._fatal_error(self._failed_streak, result.last_error or "no message")
            raise self._fatal
