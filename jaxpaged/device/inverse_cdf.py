"""Moved to jaxpaged.sample.inverse_cdf; this re-export is kept for one release."""

from jaxpaged.sample.inverse_cdf import (
    BLOCK,
    blocked_draw,
    full_cdf_draw,
    successive_draws,
)

__all__ = ["BLOCK", "blocked_draw", "full_cdf_draw", "successive_draws"]
