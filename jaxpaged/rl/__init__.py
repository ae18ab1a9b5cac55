"""What a reinforcement-learning trainer takes from jaxpaged besides rollouts: the policy forward that
is the engine's own arithmetic (`token_logprobs`)."""

from jaxpaged.rl.policy import token_logprobs

__all__ = ["token_logprobs"]
