"""Moved to jaxpaged/planner/structured_params.py (a request parameter, beside SamplingParams); this
name stays for one release. Import `StructuredOutputsParams` from `jaxpaged` instead."""

from jaxpaged.planner.structured_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
