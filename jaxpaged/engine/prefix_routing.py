"""Which data-parallel replica a request goes to (EngineConfig.data_parallel_routing).

    "least_loaded"  the replica with the fewest unfinished requests (ties: the lowest index)
    "round_robin"   replicas in turn
    "prefix"        the replica that was sent the longest full-page prefix of this prompt, unless it
                    holds more than `max_imbalance` requests above the least loaded one; else the
                    least loaded

Requests sharing a prefix (a GRPO group's samples sent as separate requests, a conversation's next
turn) then meet the pages their prefix left in one replica's prefix cache, instead of each replica
computing it. The router remembers what it sent, not what the replicas still cache: a chained
digest per full page of each prompt (planner/prefix_cache.py's `hash_page`, same page size and
cache_salt) -> the replica, in an LRU of `capacity` pages. Host only, no jax.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxpaged.planner.prefix_cache import hash_page

ROUTINGS = ("least_loaded", "round_robin", "prefix")


class ReplicaRouter:
    def __init__(self, routing: str, num_replicas: int, page_size: int, *, max_imbalance: int, capacity: int = 1 << 16):
        if routing not in ROUTINGS:
            raise ValueError(f"data_parallel_routing={routing!r}: use one of {ROUTINGS}")
        self.routing, self.num_replicas, self.page_size = routing, num_replicas, page_size
        self.max_imbalance, self.capacity = max_imbalance, capacity
        self._turn = 0  # round_robin
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # page digest -> replica (LRU order)

    def _digests(self, prompt_token_ids: list[int], cache_salt) -> list[bytes]:
        digests, parent = [], None
        for start in range(0, len(prompt_token_ids) - self.page_size + 1, self.page_size):
            parent = hash_page(parent, cache_salt, tuple(prompt_token_ids[start:start + self.page_size]))
            digests.append(parent)
        return digests

    def choose(self, prompt_token_ids: list[int], cache_salt, loads: list[int]) -> int:
        """The replica for this prompt (loads: unfinished requests per replica); remembered for later ones."""
        least = min(range(self.num_replicas), key=lambda r: (loads[r], r))
        if self.routing == "least_loaded":
            return least
        if self.routing == "round_robin":
            self._turn = (self._turn + 1) % self.num_replicas
            return (self._turn - 1) % self.num_replicas
        digests = self._digests(prompt_token_ids, cache_salt)
        chosen = least
        for digest in reversed(digests):  # the longest prefix sent anywhere
            holder = self._pages.get(digest)
            if holder is not None:
                if loads[holder] <= loads[least] + self.max_imbalance:
                    chosen = holder
                break
        for digest in digests:
            self._pages[digest] = chosen
            self._pages.move_to_end(digest)
        while len(self._pages) > self.capacity:
            self._pages.popitem(last=False)
        return chosen
