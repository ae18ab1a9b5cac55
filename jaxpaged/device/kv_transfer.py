"""The bytes of the host pages: swap preemption's and the prefix cache's host tier.

`HostKVStore` holds one numpy array per KV leaf, shaped like the leaf with the page axis (3) sized
to every host page (swap pool ids, then host-tier ids: jaxpaged/planner/host_pool.py), and carries out a
step's planned transfers through the runner's fixed-size jitted gather and scatter:

    swap_out [(device page, host page)]   gather on device -> copy_to_host_async -> pending
                                          (materialised into the numpy arrays only when a later
                                          swap-in reads host pages, or at the next swap-out)
    swap_in  [(host page, device page)]   materialise pending; numpy rows -> scatter into the buffer

A hybrid model's swapped recurrent states travel the same way in `HostStateStore` (host state slots,
planner/state_pool.py), through the runner's `gather_states` / `scatter_states`.

The gather is dispatched behind the step already in flight (it reads the buffer that step returns)
and ahead of this step's writes, and its device-to-host copy runs while the host plans; nothing
waits for it until its host pages are read. A swap-in's host-to-device copy is an argument of the
scatter, dispatched before the step that reads the pages.
"""

from __future__ import annotations

import jax
import numpy as np


class HostKVStore:
    def __init__(self, runner, num_host_pages: int) -> None:
        self.runner = runner
        self.num_host_pages = num_host_pages
        self.pages = jax.tree.map(
            lambda leaf: np.zeros(leaf.shape[:3] + (num_host_pages,) + leaf.shape[4:], leaf.dtype), runner.kv_pages
        )
        self.bytes_per_page = sum(
            leaf.nbytes // max(1, num_host_pages) for leaf in jax.tree.leaves(self.pages)
        ) if num_host_pages else 0
        self._pending: list[tuple[list[int], object]] = []  # (host page ids, device pages on their way)
        self.num_bytes_out = 0  # device -> host
        self.num_bytes_in = 0  # host -> device

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._materialise()  # the previous step's copies have landed by now (or are about to)
        batch = self.runner.max_num_transfer_pages
        for i in range(0, len(pairs), batch):
            chunk = pairs[i : i + batch]
            pages = self.runner.gather_pages([page_id for page_id, _ in chunk])
            for leaf in jax.tree.leaves(pages):
                leaf.copy_to_host_async()
            self._pending.append(([host_page_id for _, host_page_id in chunk], pages))
            self.num_bytes_out += len(chunk) * self.bytes_per_page

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._materialise()
        batch = self.runner.max_num_transfer_pages
        for i in range(0, len(pairs), batch):
            chunk = pairs[i : i + batch]
            host_ids = np.zeros(batch, np.int64)
            host_ids[: len(chunk)] = [host_page_id for host_page_id, _ in chunk]
            # Fancy indexing copies: later writes into these host pages cannot race the transfer.
            pages = jax.tree.map(lambda leaf: leaf[:, :, :, host_ids], self.pages)
            self.runner.scatter_pages(pages, [page_id for _, page_id in chunk])
            self.num_bytes_in += len(chunk) * self.bytes_per_page

    def _materialise(self) -> None:
        for host_ids, pages in self._pending:
            def write(host, dev, host_ids=host_ids):
                host[:, :, :, host_ids] = np.asarray(dev)[:, :, :, : len(host_ids)]

            jax.tree.map(write, self.pages, pages)
        self._pending.clear()


class HostStateStore:
    """A hybrid model's swapped recurrent states: one numpy array per state leaf (conv, recurrent), the slot
    axis (1) sized to host state slots 1..num_host_slots (0 unused), moved as `HostKVStore` moves pages:

        swap_out [(device slot, host slot)]   gather on device -> copy_to_host_async -> pending
        swap_in  [(host slot, device slot)]   materialise pending; numpy rows -> scatter into the state
    """

    def __init__(self, runner, num_host_slots: int) -> None:
        self.runner = runner
        self.num_host_slots = num_host_slots
        self.states = jax.tree.map(
            lambda leaf: np.zeros(leaf.shape[:1] + (num_host_slots + 1,) + leaf.shape[2:], leaf.dtype),
            runner.linear_state,
        ) if num_host_slots else None
        self._pending: list[tuple[list[int], object]] = []  # (host slots, device states on their way)
        self.num_bytes_out = 0
        self.num_bytes_in = 0

    def _bytes_per_slot(self) -> int:
        return sum(leaf.nbytes // leaf.shape[1] for leaf in jax.tree.leaves(self.states))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._materialise()
        batch = self.runner.max_num_copies
        for i in range(0, len(pairs), batch):
            chunk = pairs[i : i + batch]
            states = self.runner.gather_states([slot for slot, _ in chunk])
            for leaf in jax.tree.leaves(states):
                leaf.copy_to_host_async()
            self._pending.append(([host_slot for _, host_slot in chunk], states))
            self.num_bytes_out += len(chunk) * self._bytes_per_slot()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._materialise()
        batch = self.runner.max_num_copies
        for i in range(0, len(pairs), batch):
            chunk = pairs[i : i + batch]
            host_ids = np.zeros(batch, np.int64)
            host_ids[: len(chunk)] = [host_slot for host_slot, _ in chunk]
            states = jax.tree.map(lambda leaf: leaf[:, host_ids], self.states)  # a copy: later writes cannot race
            self.runner.scatter_states(states, [slot for _, slot in chunk])
            self.num_bytes_in += len(chunk) * self._bytes_per_slot()

    def _materialise(self) -> None:
        for host_ids, states in self._pending:
            def write(host, dev, host_ids=host_ids):
                host[:, host_ids] = np.asarray(dev)[:, : len(host_ids)]

            jax.tree.map(write, self.states, states)
        self._pending.clear()
