"""Pure RL math for grpoflow: advantages and policy losses on torch tensors.

Nothing in this package may import prefect or mlflow, touch models, or do I/O; the
trainer computes log-probs and calls these functions.
"""

from rl_core.algorithms.advantages import (
    ADVANTAGE_MODES,
    group_advantages,
    group_reward_stats,
)
from rl_core.algorithms.losses import (
    KL_KINDS,
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_grpo_loss,
    entropy_from_logits,
    gspo_ratio,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
    tis_weights,
)

__all__ = [
    "ADVANTAGE_MODES",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "compute_grpo_loss",
    "entropy_from_logits",
    "group_advantages",
    "group_reward_stats",
    "gspo_ratio",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "tis_weights",
]
