"""Weight sync between the training plane and the rollout plane.

Every sync is versioned (``weight_version`` = the training step) and verified: the engine
reports a checksum of the weights it now serves, and the sync fails loudly if it differs
from the trainer's. Silent non-sync is the most common weight-sync bug in RL frameworks.

Never imports Prefect or MLflow.
"""

from rl_core.weight_sync.checksum import WeightSyncError, weights_checksum

__all__ = ["WeightSyncError", "weights_checksum"]
