"""Reward functions for GRPO rollouts: answer checking and bounded execution.

What this package is for: everything the training step needs to turn completions into
scalar rewards — GSM8K-style answer extraction and numeric comparison (`rl_core.rewards.math`)
and running builtin or user-supplied reward functions with per-sample timeouts, process
isolation, a memory limit and a budget of failed steps (`rl_core.rewards.runner`).

What it must never do: import prefect, mlflow or torch (rl_core stays orchestration-free, and
reward worker processes import this package on every start), or let one bad sample raise out
of `RewardRunner.score`.
"""

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
)

__all__ = ["BUILTIN_REWARDS", "RewardFn", "RewardFunctionError", "RewardResult", "RewardRunner",
           "answers_equal", "extract_answer", "format_reward", "gsm8k_reward", "load_reward_fn",
           "parse_number"]
