"""The page allocator: ref-counted pages, a prefix cache over full pages, fork and copy-on-write,
swapping a sequence's pages to host memory and back.

Glossary (the same names everywhere in jaxpaged; see DESIGN.md):

- page: the physical unit of KV storage, `page_size` token slots. Page 0 is the padding page: never
  handed out; padding rows of block tables point at it.
- block table: one sequence's list of physical page ids, logical page i -> block_table[i]. Append-only
  while the sequence runs (copy-on-write replaces the last entry in place).
- slot: one token position in the page pool, slot = page_id * page_size + offset.
- Counts start with `num_`, ids end in `_id`, indices in `_idx`, Pallas refs in `_ref`.

Invariants (checked after every random operation by tests/test_host_stateful.py):

- Every page except page 0 is either free (ref count 0, in `free_page_ids`) or used (ref count > 0),
  never both; a page's ref count equals the number of block-table entries that name it.
- A page is registered in the prefix cache (`page_hash[page_id] is not None`) only if it is full and
  its K/V has been computed; registered pages are never written again, so sharing them is safe.
  `hash_to_page[h] == page_id` exactly when `page_hash[page_id] == h`.
- A free page may still be registered: it stays findable until it is handed out as a fresh page.
- The free list is ordered by eviction priority: pages that cache nothing at the front, then
  registered pages from least to most recently freed. Fresh pages come from the front.

Pure Python (no jax): every operation is O(pages touched), never O(num_pages); a page's tokens are
hashed once, when it fills (or at admission, for a prompt's full pages).
"""

from __future__ import annotations

import collections

from jaxpaged.planner.host_pool import HostPagePool
from jaxpaged.planner.prefix_cache import PageKey, hash_page, page_key
from jaxpaged.planner.sequence import Sequence


class BlockManager:
    """Device pages for sequences (allocate, append, fork, free), the prefix cache over them, and
    swapping a sequence's pages to host memory and back. Owns the two host pools (`swap_pool`,
    `host_cache`: planner/host_pool.py) and the transfers planned between them and the device."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, *,
                 num_swap_pages: int = 0, num_host_cache_pages: int = 0) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} leaves no usable page (page 0 is padding); use num_pages >= 2")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching

        self.ref_counts = [0] * num_pages  # page 0 stays at 0 and is never in the free list
        # An OrderedDict used as a deque with O(1) removal from the middle (a cache hit on a free page).
        self.free_page_ids: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(1, num_pages)
        )
        self.page_hash: list[bytes | None] = [None] * num_pages  # blake2b digest of a registered page
        self.page_key: list[PageKey | None] = [None] * num_pages  # what the digest covers, to confirm hits
        self.hash_to_page: dict[bytes, int] = {}

        self.num_prefix_query_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of those, tokens whose K/V were found
        self.num_evictions = 0  # registered pages dropped from the cache to be reused
        self.num_cow_copies = 0  # copy-on-write page copies requested from the device
        self.num_page_allocations = 0  # fresh pages handed out (a counter: its rate is the allocation rate)

        # Host memory (jaxpaged/planner/host_pool.py): swap space for preempted sequences' pages, and a tier
        # below the device prefix cache. Host ids: swap pages first, then cache pages.
        self.swap_pool = HostPagePool(num_swap_pages, first_id=0)
        self.host_cache = HostPagePool(num_host_cache_pages if enable_prefix_caching else 0, first_id=num_swap_pages)
        # Transfers planned since the scheduler last took them (Scheduler.schedule -> SchedulerOutput):
        # (device page, host page) copies to host, issued before this step's writes, and
        # (host page, device page) copies to the device, issued before this step reads them.
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.num_prefix_hit_tokens_host = 0  # of num_prefix_hit_tokens, tokens found in the host tier
        self.num_host_cache_stores = 0  # device evictions kept in the host tier
        self.num_swapped_out_pages = 0
        self.num_swapped_in_pages = 0  # copied back from host
        self.num_swap_in_shared_pages = 0  # swapped-in pages found still cached on the device: shared, not copied

    # ------------------------------------------------------------------ hashing (prefix_cache.py)

    hash_page = staticmethod(hash_page)  # an attribute, so a test can make every page collide

    def _page_key(self, seq: Sequence, page_idx: int) -> PageKey:
        return page_key(seq, page_idx, self.page_size)

    def _hash_full_pages(self, seq: Sequence, num_full_pages: int) -> None:
        """Extend `seq.page_hashes` to its first `num_full_pages` pages (tokens never change: hash once)."""
        for page_idx in range(len(seq.page_hashes), num_full_pages):
            seq.page_hashes.append(self.hash_page(*self._page_key(seq, page_idx)))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Page ids holding the longest cached prefix of `seq.token_ids`, leaving >= 1 token to compute.

        A page found only in the host tier is given as `-1 - host_page_id` (negative): it costs a
        fresh device page and a swap-in, like a miss in pages but not in compute.

        Only pages that lie wholly within the first len-1 tokens may hit, so the last token is always
        computed (it yields the logits to sample from) and no hit page is ever written:

            tokens:  [ a b c d | e f g h | i ]   len 9, page_size 4: pages 0 and 1 may hit
            tokens:  [ a b c d | e f g h ]       len 8: only page 0 may hit; page 1 is recomputed
        """
        # A request asking for prompt logprobs needs the logits of every prompt token, which cached
        # pages do not hold: it computes its whole prompt (as vLLM does); its pages are still cached.
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        max_hit_pages = (len(seq.token_ids) - 1) // self.page_size
        self._hash_full_pages(seq, max_hit_pages)
        hit_page_ids = []
        for page_idx in range(max_hit_pages):
            page_hash = seq.page_hashes[page_idx]
            page_id = self.hash_to_page.get(page_hash)
            # Never trust the hash alone: the stored key (parent hash, salt, tokens) must match exactly.
            if page_id is None or self.page_key[page_id] != self._page_key(seq, page_idx):
                host_page_id = self.host_cache.lookup(page_hash, self._page_key(seq, page_idx))
                if host_page_id is None:
                    break
                page_id = -1 - host_page_id
            hit_page_ids.append(page_id)
        return hit_page_ids

    # ------------------------------------------------------------------ taking and giving back pages

    def _take_fresh_page(self) -> int:
        """Hand out the page at the front of the free list, evicting what it caches."""
        page_id, _ = self.free_page_ids.popitem(last=False)
        page_hash = self.page_hash[page_id]
        if page_hash is not None:
            del self.hash_to_page[page_hash]
            host_page_id = self.host_cache.store(page_hash, self.page_key[page_id]) if self.host_cache.num_pages else None
            if host_page_id is not None:  # kept one tier down: copied to host before this step writes here
                self.swap_out.append((page_id, host_page_id))
                self.num_host_cache_stores += 1
            self.page_hash[page_id] = None
            self.page_key[page_id] = None
            self.num_evictions += 1
        self.ref_counts[page_id] = 1
        self.num_page_allocations += 1
        return page_id

    def release_page(self, page_id: int) -> None:
        """Drop one block-table reference to `page_id`; at 0 the page is free (a registered page stays
        findable until handed out again). The caller takes the entry out of its block table."""
        refs = self.ref_counts[page_id] - 1
        self.ref_counts[page_id] = refs
        if refs == 0:
            self.free_page_ids[page_id] = None  # enters at the back: most recently freed, evicted last
            if self.page_hash[page_id] is None:
                # Caches nothing: move it to the front, to be reused before any cached page.
                self.free_page_ids.move_to_end(page_id, last=False)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_page_ids)

    def _num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ admission

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would find enough pages (cache hits on used pages cost nothing)."""
        hit_page_ids = self._cached_prefix(seq)
        num_shared_hits = sum(1 for page_id in hit_page_ids if page_id >= 0 and self.ref_counts[page_id] > 0)
        return self._num_pages_for(len(seq.token_ids)) - num_shared_hits <= len(self.free_page_ids)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` pages for all its current tokens: cached prefix pages first, then fresh ones.

        Sets num_cached_tokens = num_computed_tokens = (cached pages) * page_size <= len(token_ids) - 1.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds pages {seq.block_table}; free it first")
        hit_page_ids = self._cached_prefix(seq)
        device_hit_ids = [page_id for page_id in hit_page_ids if page_id >= 0]
        # Claim the hits before taking fresh pages, so that taking a fresh page cannot evict a hit.
        for page_id in device_hit_ids:
            if self.ref_counts[page_id] == 0:
                del self.free_page_ids[page_id]
            self.ref_counts[page_id] += 1
        num_fresh = self._num_pages_for(len(seq.token_ids)) - len(device_hit_ids)
        if num_fresh > len(self.free_page_ids):
            for page_id in device_hit_ids:  # undo, leaving the free list as it was (up to order)
                self.release_page(page_id)
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {num_fresh} fresh pages but {len(self.free_page_ids)} are free; "
                "call can_allocate() first"
            )
        host_hit_ids = [-1 - page_id for page_id in hit_page_ids if page_id < 0]
        for host_page_id in host_hit_ids:  # out of the host index first: a store below cannot evict it
            self.host_cache.claim_hit(host_page_id)
        block_table = []
        for page_idx, page_id in enumerate(hit_page_ids):
            if page_id < 0:  # a host hit: back to a fresh device page, registered there again
                host_page_id, page_id = -1 - page_id, self._take_fresh_page()
                page_hash = seq.page_hashes[page_idx]
                self.hash_to_page[page_hash] = page_id
                self.page_hash[page_id] = page_hash
                self.page_key[page_id] = self._page_key(seq, page_idx)
                self.swap_in.append((host_page_id, page_id))
            block_table.append(page_id)
        num_fresh = self._num_pages_for(len(seq.token_ids)) - len(hit_page_ids)
        seq.block_table = block_table + [self._take_fresh_page() for _ in range(num_fresh)]
        seq.num_cached_tokens = len(hit_page_ids) * self.page_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_prefix_query_tokens += len(seq.token_ids)
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        self.num_prefix_hit_tokens_host += len(host_hit_ids) * self.page_size

    # ------------------------------------------------------------------ growing by one token

    # Where the next token's K/V goes, page_size 4, seq with 6 tokens of which 5 are computed:
    #
    #   logical page   0             1
    #   block_table    [ 7         | 3       ]
    #   offset          0  1  2  3   0  1  2  3
    #   token idx       0  1  2  3   4  5  .  .      write_page_idx = num_computed_tokens // page_size = 1
    #                   computed ----->  ^ written this step: slot 3 * 4 + 5 % 4 = 13
    #
    # A new page is needed when the table is too short for len(token_ids) tokens; a copy is needed
    # when the page being written is shared (ref count > 1, after a fork).

    def _num_pages_to_append(self, seq: Sequence) -> int:
        block_table = seq.block_table
        num_needed = self._num_pages_for(len(seq.token_ids)) - len(block_table)
        write_page_idx = seq.num_computed_tokens // self.page_size
        if write_page_idx < len(block_table) and self.ref_counts[block_table[write_page_idx]] > 1:
            num_needed += 1
        return num_needed

    def can_append(self, seq: Sequence) -> bool:
        """Whether `append_slot(seq)` would find enough free pages."""
        return self._num_pages_to_append(seq) <= len(self.free_page_ids)

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the pages writable for tokens [num_computed_tokens, len(token_ids)) of `seq`.

        Returns a copy-on-write (src_page_id, dst_page_id) the device must perform before writing,
        or None. Call only when can_append(seq).
        """
        if self._num_pages_to_append(seq) > len(self.free_page_ids):
            raise RuntimeError(f"no free page for sequence {seq.seq_id}; call can_append() first")
        block_table = seq.block_table
        copy = None
        write_page_idx = seq.num_computed_tokens // self.page_size
        if write_page_idx < len(block_table):
            shared_page_id = block_table[write_page_idx]
            if self.ref_counts[shared_page_id] > 1:
                # Only a partial page can be written, and partial pages are never registered.
                assert self.page_hash[shared_page_id] is None, "a registered (full) page is about to be written"
                private_page_id = self._take_fresh_page()
                self.ref_counts[shared_page_id] -= 1  # still >= 1: the other sharers keep it
                block_table[write_page_idx] = private_page_id
                copy = (shared_page_id, private_page_id)
                self.num_cow_copies += 1
        while len(block_table) * self.page_size < len(seq.token_ids):
            block_table.append(self._take_fresh_page())
        return copy

    # ------------------------------------------------------------------ after a step, finish, fork

    def cache_computed_pages(self, seq: Sequence, num_computed_before: int) -> None:
        """Register the pages that became full and computed when num_computed_tokens passed page ends."""
        if not self.enable_prefix_caching:
            return
        first_page_idx = num_computed_before // self.page_size
        end_page_idx = seq.num_computed_tokens // self.page_size
        if first_page_idx == end_page_idx:
            return
        self._register_pages(seq, first_page_idx, end_page_idx)

    def cache_scheduled_prompt_pages(self, seq: Sequence, num_new_tokens: int) -> None:
        """Register, at schedule time, the prompt pages this step fills, so that sequences admitted
        later in the same schedule() (or in the next one, before this step's tokens land) hit them.

        Sound because every layer of a step writes all its tokens' K/V before any attention reads
        (DESIGN.md): a sequence reading these pages in the same step sees them written. The step is
        always executed once scheduled, and a scheduled sequence is never preempted in the schedule()
        that scheduled it, so a registered page always gets its K/V. Only prompt tokens qualify:
        they are known (no placeholder) and final (no speculative draft token).
        """
        if not self.enable_prefix_caching:
            return
        num_computed = seq.num_computed_tokens
        first_page_idx = num_computed // self.page_size
        end_page_idx = min(num_computed + num_new_tokens, len(seq.prompt_token_ids)) // self.page_size
        if first_page_idx < end_page_idx:
            self._register_pages(seq, first_page_idx, end_page_idx)

    def _register_pages(self, seq: Sequence, first_page_idx: int, end_page_idx: int) -> None:
        hashes = seq.page_hashes
        if len(hashes) < first_page_idx:
            self._hash_full_pages(seq, first_page_idx)  # earlier pages: normally hashed already
        # Runs on every decode step that fills a page (1 in page_size steps per sequence): _page_key and
        # _hash_full_pages inlined, each page's key built once for both its hash and its stored copy.
        ps = self.page_size
        token_ids = seq.token_ids
        for page_idx in range(first_page_idx, end_page_idx):
            parent_hash = hashes[page_idx - 1] if page_idx else None
            key = (parent_hash, seq.cache_salt, tuple(token_ids[page_idx * ps : (page_idx + 1) * ps]))
            if page_idx == len(hashes):
                hashes.append(self.hash_page(*key))
            page_hash = hashes[page_idx]
            page_id = seq.block_table[page_idx]
            if self.page_hash[page_id] is not None or page_hash in self.hash_to_page:
                continue  # already cached: this page was a hit, or another page holds the same tokens
            self.hash_to_page[page_hash] = page_id
            self.page_hash[page_id] = page_hash
            self.page_key[page_id] = key

    def free(self, seq: Sequence) -> None:
        """Give back all of `seq`'s pages, device and host (finished, aborted or preempted). Its page
        hashes stay valid."""
        # Last page first: a prefix's tail pages are evicted before its head pages, which more
        # requests share (a tail page is useless without the pages before it).
        for page_id in reversed(seq.block_table):
            self.release_page(page_id)
        seq.block_table = []
        for host_page_id in seq.host_block_table:
            self.swap_pool.release(host_page_id)
        seq.host_block_table = []

    def check_admissible(self, seq: Sequence) -> None:
        """ValueError if `seq` could never be allocated for a reason beyond its pages (a hybrid model's
        state slots: planner/state_pool.py); nothing here."""

    def take_state_copies(self) -> list[tuple[int, int]]:
        """State-slot copies planned since the last call (hybrid models only: planner/state_pool.py)."""
        return []

    def take_state_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(state swap-outs, state swap-ins) planned since the last call (hybrid models only: planner/state_pool.py)."""
        return [], []

    def open_fork_group(self, seq: Sequence, width: int) -> None:
        """`seq` starts a beam search of `width` beams (a hybrid model reserves their state slots); nothing here."""

    def close_fork_group(self, seq: Sequence) -> None:
        """The beam search of `seq` ended (hybrid models: its state slots go back); nothing here."""
    # Hybrid models with prefix caching (planner/state_pool.py) end prompt chunks on page boundaries and
    # save the state there; nothing here.
    aligns_chunks = False

    def aligned_chunk(self, seq: Sequence, num_new: int) -> int:
        return num_new

    def snapshot_state(self, seq: Sequence) -> None:
        """Called at dispatch when a step filled a page of `seq` (only when `aligns_chunks`)."""

    def fork(self, parent: Sequence, child_seq_id: int | None = None) -> Sequence:
        """A child sequence sharing all of `parent`'s pages (ref counts go up; copies happen on write)."""
        if not parent.block_table:
            raise ValueError(f"sequence {parent.seq_id} holds no pages; fork a running sequence")
        if parent.num_computed_tokens < len(parent.token_ids) - 1:
            raise ValueError(
                f"sequence {parent.seq_id} has computed {parent.num_computed_tokens} of {len(parent.token_ids)} "
                "tokens; fork only once its prompt is computed (at the step its first token is sampled)"
            )
        child = parent.copy_for_fork(child_seq_id)
        child.block_table = list(parent.block_table)
        for page_id in child.block_table:
            self.ref_counts[page_id] += 1
        return child

    # ------------------------------------------------------------------ swapping to host and back

    # Swap preemption moves a sequence's computed K/V to host pages (`swap_pool`) and back:
    #
    #   swap out   the pages holding computed K/V -> fresh host pages (copies planned in `swap_out`);
    #              the device pages are released (registered ones stay cached on the device)
    #   swap in    per host page: a device page still caching the same full page (the same tokens
    #              after the same prefix, hash and key checked) is shared again, with no copy; any
    #              other page comes back in a fresh device page (a copy planned in `swap_in`)
    #
    # So a page that other sequences still hold (a shared prompt prefix) comes back shared, not as a
    # private copy; an unregistered page (the partial last page, or anything with prefix caching off)
    # comes back private. Then every full, computed page of the sequence is registered in the prefix
    # cache, including pages filled by the step that was in flight when the sequence was swapped out
    # (that step's commit skipped the swapped sequence: its device pages were gone).

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
            self.release_page(page_id)
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
        """Device pages for a swapped-out sequence (the picture above): cached pages shared again, the
        rest fresh with their host pages copied back (`swap_in`) before this step reads them; more fresh
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

    # ------------------------------------------------------------------ new weights, metrics

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (after the model weights change). Returns how many were dropped."""
        num_dropped = len(self.hash_to_page)
        for page_id in self.hash_to_page.values():
            self.page_hash[page_id] = None
            self.page_key[page_id] = None
        self.hash_to_page.clear()
        # The host tier too: its K/V were computed under the old weights.
        return num_dropped + self.host_cache.forget_all()

    def stats(self) -> dict[str, int | float]:
        num_usable = self.num_pages - 1
        num_free = len(self.free_page_ids)
        return {
            "num_pages": num_usable,  # usable pages (page 0 excluded)
            "num_free_pages": num_free,
            "num_used_pages": num_usable - num_free,
            "usage": (num_usable - num_free) / num_usable,
            "num_cached_pages": len(self.hash_to_page),  # registered, used or free
            "prefix_query_tokens": self.num_prefix_query_tokens,
            "prefix_hit_tokens": self.num_prefix_hit_tokens,  # both tiers
            "prefix_hit_tokens_device": self.num_prefix_hit_tokens - self.num_prefix_hit_tokens_host,
            "prefix_hit_tokens_host": self.num_prefix_hit_tokens_host,
            "num_host_cache_pages": len(self.host_cache.hash_to_page),
            "num_host_cache_stores": self.num_host_cache_stores,
            "num_swap_pages_free": self.swap_pool.num_free_pages,
            "num_swapped_out_pages": self.num_swapped_out_pages,
            "num_swapped_in_pages": self.num_swapped_in_pages,
            "num_swap_in_shared_pages": self.num_swap_in_shared_pages,
            "prefix_hit_rate": self.num_prefix_hit_tokens / max(1, self.num_prefix_query_tokens),
            "num_evictions": self.num_evictions,
            "num_cow_copies": self.num_cow_copies,
            "num_page_allocations": self.num_page_allocations,
        }

    def ref_count_histogram(self) -> dict[int, int]:
        """{ref count: number of pages in use with it}. O(num_pages): for metrics, not the step loop."""
        return dict(collections.Counter(r for r in self.ref_counts if r > 0))
