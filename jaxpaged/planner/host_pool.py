"""Host-memory page pools: the accounting side of swap preemption and of the prefix cache's host tier.

Pure Python (no jax). A pool owns host page ids `[first_id, first_id + num_pages)`; the runner's
`HostKVStore` holds the bytes of every pool in one host array indexed by those ids, so the
block manager's two pools (swap space, prefix-cache tier) share one id space without overlap.

Each page is in exactly one of three states:

- used: ref count > 0 (a swapped-out sequence's `host_block_table` names it);
- free: ref count 0, in `free_page_ids`; it may still be registered (cache tier: a hash names it),
  ordered like the device free list: unregistered pages at the front, registered ones from least
  to most recently stored;
- in transit: ref count 0, read by a swap-in planned this step, in `transit_page_ids`. It goes back
  to the free list at the next `end_transit()`, when `BlockManager.take_transfers` hands the step's
  transfers to the engine (which issues the reads before it plans again), so that nothing planned
  later in the same step (a host-tier store) can write into the page before the read happens.
"""

from __future__ import annotations

import collections


class HostPagePool:
    def __init__(self, num_pages: int, first_id: int = 0) -> None:
        if num_pages < 0:
            raise ValueError(f"{num_pages=} must be >= 0")
        self.num_pages = num_pages
        self.first_id = first_id
        self.ref_counts = [0] * num_pages  # indexed by page_id - first_id
        self.free_page_ids: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(first_id, first_id + num_pages)
        )
        self.transit_page_ids: list[int] = []
        # Cache tier only: hash <-> page, and what the hash covers (to confirm hits, as on the device).
        self.hash_to_page: dict[bytes, int] = {}
        self.page_hash: dict[int, bytes] = {}
        self.page_key: dict[int, tuple] = {}
        self.num_evictions = 0  # registered host pages dropped to be reused

    @property
    def num_free_pages(self) -> int:
        return len(self.free_page_ids)

    def page_ids(self) -> range:
        return range(self.first_id, self.first_id + self.num_pages)

    # ------------------------------------------------------------------ used pages (swap space)

    def take(self) -> int:
        """A free page with ref count 1, from the front of the free list (evicting what it caches)."""
        page_id, _ = self.free_page_ids.popitem(last=False)
        self._forget(page_id)
        self.ref_counts[page_id - self.first_id] = 1
        return page_id

    def release_after_transfer(self, page_id: int) -> None:
        """Drop a reference to a page that a swap-in planned this step still reads."""
        idx = page_id - self.first_id
        self.ref_counts[idx] -= 1
        if self.ref_counts[idx] == 0:
            self.transit_page_ids.append(page_id)

    def release(self, page_id: int) -> None:
        """Drop a reference; at 0 the page is free at once (nothing reads it any more)."""
        idx = page_id - self.first_id
        self.ref_counts[idx] -= 1
        if self.ref_counts[idx] == 0:
            self.free_page_ids[page_id] = None
            self.free_page_ids.move_to_end(page_id, last=False)

    def end_transit(self) -> None:
        """The swap-ins planned last step have been issued: their pages are free again (front)."""
        for page_id in self.transit_page_ids:
            self.free_page_ids[page_id] = None
            self.free_page_ids.move_to_end(page_id, last=False)
        self.transit_page_ids.clear()

    # ------------------------------------------------------------------ the prefix cache's tier

    def lookup(self, page_hash: bytes, key: tuple) -> int | None:
        page_id = self.hash_to_page.get(page_hash)
        if page_id is None or self.page_key[page_id] != key:
            return None
        return page_id

    def store(self, page_hash: bytes, key: tuple) -> int | None:
        """A free page to hold a page evicted from the device, registered under `page_hash` and left
        free at the back (most recently stored, evicted last); None if the hash is already here or
        no page is free."""
        if page_hash in self.hash_to_page:
            self.free_page_ids.move_to_end(self.hash_to_page[page_hash])  # refresh: evicted later
            return None
        if not self.free_page_ids:
            return None
        page_id, _ = self.free_page_ids.popitem(last=False)
        self._forget(page_id)
        self.hash_to_page[page_hash] = page_id
        self.page_hash[page_id] = page_hash
        self.page_key[page_id] = key
        self.free_page_ids[page_id] = None
        return page_id

    def claim_hit(self, page_id: int) -> None:
        """A hit moves back to the device: unregister it here and hold it in transit until read."""
        del self.free_page_ids[page_id]
        del self.hash_to_page[self.page_hash.pop(page_id)]
        del self.page_key[page_id]
        self.transit_page_ids.append(page_id)

    def forget_all(self) -> int:
        """Drop every cached page (they become free, reused first); returns how many."""
        page_ids = list(self.hash_to_page.values())
        for page_id in page_ids:
            self._forget(page_id)
            self.free_page_ids.move_to_end(page_id, last=False)
        return len(page_ids)

    def _forget(self, page_id: int) -> None:
        page_hash = self.page_hash.pop(page_id, None)
        if page_hash is not None:
            del self.hash_to_page[page_hash]
            del self.page_key[page_id]
            self.num_evictions += 1
