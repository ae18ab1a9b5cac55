"""Moved to jaxpaged.sample.sampler; this re-export is kept for one release."""

from jaxpaged.sample.sampler import (
    GREEDY_TEMPERATURE,
    MIN_BANNED_WIDTH,
    NUM_CANDIDATES,
    PRNG_IMPL,
    HostOrDevice,
    RowSpec,
    SamplingArrays,
    apply_token_bitmask,
    beam_candidates,
    make_sampling_arrays,
    sample,
    sampling_logits,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "HostOrDevice",
    "MIN_BANNED_WIDTH",
    "NUM_CANDIDATES",
    "PRNG_IMPL",
    "RowSpec",
    "SamplingArrays",
    "apply_token_bitmask",
    "beam_candidates",
    "make_sampling_arrays",
    "sample",
    "sampling_logits",
]
