"""Reward functions for GRPO rollouts: answer checking and bounded execution.

What this package is for: everything the training step needs to turn completions into
scalar rewards — GSM8K-style answer extraction and numeric comparison (`rl_core.rewards.math`)
and running builtin or user-supplied reward functions with per-sample timeouts, process
isolation, a memory limit and a budget of failed steps (`rl_core.rewards.runner`), and LLM
judges / reward models served by engines of their own (`rl_core.rewards.judge`, ``reward.fn:
judge``), which keep the same contract.

What it must never do: import prefect or mlflow, or torch at import time (rl_core stays
orchestration-free, and reward worker processes import this package on every start; a judge
loads the engine code when it starts), or let one bad sample raise out of `RewardRunner.score`
or `JudgeRunner.score`.
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
)

__all__ = ["BUILTIN_REWARDS", "JudgeError", "JudgeRunner", "Judgement", "RewardFn",
           "RewardFunctionError", "RewardResult", "RewardRunner", "active_judge", "answers_equal",
           "extract_answer", "format_reward", "gsm8k_reward", "load_reward_fn", "parse_judgement",
           "parse_number"]
