"""Moved to jaxpaged.sample.rows; this re-export is kept for one release."""

from jaxpaged.sample.rows import (
    NUM_STRUCTURED_CANDIDATES,
    beam_candidate_width,
    fan_out_pairs,
    next_pow2,
    num_sample_rows,
    pad_logit_rows,
    resample_padded,
    row_spec,
    sample_first_padded,
    sample_padded,
    sampler_row_counts,
    warmup_sampler,
)

__all__ = [
    "NUM_STRUCTURED_CANDIDATES",
    "beam_candidate_width",
    "fan_out_pairs",
    "next_pow2",
    "num_sample_rows",
    "pad_logit_rows",
    "resample_padded",
    "row_spec",
    "sample_first_padded",
    "sample_padded",
    "sampler_row_counts",
    "warmup_sampler",
]
