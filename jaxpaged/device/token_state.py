"""Moved to jaxpaged.sample.penalties; this re-export is kept for one release."""

from jaxpaged.sample.penalties import (
    HostOrDevice,
    PenaltyArrays,
    TokenState,
    add_tokens,
    apply_penalties,
    host_slot_rows,
    init_slot,
    make_penalty_arrays,
    zeros_token_state,
)

__all__ = [
    "HostOrDevice",
    "PenaltyArrays",
    "TokenState",
    "add_tokens",
    "apply_penalties",
    "host_slot_rows",
    "init_slot",
    "make_penalty_arrays",
    "zeros_token_state",
]
