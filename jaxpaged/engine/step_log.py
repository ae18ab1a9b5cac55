"""The engine's debug log of each step (`--verbose`, or the "jaxpaged" logger at DEBUG)."""

from __future__ import annotations

import logging


def log_step(logger: logging.Logger, step_idx: int, out, page_stats: dict) -> None:
    """--verbose: one step's scheduling decisions (sequences, tokens, preemptions, copies, pages)."""
    decodes = sum(1 for n in out.num_new_tokens if n == 1)
    logger.debug(
        "step %d: %d seqs (%d decode, %d prefill chunks), %d tokens; (seq_id, new_tokens, pages)=%s%s",
        step_idx, len(out.seqs), decodes, len(out.seqs) - decodes, out.num_batched_tokens,
        [(s.seq_id, n, len(s.block_table)) for s, n in zip(out.seqs, out.num_new_tokens)][:16],
        " ..." if len(out.seqs) > 16 else "",
    )
    for seq in out.preempted:
        logger.debug("  preempted seq %d (%d tokens will be recomputed)", seq.seq_id, len(seq.token_ids))
    if out.copies:
        logger.debug("  copy-on-write page copies (src, dst): %s", out.copies)
    st = page_stats
    logger.debug(
        "  pages: %d/%d used (%.0f%%), %d free, %d cached; prefix hits %d/%d tokens",
        st["num_used_pages"], st["num_pages"], 100 * st["usage"], st["num_free_pages"], st["num_cached_pages"],
        st["prefix_hit_tokens"], st["prefix_query_tokens"],
    )
