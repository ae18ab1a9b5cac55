"""What a reinforcement-learning trainer takes from jaxpaged besides rollouts: the policy forward that
is the engine's own arithmetic (`token_logprobs`), and the trainer's side of the weight sync
(`TrainerWeightTransfer`, `HTTPWeightSyncClient`: entrypoints/weight_transfer.py)."""

from jaxpaged.entrypoints.weight_transfer import HTTPWeightSyncClient, TrainerWeightTransfer, leaves_by_path
from jaxpaged.rl.policy import token_logprobs

__all__ = ["HTTPWeightSyncClient", "TrainerWeightTransfer", "leaves_by_path", "token_logprobs"]
