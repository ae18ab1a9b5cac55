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


class _HostRows:
    """Host copies of device rows along `axis` (pages: 3, state slots: 1), moved in the runner's fixed-size
    batches: `gather` / `scatter` are the runner's jitted programs, `batch` their row count."""

    axis: int

    def __init__(self, runner, device_tree, num_rows: int, batch: int, gather, scatter) -> None:
        self.runner = runner
        self._batch, self._gather, self._scatter = batch, gather, scatter
        self._rows = jax.tree.map(
            lambda leaf: np.zeros(leaf.shape[:self.axis] + (num_rows,) + leaf.shape[self.axis + 1:], leaf.dtype),
            device_tree,
        )
        self._pending: list[tuple[list[int], object]] = []  # (host rows, device rows on their way)
        self.num_bytes_out = 0  # device -> host
        self.num_bytes_in = 0  # host -> device

    def _at(self, index):
        return (slice(None),) * self.axis + (index,)

    def row_bytes(self) -> int:
        return sum(leaf.nbytes // max(1, leaf.shape[self.axis]) for leaf in jax.tree.leaves(self._rows))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._materialise()  # the previous step's copies have landed by now (or are about to)
        for i in range(0, len(pairs), self._batch):
            chunk = pairs[i : i + self._batch]
            rows = self._gather([device_id for device_id, _ in chunk])
            for leaf in jax.tree.leaves(rows):
                leaf.copy_to_host_async()
            self._pending.append(([host_id for _, host_id in chunk], rows))
            self.num_bytes_out += len(chunk) * self.row_bytes()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._materialise()
        for i in range(0, len(pairs), self._batch):
            chunk = pairs[i : i + self._batch]
            host_ids = np.zeros(self._batch, np.int64)
            host_ids[: len(chunk)] = [host_id for host_id, _ in chunk]
            # Fancy indexing copies: later writes into these host rows cannot race the transfer.
            rows = jax.tree.map(lambda leaf: leaf[self._at(host_ids)], self._rows)
            self._scatter(rows, [device_id for _, device_id in chunk])
            self.num_bytes_in += len(chunk) * self.row_bytes()

    def _materialise(self) -> None:
        for host_ids, rows in self._pending:
            def write(host, dev, host_ids=host_ids):
                host[self._at(host_ids)] = np.asarray(dev)[self._at(slice(0, len(host_ids)))]

            jax.tree.map(write, self._rows, rows)
        self._pending.clear()


class HostKVStore(_HostRows):
    axis = 3  # [num_layers, 2, num_kv_heads, pages, page_size, head_dim]

    def __init__(self, runner, num_host_pages: int) -> None:
        super().__init__(runner, runner.kv_pages, num_host_pages, runner.max_num_transfer_pages,
                         runner.gather_pages, runner.scatter_pages)
        self.num_host_pages = num_host_pages
        self.bytes_per_page = self.row_bytes() if num_host_pages else 0

    @property
    def pages(self):
        return self._rows


class HostStateStore(_HostRows):
    """A hybrid model's swapped recurrent states: one numpy array per state leaf (conv, recurrent), the slot
    axis (1) sized to host state slots 1..num_host_slots (0 unused), moved as `HostKVStore` moves pages."""

    axis = 1

    def __init__(self, runner, num_host_slots: int) -> None:
        super().__init__(runner, runner.linear_state, num_host_slots + 1, runner.max_num_copies,
                         runner.gather_states, runner.scatter_states)
        self.num_host_slots = num_host_slots

    @property
    def states(self):
        return self._rows
