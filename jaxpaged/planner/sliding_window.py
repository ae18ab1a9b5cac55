"""Sliding-window page freeing (vLLM's sliding-window memory saving) for models whose EVERY layer is local.

A token at position p attends keys p - W + 1 .. p (W = sliding_window). Positions only grow, so
once a sequence has computed `c` tokens, keys before `c - W + 1` are never read again by any
layer, and a page all of whose slots lie before that is freed:

    W 8, page_size 4, c = 17 (next token at position 17 sees 10..17)
    logical page   0        1        2         3          4
    slots          0..3     4..7     8..11     12..15     16..19
                   freed    freed    kept (10, 11 visible)
    block_table    [0,      0,       9,        4,         7]    freed entries become page 0

Pages held per sequence stay <= ceil((W + 1) / page_size) + 1 <= W / page_size + 2 on decode.

Only when all layers are local: a model with any global layer (Gemma 2/3) reads every page at its
global layers, so nothing can be freed (`ModelConfig.all_layers_local` decides, in the engine).

Invariants on top of `BlockManager`'s:
- A block-table entry 0 (the padding page) stands for a freed page; page 0 is never counted or
  released. The table keeps its length, so logical page i is still entry i.
- The device's copy of a block table may still name a freed page (which may now belong to
  another sequence) for positions before the window: every attention backend masks those keys
  (`sliding_window` argument), so they are never read.
- Prefix caching: a freed page keeps its registration (it holds real K/V of a full page) and stays
  findable until evicted; a later request hitting it gets it back whole. A sequence admitted from
  cache or re-admitted after preemption is given pages for its whole prompt again (its prefill
  needs them as queries' context), and frees them as soon as its window moves past them.
"""

from __future__ import annotations

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.sequence import Sequence

PADDING_PAGE = 0


class SlidingWindowBlockManager(BlockManager):
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, *, sliding_window: int,
                 **kwargs) -> None:
        super().__init__(num_pages, page_size, enable_prefix_caching, **kwargs)
        if sliding_window < 1:
            raise ValueError(f"{sliding_window=} must be >= 1")
        self.sliding_window = sliding_window
        self.num_window_frees = 0  # pages given back because the window moved past them

    def release_out_of_window(self, seq: Sequence) -> int:
        """Free `seq`'s pages wholly before its window; returns how many were freed."""
        oldest_visible = seq.num_computed_tokens - self.sliding_window + 1
        block_table = seq.block_table
        num_freed = 0
        for page_idx in range(min(oldest_visible // self.page_size, len(block_table))):
            page_id = block_table[page_idx]
            if page_id != PADDING_PAGE:
                block_table[page_idx] = PADDING_PAGE
                self.release_page(page_id)
                num_freed += 1
        self.num_window_frees += num_freed
        return num_freed

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        self.release_out_of_window(seq)  # before taking new pages: the freed ones can serve
        return super().append_slot(seq)

    def release_page(self, page_id: int) -> None:
        if page_id != PADDING_PAGE:
            super().release_page(page_id)

    def fork(self, parent: Sequence, child_seq_id: int | None = None) -> Sequence:
        child = super().fork(parent, child_seq_id)
        self.ref_counts[PADDING_PAGE] = 0  # freed entries are shared by nobody
        return child
