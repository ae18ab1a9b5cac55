"""Swapping a sequence's pages out to host memory and back in: the block manager's swap half.

`SwapSpace` is a part of `BlockManager` (planner/block_manager.py), kept apart as one concept: it
reads and writes the block manager's pages, free list and prefix cache, and the host pool
`swap_pool` (planner/host_pool.py). Pure Python (no jax).

    swap out   the pages holding computed K/V -> fresh host pages (copies planned in `swap_out`);
               the device pages are released (registered ones stay cached on the device)
    swap in    per host page: a device page still caching the same full page (the same tokens
               after the same prefix, hash and key checked) is shared again, with no copy; any
               other page comes back in a fresh device page (a copy planned in `swap_in`)

So a page that other sequences still hold (a shared prompt prefix) comes back shared, not as a
private copy; an unregistered page (the partial last page, or anything with prefix caching off)
comes back private. Then every full, computed page of the sequence is registered in the prefix
cache, including pages filled by the step that was in flight when the sequence was swapped out
(that step's commit skipped the swapped sequence: its device pages were gone).
"""

from __future__ import annotations

from jaxpaged.planner.sequence import Sequence


class SwapSpace:
    def _num_swap_pages(self, seq: Sequence) -> int:
        return self._num_pages_for(seq.num_computed_tokens)  # pages holding computed K/V

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < self._num_swap_pages(seq) <= self.swap_pool.num_free_pages

    def swap_out_seq(self, seq: Sequence) -> None:
        """Copy the pages holding `seq`'s computed K/V to host pages, then free its device pages.

        The copies are planned in `swap_out`, issued before this step's writes; a step still in
        flight that writes these pages is ordered before them on the device (same buffer)."""
        host_block_table = [self.swap_pool.take() for _ in range(self._num_swap_pages(seq))]
        self.swap_out += zip(seq.block_table, host_block_table)
        self.num_swapped_out_pages += len(host_block_table)
        for page_id in reversed(seq.block_table):
            self._release(page_id)
        seq.block_table = []
        seq.host_block_table = host_block_table

    def can_swap_in(self, seq: Sequence) -> bool:
        # Conservative: a page shared again costs no free page when another sequence holds it.
        return self._num_pages_for(len(seq.token_ids)) <= len(self.free_page_ids)

    def _cached_device_page(self, seq: Sequence, page_idx: int) -> int | None:
        """The device page registered for `seq`'s full page `page_idx` (hash and key match), or None."""
        page_id = self.hash_to_page.get(seq.page_hashes[page_idx])
        if page_id is None or self.page_key[page_id] != self._page_key(seq, page_idx):
            return None
        return page_id

    def swap_in_seq(self, seq: Sequence) -> None:
        """Device pages for a swapped-out sequence (module doc): cached pages shared again, the rest
        fresh with their host pages copied back (`swap_in`) before this step reads them; more fresh
        pages cover its tokens not computed yet. Its tokens have all landed (no placeholder)."""
        if self._num_pages_for(len(seq.token_ids)) > len(self.free_page_ids):
            raise RuntimeError(f"no room to swap sequence {seq.seq_id} in; call can_swap_in() first")
        num_full = seq.num_computed_tokens // self.page_size if self.enable_prefix_caching else 0
        self._hash_full_pages(seq, num_full)
        shared = {}
        for page_idx in range(min(num_full, len(seq.host_block_table))):
            page_id = self._cached_device_page(seq, page_idx)
            if page_id is not None:  # claimed before any fresh page is taken, so none evicts it
                if self.ref_counts[page_id] == 0:
                    del self.free_page_ids[page_id]
                self.ref_counts[page_id] += 1
                shared[page_idx] = page_id
        block_table = []
        for page_idx, host_page_id in enumerate(seq.host_block_table):
            if page_idx in shared:
                self.swap_pool.release(host_page_id)  # nothing reads it: free at once
                block_table.append(shared[page_idx])
                continue
            page_id = self._take_fresh_page()
            self.swap_in.append((host_page_id, page_id))
            self.swap_pool.release_after_transfer(host_page_id)
            block_table.append(page_id)
        self.num_swapped_in_pages += len(block_table) - len(shared)
        self.num_swap_in_shared_pages += len(shared)
        while len(block_table) * self.page_size < len(seq.token_ids):
            block_table.append(self._take_fresh_page())
        seq.block_table = block_table
        seq.host_block_table = []
        self.cache_computed_pages(seq, 0)  # the fresh copies of full pages become findable

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (swap_out, swap_in) copies planned since the last call; host pages read by the last
        call's swap-ins are free again from now on."""
        self.swap_pool.end_transit()
        self.host_cache.end_transit()
        transfers = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        return transfers
