"""Moved to jaxpaged.sample.logprobs and jaxpaged.sample.sampler; this re-export is kept for one release."""

from jaxpaged.sample.logprobs import (
    NUM_TOP_LOGPROBS,
    split_prompt_logprobs,
    token_logprobs,
    with_every_token,
)
from jaxpaged.sample.sampler import (
    LOGPROBS_MODES,
    sample_ext,
)

__all__ = [
    "LOGPROBS_MODES",
    "NUM_TOP_LOGPROBS",
    "sample_ext",
    "split_prompt_logprobs",
    "token_logprobs",
    "with_every_token",
]
