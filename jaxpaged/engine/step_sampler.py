"""Moved to jaxpaged.sample.step_sampler; this re-export is kept for one release."""

from jaxpaged.sample.step_sampler import SampledStep, StepSampler

__all__ = ["SampledStep", "StepSampler"]
