"""KVCache: the arena, its pools, the ledger and the allocator of one plan, as one object."""

from __future__ import annotations

from ..alloc import Allocator
from ..alloc.entries import request_entries
from ..alloc.integrity import check as check_allocator
from .arena import Arena
from ..planning.buffers import FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..errors import RequestStateError
from .ledger import Ledger, entry_key
from .pools import build_pools


class KVCache:
    """Owns every tensor of a plan. Lifecycle calls go to the allocator, which moves the ledger."""

    def __init__(self, plan, device="cpu", backend="plain", prefix_policy="kvatlas", **backend_options) -> None:
        self.plan = plan
        self.arena = Arena(plan, device=device, backend=backend, **backend_options)
        self.pools = build_pools(plan, {n: r.tensor for n, r in self.arena.regions.items()})
        self._pool_specs = plan.pools()   # request_usage runs per request on every /state
        self.ledger = Ledger(plan, self.arena)
        self.allocator = Allocator(plan, self.ledger, backing=self.arena.backend.allocator_hooks())
        self.prefix = None
        self.host = None    # a host tier below the pools (kvatlas.tiers.attach_host_tier): /state, /metrics
        if self.allocator.prefix_on:   # imported here: the prefix package stands above this one
            from ..prefix import PrefixCache
            self.prefix = PrefixCache(self.allocator, self.ledger, policy=prefix_policy)
        self._by_layer: dict[int, dict[str, object]] = {}
        for pool in self.pools.values():
            for layer in pool.layers:
                self._by_layer.setdefault(layer, {})[pool.name] = pool

    @property
    def device(self):
        return self.arena.device

    def layer_pools(self, layer: int) -> dict:
        """Every pool holding a slice for model layer `layer`, by pool name."""
        if layer not in self._by_layer:
            raise KeyError(f"layer {layer} is not cached on this rank (layers {sorted(self._by_layer)})")
        return self._by_layer[layer]

    # --- lifecycle (see kvatlas.alloc.Allocator) ---
    def can_admit(self, prompt_tokens: int, max_new_tokens: int = 0, *, token_ids=None, page_keys=None) -> bool:
        """With the prefix cache, counts the cached prefix and what eviction would free."""
        if self.prefix is not None:
            return self.prefix.can_admit(prompt_tokens, max_new_tokens, token_ids=token_ids, page_keys=page_keys)
        return self.allocator.can_admit(prompt_tokens, max_new_tokens)

    def admit(self, request_id, prompt_tokens: int, max_new_tokens: int = 0, *, token_ids=None, page_keys=None):
        """token_ids / page_keys (prefix cache): the prompt's content. `cached_tokens` of the
        answer is where the caller starts writing: the prompt before it is cached."""
        if self.prefix is not None:
            adm = self.prefix.admit(request_id, prompt_tokens, max_new_tokens, token_ids=token_ids,
                                    page_keys=page_keys)
        else:
            adm = self.allocator.admit(request_id, prompt_tokens, max_new_tokens)
        self._clear_state(adm.request_slot)
        if adm.cached_tokens and self.arena.backend.holds_memory:   # backend none holds no rows
            self._restore_rows(adm.request_slot, adm.resume_unit, adm.cached_tokens)
        return adm

    def _restore_rows(self, slot: int, unit: int, boundary: int) -> None:
        """Resume at `boundary`: the saved rows go to the ring rows of their positions."""
        for name, pool in self.pools.items():
            if pool.role != "checkpoint":
                continue
            target = self.pools[name.split(".", 1)[1]]
            rows = pool.spec.entries_per_unit
            pos = range(boundary - rows, boundary)
            if target.role == "window":
                ring = target.spec.entries_per_unit
                dst = target.tensor[slot].view(len(target.layers), ring, -1)
                src = pool.tensor[unit].view(len(pool.layers), rows, -1)
            else:
                ring, dst, src = target.ring_rows, target.tensor[slot], pool.tensor[unit]
            dst[:, [p % ring for p in pos]] = src

    def extend(self, request_id, num_tokens: int):
        return self.allocator.extend(request_id, num_tokens)

    def batch(self, request_ids):
        """A running batch resolved once, for repeated step() calls (see alloc.RequestBatch)."""
        return self.allocator.batch(request_ids)

    def step(self, request_ids, tokens_each=1):
        return self.allocator.step(request_ids, tokens_each)

    def rollback(self, request_id, num_tokens: int) -> None:
        self.allocator.rollback(request_id, num_tokens)

    def finish(self, request_id, *, token_ids=None) -> None:
        """token_ids (prefix cache): the request's whole sequence, to cache pages past the prompt."""
        if self.prefix is not None:
            self.prefix.finish(request_id, token_ids=token_ids)
        else:
            self.allocator.finish(request_id)

    def flush(self) -> None:
        self.allocator.flush()

    def _clear_state(self, slot: int) -> None:
        """A new request's rings start cleared: kv = 0, score = -inf (online C128: max = -inf).
        A bookkeeping cache (backend "none") holds no rows to clear."""
        if not self.arena.backend.holds_memory:
            return
        for pool in self.pools.values():
            if pool.role != "state":
                continue
            rows = pool.tensor[slot]
            width = rows.shape[-1]
            if pool.name.endswith("online_state"):   # [max | sum | kv]
                rows.zero_()
                rows[..., : width // 3].fill_(float("-inf"))
            else:                                    # [kv | score]
                rows[..., : width // 2].zero_()
                rows[..., width // 2:].fill_(float("-inf"))

    # --- accounting ---
    def request_usage(self, request_id) -> dict[str, dict[str, int]]:
        """One request's footprint by pool: bytes held (pages/slots it owns) and occupied (live)."""
        a = self.allocator
        if request_id not in a.slot_of:
            raise RequestStateError(f"request_id {request_id!r} is not running; ask about a running request")
        slot = a.slot_of[request_id]
        entries = request_entries(a, slot)
        units = {REQUEST_SLOTS: 1, FULL_PAGES: int(a.full_held[slot]),
                 SWA_PAGES: int(a.swa_hi[slot] - a.swa_lo[slot])}
        out: dict[str, dict[str, int]] = {}
        for name, specs in self._pool_specs.items():
            held = occupied = 0
            for s in specs:
                if s.group not in units:
                    continue
                held += units[s.group] * s.unit_bytes
                if s.group == REQUEST_SLOTS:
                    occupied += s.unit_payload_bytes
                else:
                    occupied += entries.get(entry_key(s), 0) * s.entry_bytes * len(s.layers)
            out[name] = {"held_bytes": held, "occupied_bytes": occupied}
        return out

    def trim(self) -> int:
        """Give back physical memory held only for hysteresis (vmm backend); bytes released.
        The plain backend holds its whole slab, so there is nothing to trim: 0."""
        return self.arena.backend.trim()

    def check_integrity(self):
        check_allocator(self.allocator, self.ledger)
        return self.ledger.check_integrity()

    def close(self) -> None:
        if self.host is not None:    # its copies read and write the pools: finish them first
            self.host.close()
            self.host = None
        self.pools.clear()
        self.arena.close()


def allocate(plan, device="cpu", backend="plain", **backend_options) -> KVCache:
    """Allocate a plan for real: every buffer a view of one allocation, accounted by the ledger.
    backend "vmm" (CUDA + cuda-python) reserves the plan's address space and maps physical memory
    only under live data; it takes max_physical_bytes and keep_empty_chunks (kvatlas.vmm)."""
    return KVCache(plan, device=device, backend=backend, **backend_options)
