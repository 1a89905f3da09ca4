"""Reward functions for GRPO rollouts: answer checking and bounded execution.

``math`` (GSM8K-style answer extraction and comparison), ``builtins`` (exact/normalised match,
multiple choice, regex, code against unit tests in ``sandbox``), ``runner`` (builtin or user
reward functions in either form, isolated and bounded, with a fault budget), ``terms``
(several functions, weighted, each logged) and ``judge`` (LLM judges on engines of
their own, same contract): docs/agents.md, 'Reward functions', and docs/judges.md. Never imports
prefect or mlflow, or torch at import time (reward workers import this package on every start);
never lets one bad sample raise out of `RewardRunner.score` or `JudgeRunner.score`.
"""

from rl_core.rewards.judge import (
    JudgeError,
    Judgement,
    JudgeRunner,
    active_judge,
    parse_judgement,
)
from rl_core.rewards.math import (
    answers_equal,
    extract_answer,
    format_reward,
    gsm8k_reward,
    parse_number,
)
from rl_core.rewards.runner import (
    BUILTIN_REWARDS,
    RewardFn,
    RewardFunctionError,
    RewardResult,
    RewardRunner,
    load_reward_fn,
    reward_form,
)
from rl_core.rewards.terms import RewardSet, RewardTerm, answer_check, answer_kind

# What scores a rollout's samples (``score(completions, answers, ...) -> RewardResult``).
Scorer = RewardSet | RewardRunner | JudgeRunner

__all__ = ["BUILTIN_REWARDS", "JudgeError", "JudgeRunner", "Judgement", "RewardFn",
           "RewardFunctionError", "RewardResult", "RewardRunner", "RewardSet", "RewardTerm", "Scorer",
           "active_judge", "answer_check", "answer_kind", "answers_equal", "extract_answer", "format_reward",
           "gsm8k_reward", "load_reward_fn", "parse_judgement", "parse_number", "reward_form"]
