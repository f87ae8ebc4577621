"""KVCache: the arena, its pools, the ledger and the allocator of one plan, as one object."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..alloc import Allocator
from ..alloc.entries import ratio_key
from ..alloc.sharing import CACHE_OWNER
from ..alloc.integrity import check as check_allocator
from .arena import Arena
from ..planning.buffers import FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..checks import of_type
from ..errors import NotFoundError, RequestStateError
from ..planning.planner import Plan
from .ledger import Ledger, entry_key
from .pools import build_pools


@dataclass(frozen=True, slots=True)
class UsageCounters:
    """Per running request (in `ids` order): its length and the pages it holds."""

    ids: tuple
    length: np.ndarray
    full_held: np.ndarray
    swa_lo: np.ndarray
    swa_hi: np.ndarray


def _lookup_key(request_id):
    """An id as a dict key; an unhashable one can never be running."""
    try:
        hash(request_id)
    except TypeError:
        return None
    return request_id


class KVCache:
    """Owns every tensor of a plan. Lifecycle calls go to the allocator, which moves the ledger."""

    def __init__(self, plan, device="cpu", backend="plain", prefix_policy="kvatlas", prefix_reuse_weight=None,
                 **backend_options) -> None:
        self.plan = of_type("plan", plan, Plan, "a Plan", "give what kvatlas.plan() returns")
        if prefix_reuse_weight is not None:   # (before anything is allocated)
            from ..prefix.tree import checked_reuse_weight
            checked_reuse_weight(prefix_reuse_weight, "prefix_reuse_weight")
        self.arena = Arena(plan, device=device, backend=backend, **backend_options)
        self.pools = build_pools(plan, {n: r.tensor for n, r in self.arena.regions.items()})
        self._pool_specs = plan.pools()   # request_usage runs per request on every /state
        self.ledger = Ledger(plan, self.arena)
        self.allocator = Allocator(plan, self.ledger, backing=self.arena.backend.allocator_hooks())
        self.prefix = None
        self.host = None    # a host tier below the pools (kvatlas.tiers.attach_host_tier): /state, /metrics
        if self.allocator.prefix_on:   # imported here: the prefix package stands above this one
            from ..prefix import PrefixCache
            self.prefix = PrefixCache(self.allocator, self.ledger, policy=prefix_policy,
                                      **({} if prefix_reuse_weight is None else {"reuse_weight": prefix_reuse_weight}))
        a = self.allocator
        self._usage_constants = (tuple(a.ratios), a.Ps, a.swa is not None)
        self._by_layer: dict[int, dict[str, object]] = {}
        for pool in self.pools.values():
            for layer in pool.layers:
                self._by_layer.setdefault(layer, {})[pool.name] = pool

    @property
    def device(self):
        return self.arena.device

    def layer_pools(self, layer: int) -> dict:
        """Every pool holding a slice for model layer `layer`, by pool name."""
        if _lookup_key(layer) not in self._by_layer:
            raise NotFoundError("layer", f"{layer!r} is not cached on this rank",
                                f"give a model layer index this rank holds: {sorted(self._by_layer)}")
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
        """token_ids (prefix cache): the request's whole sequence, to cache pages past the prompt;
        they must agree with the prompt it was admitted with (kvatlas.prefix.keys)."""
        if self.prefix is not None:
            self.prefix.finish(request_id, token_ids=token_ids)
        else:
            if token_ids is not None:   # unused without a prefix cache, but never garbage
                from ..prefix.keys import check_token_ids
                check_token_ids(token_ids)
            self.allocator.finish(request_id)

    def generated(self, request_id, token_ids) -> int:
        """Prefix cache: the request's sequence so far (prompt + tokens kept), so that its full
        decode pages are shared as they fill (kvatlas.prefix.PrefixCache.generated). Without a
        prefix cache nothing is keyed: 0."""
        if self.prefix is None:
            from ..prefix.keys import check_token_ids
            check_token_ids(token_ids)
            return 0
        return self.prefix.generated(request_id, token_ids)

    def flush(self) -> None:
        self.allocator.flush()

    def copy_contents(self, src_ids, dst_ids) -> None:
        """Each request of dst_ids takes over what the request at the same place of src_ids holds
        (beam search: a beam continues another's history), in every pool: its pages' entries, its
        SWA pages, its rings. Requests of one length; pages of the prefix cache they read (a
        resumed prefix, or their own pages shared as written) must be the same pages in each pair
        and are not copied (others read them: they never change), and (pages shared as written) no
        destination's window may hold a page of the cache (a placed resume point's tail others may
        read; shared at finish, a destination's own points are dropped instead); every source is
        read before any destination is written, so the pairs may overlap."""
        a = self.allocator
        src, dst = ([a.slot_of[r] if r in a.slot_of else -1 for r in ids] for ids in (src_ids, dst_ids))
        if -1 in src or -1 in dst or len(src) != len(dst):
            raise RequestStateError("copy_contents: give two equally long lists of running request ids")
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        both = np.concatenate((src, dst))
        k = int(a.full_shared[both].max(initial=0)) if a.full is not None else 0
        if len(set(a.length[both].tolist())) > 1 or (k and (
                np.any(a.full_shared[both] != k) or np.any(a.full_table[src, :k] != a.full_table[dst, :k]))):
            raise RequestStateError("copy_contents: requests of one length only, reading the same cached pages "
                                    "in each pair (or none)")
        shares_as_written = self.prefix is not None and self.prefix.share_as_written
        if a.swa is not None and a.prefix_on and shares_as_written and any(
                np.any(a.swa.owner[a.window_swa_pages(int(d))] == CACHE_OWNER) for d in dst.tolist()):
            raise RequestStateError("copy_contents: a destination's window holds a page of the prefix cache "
                                    "(a resume point's tail others read); copy after its window has passed it")
        if self.prefix is not None:
            self.prefix.copy_contents(src_ids, dst_ids)
        if not self.arena.backend.holds_memory or not len(src):
            return
        units = {REQUEST_SLOTS: (src, dst)}
        if a.full is not None:
            n = int(a.full_held[src[0]])
            units[FULL_PAGES] = (a.full_table[src, k:n].ravel(), a.full_table[dst, k:n].ravel())
        if a.swa is not None:   # the window's pages: a request's own resume tail may have left swa_lo behind it
            L = int(a.length[src[0]])
            cols = np.arange(max(L - (a.window - 1), 0) // a.Ps, -(-L // a.Ps)) % a.ring
            units[SWA_PAGES] = (a.swa_table[src][:, cols].ravel(), a.swa_table[dst][:, cols].ravel())
        for b in self.plan.buffers:
            if b.group in units and b.role != "table":
                s_units, d_units = (self._device_index(u) for u in units[b.group])
                t = self.arena.regions[b.name].tensor
                t[d_units] = t[s_units]

    def _device_index(self, ids):
        import torch
        return torch.as_tensor(ids, device=self.device)

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
        if _lookup_key(request_id) not in a.slot_of:
            raise RequestStateError(f"request_id {request_id!r} is not running; ask about a running request")
        return self.usage_of(self.usage_counters([request_id]))[request_id]

    def usage_counters(self, request_ids=None) -> "UsageCounters":
        """A copy of the per-request counters request usage is computed from: O(requests) array
        copies, cheap enough to take under the lock a scrape shares with the driver, so that the
        bytes (computed later, outside it) agree with a ledger snapshot taken under the same lock."""
        a = self.allocator
        ids = list(a.slot_of) if request_ids is None else list(request_ids)
        slots = np.fromiter((a.slot_of[r] for r in ids), np.int64, len(ids))
        return UsageCounters(ids=tuple(ids), length=a.length[slots], full_held=a.full_held[slots],
                             swa_lo=a.swa_lo[slots], swa_hi=a.swa_hi[slots])

    def usage_of(self, c: "UsageCounters") -> dict:
        """Per request id: bytes held and occupied by pool, from counters taken earlier."""
        a = self._usage_constants
        return {rid: self._usage_one(a, int(c.length[i]), int(c.full_held[i]), int(c.swa_lo[i]), int(c.swa_hi[i]))
                for i, rid in enumerate(c.ids)}

    def _usage_one(self, consts, L: int, full_held: int, swa_lo: int, swa_hi: int) -> dict:
        ratios, swa_page_tokens, has_swa = consts
        entries = {ratio_key(r): L // r for r in ratios}
        if has_swa:
            entries["swa"] = L - swa_lo * swa_page_tokens
        units = {REQUEST_SLOTS: 1, FULL_PAGES: full_held, SWA_PAGES: swa_hi - swa_lo}
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
        """Every book against a recount: the allocator's arrays and free lists, the ledger's
        counters, the prefix cache's tree, references and evictable units; then the ledger's
        measures. Raises IntegrityError (a bug in kvatlas, never bad input) naming each problem."""
        extra = self.prefix.problems() if self.prefix is not None else []
        check_allocator(self.allocator, self.ledger, extra)
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
