"""Moved to jaxpaged.sample.logprobs and jaxpaged.sample.penalties; this re-export is kept for one release."""

from jaxpaged.sample.logprobs import HostLogprobs, PromptChunk, TokenDecoder, prompt_targets
from jaxpaged.sample.penalties import TokenSlots

__all__ = ["HostLogprobs", "PromptChunk", "TokenDecoder", "TokenSlots", "prompt_targets"]
