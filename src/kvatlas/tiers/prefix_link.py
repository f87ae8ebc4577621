"""The host tier under the prefix cache: evicted pages and checkpoints go to host memory instead
of being dropped, and a match that reaches them brings them back before the request runs.

    link = attach_host_tier(cache, "128GiB")     # cache.prefix evicts into it from now on
    ready = link.prefetch(prompt_tokens, token_ids=ids)   # before admit(); None: nothing to bring
    cache.admit(rid, prompt_tokens, max_new, token_ids=ids)
    ready.wait()                                 # before the request's first forward pass

Host entries are keyed by the prefix tree's page keys. A host page remembers its parent key: it
is reachable only through a chain of host pages from a page cached on the device (or the root),
so when the host LRU drops a page, its host descendants are dropped too (unreachable otherwise).
A page that comes back to the device with the same key (computed again) needs no second copy:
keys are content hashes, so the bytes are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import known_options, of_type
from ..errors import KvatlasError, PoolExhaustedError
from ..planning.hostplan import plan_host
from .host import HostTier
from .index import CheckpointAt
from .memory import check_host_fits


@dataclass(slots=True)
class TierHits:
    """Prefetches that brought back a resume point deeper than the device's, and what they
    restored. The tokens served from host pages are counted where the hit is decided, at the
    admission (PrefixStats.host_hit_tokens, in `as_dict` as host_hit_tokens)."""

    host_hit_requests: int = 0
    restored_pages: int = 0
    restored_checkpoints: int = 0

    def as_dict(self, host_hit_tokens: int) -> dict:
        return {"host_hit_tokens": host_hit_tokens, "host_hit_requests": self.host_hit_requests,
                "restored_pages": self.restored_pages, "restored_checkpoints": self.restored_checkpoints}


class HostLink:
    """`prefix`: a PrefixCache; `tier`: a HostTier (bytes) or a ModeledHost (bookkeeping only)."""

    def __init__(self, prefix, tier) -> None:
        if prefix is None:
            raise KvatlasError("host tier: the plan has no prefix cache to evict from; plan with "
                               "prefix_checkpoints > 0")
        self.tier, self.prefix = tier, prefix
        self.P = tier.device_plan.page_tokens
        self.parent: dict = {}        # host page key -> parent key (0: the root)
        self.children: dict = {}      # key -> host page keys below it
        self.boundary: dict = {}      # host checkpoint key -> boundary tokens
        self.hits = TierHits()
        self.prefix.evictor = self

    # ---------------------------------------------------------------- eviction: to host
    def on_evict(self, e) -> None:
        if e.kind == "checkpoint":
            if self.tier.contains("checkpoint", e.key):
                self.tier.touch("checkpoint", [e.key])
                return
            at = CheckpointAt(swa_pages=tuple(e.swa_pages), unit=e.unit)
            try:
                moved = self.tier.offload_checkpoints([e.key], [at])
            except PoolExhaustedError:
                self.tier.refuse_offload("checkpoint")
                return
            self.boundary[e.key] = e.boundary_tokens
            for k in moved.evicted:
                self.boundary.pop(k, None)
            return
        if self.tier.contains("page", e.key):
            self.tier.touch("page", [e.key])
            return
        try:
            moved = self.tier.offload_pages([e.key], [e.full_page])
        except PoolExhaustedError:    # every host slot is claimed by a restore under way: drop it
            self.tier.refuse_offload("page")
            return
        self.parent[e.key] = e.parent_key
        self.children.setdefault(e.parent_key, set()).add(e.key)
        for k in moved.evicted:
            self._forget_page(k)

    def _forget_page(self, key) -> None:
        """A host page left host memory: host pages below it are unreachable now."""
        parent = self.parent.pop(key, None)
        if parent is not None:
            self.children.get(parent, set()).discard(key)
        stack = list(self.children.pop(key, ()))
        while stack:
            k = stack.pop()
            self.parent.pop(k, None)
            stack += self.children.pop(k, ())
            if self.tier.contains("page", k):
                self.tier.drop("page", [k])
            if self.tier.contains("checkpoint", k):
                self.tier.drop("checkpoint", [k])
                self.boundary.pop(k, None)

    # ---------------------------------------------------------------- admission: back from host
    def prefetch(self, prompt_tokens: int, *, token_ids=None, page_keys=None):
        """Bring back the host pages (and the checkpoint) that extend this prompt's device match
        to a deeper resume point. Returns a Ready (wait() before the first forward) or None:
        nothing to bring back, or no room on the device for it now (every page held by running
        requests: try again at the next admission)."""
        self.prefix.alloc._validate_lengths(prompt_tokens, 0)
        keys = self.prefix._keys(prompt_tokens, token_ids, page_keys)
        cap = min(len(keys), (prompt_tokens - 1) // self.P)
        path = self.prefix.tree.match(keys[:cap])
        device = len(path)
        host = self._below(keys, path, self._host_depth(keys, device, cap), cap)
        j = self._resume_depth(keys, path, host)
        if j is None:
            return None
        return self._bring_back(keys, device, j)

    def _host_depth(self, keys, device: int, cap: int) -> int:
        """How far host pages extend the device match, linked page to page."""
        host = device
        while host < cap and self.tier.contains("page", int(keys[host])) \
                and self.parent.get(int(keys[host])) == (int(keys[host - 1]) if host else 0):
            host += 1
        return host

    def _below(self, keys, path, host: int, cap: int) -> int:
        """A tier below the host tier may bring more into host memory first (SharedLink);
        returns the host depth then."""
        return host

    def _resume_depth(self, keys, path, host: int) -> int | None:
        """The deepest boundary with a resume point on either tier, when it lies deeper than the
        device alone can resume (else None: nothing to bring back)."""
        ckpt = self.prefix.tree.ckpt
        alone = next((j for j in range(len(path), 0, -1) if ckpt[path[j - 1]] is not None), 0)
        for j in range(host, alone, -1):
            if self.tier.contains("checkpoint", int(keys[j - 1])):
                return j
        return None

    def _bring_back(self, keys, device: int, j: int):
        """Claim the host entries first (so evictions the restore causes cannot drop them), then
        make room on the device, then copy. A device with no room to give (every page and unit
        held by running requests) brings back nothing now: None, the host entries kept for a
        later prefetch (the admission then waits or computes the prefix itself); pages brought
        back whose resume point finds no room stay cached, and the Ready covers their copies."""
        ks = [int(k) for k in keys[device:j]]
        key = int(keys[j - 1])
        tree = self.prefix.tree
        node = tree.index.get(key)
        want_ck = (node is None or tree.ckpt[node] is None) and self.tier.contains("checkpoint", key)
        pages_claim = self.tier.claim("page", ks) if ks else None
        ck_claim = self.tier.claim("checkpoint", [key]) if want_ck else None
        transfers, resumes = [], True
        try:
            if ks:
                try:
                    pages = self.prefix.restore_pages(int(keys[device - 1]) if device else 0, ks,
                                                      [self._origin(k) for k in ks])
                except PoolExhaustedError:
                    self._no_hit()
                    return None   # (nothing changed; the claims are dropped below)
                transfers.append(self.tier.restore(pages_claim, pages))
                pages_claim = None
                for k in ks:
                    self._unlink(k)
                self.hits.restored_pages += len(ks)
            if ck_claim is not None:
                try:
                    unit, swa = self.prefix.restore_checkpoint(key, self.boundary[key])
                except PoolExhaustedError:
                    resumes = False
                else:
                    transfers.append(self.tier.restore(ck_claim, [CheckpointAt(swa_pages=tuple(swa.tolist()),
                                                                               unit=unit)]))
                    ck_claim = None
                    self.boundary.pop(key, None)
                    self.hits.restored_checkpoints += 1
        finally:
            for c in (pages_claim, ck_claim):
                if c is not None:
                    self.tier.unclaim(c)
        if resumes:
            self._count_hit(ks, j - device)
        else:
            self._no_hit()
        return Ready(transfers) if transfers else None

    def _origin(self, key) -> str:
        """The tier a page brought back now comes from (its tokens count there when first read)."""
        return "host"

    def _count_hit(self, keys, pages: int) -> None:
        self.hits.host_hit_requests += 1

    def _no_hit(self) -> None:
        """A bring-back that did not reach its resume point: no hit (a shared link forgets what it fetched)."""

    def _unlink(self, key) -> None:
        parent = self.parent.pop(key, None)
        if parent is not None:
            self.children.get(parent, set()).discard(key)


    def snapshot(self):
        return self.tier.snapshot(hits=self.hits.as_dict(self.prefix.stats.host_hit_tokens))

    def shared_snapshot(self):
        """The shared tier's snapshot (kvatlas.tiers.shared); None: there is none below."""
        return None

    def close(self) -> None:
        self.prefix.evictor = None
        self.tier.close()


class Ready:
    """The restores one request waits for."""

    def __init__(self, transfers) -> None:
        self.transfers = transfers

    @property
    def modeled_s(self) -> float:
        """Modeled seconds until the request may run (its restores, one after another)."""
        return sum(t.modeled_s for t in self.transfers)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def done(self) -> bool:
        return all(t.done() for t in self.transfers)

    def wait(self, stream=None) -> None:
        for t in self.transfers:
            t.wait(stream)

    def synchronize(self) -> None:
        for t in self.transfers:
            t.synchronize()


HOST_TIER_OPTIONS = ("checkpoint_share", "pin", "staging_bytes")


def attach_host_tier(cache, host_memory_bytes, **options) -> HostLink:
    """A HostTier for `cache`, wired under its prefix cache; `cache.host` reports it. Refused
    before any host memory is taken: a cache that is not one, options it does not take, a second
    tier, and a size beyond the host memory available."""
    from ..cache.kvcache import KVCache
    of_type("cache", cache, KVCache, "a KVCache", "give what kvatlas.allocate() returns")
    known_options("attach_host_tier", options, HOST_TIER_OPTIONS)
    if cache.prefix is None:
        HostLink(None, None)
    if cache.host is not None:
        raise KvatlasError("cache: a host tier is attached already; attach one per cache (close the cache to "
                           "drop it)")
    check_host_fits(plan_host(cache.plan, host_memory_bytes,
                              *([options["checkpoint_share"]] if "checkpoint_share" in options else [])))
    link = HostLink(cache.prefix, HostTier(cache, host_memory_bytes, **options))
    cache.host = link
    return link
