"""Multi-LoRA as a step feature: the adapters the engine knows, their host cache, and each step's slots.

    add_request(lora_request) ──► resolve: known id, or read + checked (models/peft_adapter.py) and
                                  kept in the host cache (LRU, max_cpu_loras); the sequence carries
                                  lora_int_id and (lora_int_id, version) in its prefix-cache salt
    Scheduler.schedule           ──► at most max_loras distinct adapters in the running batch
    before_execute(out)          ──► LoRASlots.assign: each scheduled sequence's device slot, loading
                                  missing adapters into the least recently used slots (device/lora_slots.py);
                                  StepInput.lora_slots gives every token its slot

An adapter evicted from the host cache is read again from its LoRARequest (its path, or the tensors it
holds) when a step needs it. `add_lora` with the id of a known adapter replaces its weights in place
(an RL trainer's adapter-only sync): its version goes up, so its slot is rewritten before the next step
that uses it and requests admitted from then on never hit pages computed under the old weights.
Host only: no jax.
"""

from __future__ import annotations

import collections

from jaxpaged.engine.features import StepFeature
from jaxpaged.models.peft_adapter import AdapterWeights, load_adapter
from jaxpaged.planner.lora_request import LoRARequest
from jaxpaged.planner.prefix_cache import versioned_salt
from jaxpaged.planner.sequence import SequenceStatus


class LoRAAdapters(StepFeature):
    name = "lora"

    def __init__(self, model_config, slots, scheduler, *, max_lora_rank: int, max_cpu_loras: int):
        self.model_config, self.slots, self.scheduler = model_config, slots, scheduler
        self.max_lora_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by lora_int_id
        self.versions: dict[int, int] = {}  # lora_int_id -> how many times its weights were replaced
        self.host: collections.OrderedDict[int, AdapterWeights] = collections.OrderedDict()  # LRU first
        self.num_host_loads = 0  # adapters read from their path or tensors

    # ---------------------------------------------------------------- the adapters known

    def resolve(self, request: LoRARequest) -> int:
        """The id `request` runs under: a known adapter (same id and name), or one read and checked now
        (ValueError for a bad adapter; the engine is unchanged)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a jaxpaged.LoRARequest, got {type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is None:
            self.add(request)
        elif known.lora_name != request.lora_name:
            raise ValueError(f"lora_int_id={request.lora_int_id} is adapter {known.lora_name!r}, not "
                             f"{request.lora_name!r}; give each adapter its own lora_int_id")
        return request.lora_int_id

    def add(self, request: LoRARequest) -> bool:
        """Reads and checks `request`'s adapter and keeps it; for a known id, replaces that adapter's
        weights in place (same name required). Returns True."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_name != request.lora_name:
            raise ValueError(f"lora_int_id={request.lora_int_id} is adapter {known.lora_name!r}; to replace its "
                             f"weights keep its name, else give {request.lora_name!r} another lora_int_id")
        for other in self.requests.values():
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"adapter name {request.lora_name!r} is taken by lora_int_id={other.lora_int_id}")
        weights = load_adapter(request, self.model_config, self.max_lora_rank)  # ValueError: nothing changes
        self.num_host_loads += 1
        self.requests[request.lora_int_id] = request
        self.versions[request.lora_int_id] = self.versions.get(request.lora_int_id, -1) + 1
        self._keep(request.lora_int_id, weights)
        if known is not None:
            self._resalt_waiting(request.lora_int_id)
        return True

    def _resalt_waiting(self, lora_int_id: int) -> None:
        """Waiting sequences of a replaced adapter that hold no K/V take its new version into their salt
        (as planner/weight_update.py's resalt_waiting for new base weights): the pages they find are the
        new weights' only. Running and swapped ones keep theirs (their K/V mixes the two)."""
        for seq in [*self.scheduler.waiting, *self.scheduler.waiting_for_grammar.values()]:
            if seq.lora_int_id == lora_int_id and seq.status is not SequenceStatus.SWAPPED:
                seq.cache_salt = versioned_salt(seq.cache_salt, seq.cache_salt[1], self.salt_part(lora_int_id))
                seq.page_hashes = []

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an adapter no unfinished request runs under; False if unknown."""
        if lora_int_id not in self.requests:
            return False
        if lora_int_id in self.scheduler.lora_ids_in_use():
            raise ValueError(f"adapter {self.requests[lora_int_id].lora_name!r} (lora_int_id={lora_int_id}) has "
                             "unfinished requests; wait for them or abort them before removing it")
        del self.requests[lora_int_id]
        self.host.pop(lora_int_id, None)
        self.slots.evict(lora_int_id)
        return True

    def salt_part(self, lora_int_id: int) -> tuple[int, int]:
        """What a sequence under this adapter adds to its prefix-cache salt: (lora_int_id, version)."""
        return (lora_int_id, self.versions[lora_int_id])

    def weights(self, lora_int_id: int) -> AdapterWeights:
        """The adapter's host weights, read again from its request if the host cache let them go."""
        weights = self.host.get(lora_int_id)
        if weights is None:
            weights = load_adapter(self.requests[lora_int_id], self.model_config, self.max_lora_rank)
            self.num_host_loads += 1
            self._keep(lora_int_id, weights)
        else:
            self.host.move_to_end(lora_int_id)
        return weights

    def _keep(self, lora_int_id: int, weights: AdapterWeights) -> None:
        self.host[lora_int_id] = weights
        self.host.move_to_end(lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    # ---------------------------------------------------------------- the step

    def before_execute(self, out) -> dict:
        lora_ids = [seq.lora_int_id for seq in out.seqs]
        return {"seq_lora_slots": self.slots.assign(lora_ids, self.versions.__getitem__, self.weights)}

    def stats(self) -> dict:
        """Counters, and vLLM's lora_requests_info labels: the adapters of running and of waiting requests
        (comma-separated names) and max_lora."""
        def names(seqs) -> str:
            ids = {seq.lora_int_id for seq in seqs if seq.lora_int_id}
            return ",".join(sorted(self.requests[i].lora_name for i in ids if i in self.requests))
        return {"num_loras": len(self.requests), "num_lora_slot_loads": self.slots.num_loads,
                "num_lora_host_loads": self.num_host_loads, "max_lora": self.slots.max_loras,
                "running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting)}
