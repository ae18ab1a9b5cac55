"""Prompt-lookup (n-gram) proposals: if the sequence's last n tokens occurred before, propose the
tokens that followed that earlier occurrence. Pure Python and numpy (no jax, no model).

    tokens:   [ ... a b c d e ... x a b c ]      suffix "a b c" (n = 3) matched earlier
                      ^^^^^ ^^^                  propose "d e ..." (up to k tokens)

The longest n in [prompt_lookup_min, prompt_lookup_max] with a match wins; among its matches the
most recent one that is followed by k known tokens (the closest context), else the earliest.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` proposed next tokens for `token_ids` (all known tokens), or [] when no n-gram matches."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, np.int64)
    for n in range(min(lookup_max, num_tokens - 1), lookup_min - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Windows that start before the suffix itself: positions 0 .. num_tokens - n - 1.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: num_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The most recent occurrence followed by k known tokens, else the earliest (the longest run).
            full = hits[hits + n + k <= num_tokens]
            start = int(full[-1] if full.size else hits[0]) + n
            return token_ids[start : start + k]
    return []
