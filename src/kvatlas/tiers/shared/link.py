"""The tiers as one: device → host → shared. A SharedLink is a HostLink whose host tier has a
shared store below it:

    link = attach_shared_tier(cache, "32GiB", "mooncake://127.0.0.1:50051?metadata=...")
    ready = link.prefetch(prompt_tokens, token_ids=ids)   # as with the host tier alone
    cache.admit(...); ready.wait()

- Down. With policy "finish" (the default) the pages and resume points a finished request
  leaves cached are written through to the store at once (copied from the device into the
  outbox, then put by the store's write thread), so another process finds them while this one
  still has them. Whatever the policy, an entry the host LRU drops and the store is not known to
  hold goes down first ("evict": only then). An entry is known to be in the store only once the
  store said stored or exists (or a read of it was a hit): a put that failed, found the store
  full or was skipped is offered again the next time a finish publishes it or the host tier
  drops it — at most OFFERS times an entry (a put skipped while the breaker is open is not
  offered, so an outage costs no tries).
- Up. `prefetch` walks device → host → store along the prompt's page keys: when the store can
  extend the match to a deeper resume point than the two tiers above have, the pages (and the
  resume point) come into claimed host slots — zero-copy from Mooncake — and the host tier's
  own restore brings them to the device, so a restore reads exactly what the host path reads.
  An existence check is only a hint: an entry is used only when its read is a hit (size,
  header, checksum), and the chain stops at the first miss. The check and the read share one
  deadline: a prefetch waits on the store at most `deadline_s` in all.
- Off the serving path. Puts never wait; a read waits at most the tier's deadline, and a store
  that is down or slow opens the breaker: misses (`tier_unavailable`) until it is back. A read
  that missed its deadline keeps its host slots claimed until it lands (never reused under it).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

import numpy as np

from ...errors import ConfigError, PoolExhaustedError
from ...planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES
from ..index import CheckpointAt, Claim
from ..prefix_link import HostLink
from .store import EXISTS, STORED
from .tier import Entry

POLICIES = ("finish", "evict")
_KNOWN_MEMORY = 1 << 20      # keys remembered as in the store (a hint: puts of them are skipped)
OFFERS = 3                   # puts of one entry the store may refuse (full, failed) before it is given up
_GROUP = {"page": HOST_PAGES, "checkpoint": HOST_CHECKPOINTS}
_KIND = {HOST_PAGES: "page", HOST_CHECKPOINTS: "checkpoint"}


def _split(claim: Claim, n: int) -> tuple[Claim, Claim]:
    return (Claim(kind=claim.kind, keys=claim.keys[:n], slots=claim.slots[:n]),
            Claim(kind=claim.kind, keys=claim.keys[n:], slots=claim.slots[n:]))


class SharedLink(HostLink):
    def __init__(self, prefix, tier, shared, *, policy: str = "finish", outbox=None) -> None:
        if policy not in POLICIES:
            raise ConfigError("policy", f"{policy!r} is not a shared-tier policy", f"use one of {', '.join(POLICIES)}")
        super().__init__(prefix, tier)
        self.shared, self.policy, self.outbox = shared, policy, outbox
        self.bytes = tier.memory_backed
        if self.bytes and outbox is None:
            raise ConfigError("outbox", "a host tier with memory needs an outbox", "give outbox_bytes")
        self.known: OrderedDict = OrderedDict()
        self._pending: set = set()        # (kind, key) queued, not landed yet
        self._refused: OrderedDict = OrderedDict()   # (kind, key) -> puts the store refused
        self._landed: deque = deque()     # (kind, key, outcome) from the tier's poll, any thread
        self._quarantine: list = []      # (read still landing, claims it writes into)
        self._fetched: set = set()       # page keys the last prefetch brought from the store
        self.shared_hit_requests = 0     # (the tokens: PrefixStats.shared_hit_tokens, counted at admission)
        tier.on_victims = self._on_victims
        if policy == "finish":
            prefix.publisher = self

    # ---------------------------------------------------------------- down
    def _remember(self, keys) -> None:
        for k in keys:
            self.known[k] = None
            self.known.move_to_end(k)
            self._refused.pop(k, None)
        while len(self.known) > _KNOWN_MEMORY:
            self.known.popitem(last=False)

    def _on_landed(self, entries, outcomes) -> None:
        """The store's word on a put (called by the tier's poll, on whichever thread polled)."""
        self._landed.extend((e.kind, e.page_key, o) for e, o in zip(entries, outcomes))

    def _settle(self) -> None:
        """Take in what the puts that landed since said: stored or exists is known, anything else
        (full, failed) may be offered again."""
        self.shared.poll()
        while self._landed:
            kind, key, outcome = self._landed.popleft()
            k = (kind, key)
            self._pending.discard(k)
            if outcome in (STORED, EXISTS):
                self._remember([k])
            else:
                self._refused[k] = self._refused.pop(k, 0) + 1
                while len(self._refused) > _KNOWN_MEMORY:
                    self._refused.popitem(last=False)

    def _offer(self, kind: str, key) -> bool:
        """Whether to put this entry now: not known, not in flight, not refused OFFERS times."""
        k = (kind, key)
        return k not in self.known and k not in self._pending and self._refused.get(k, 0) < OFFERS

    def _put(self, group: str, keys: list, boundaries: list, stage) -> None:
        """Put entries; `stage(units)` fills outbox units with their bytes (returns a Transfer
        to wait for, or None). Entries with no outbox unit free are skipped."""
        kind = _KIND[group]
        if not self.bytes:
            if self.shared.put([Entry(kind, k, b) for k, b in zip(keys, boundaries)], landed=self._on_landed):
                self._pending.update((kind, k) for k in keys)
            return
        units = self.outbox.take(group, len(keys))
        for _ in keys[len(units):]:
            self.shared.c.puts[kind]["skipped"] += 1
        if not units:
            return
        keys, boundaries = keys[:len(units)], boundaries[:len(units)]
        t = stage(np.array(units, np.int64))
        if t is not None:
            t.synchronize()   # (a device-to-host copy on the copy stream: the store reads after it)
        entries = [Entry(kind, k, b, self.outbox.parts(group, u)) for k, b, u in zip(keys, boundaries, units)]
        if self.shared.put(entries, release=lambda: self.outbox.give(group, units), landed=self._on_landed):
            self._pending.update((kind, k) for k in keys)

    def _on_victims(self, group: str, keys, slots) -> None:
        """The host LRU is about to drop these (their bytes still in `slots`)."""
        kind = _KIND[group]
        self._settle()
        pick = [i for i, k in enumerate(keys) if self._offer(kind, k) and (kind == "page" or k in self.boundary)]
        if not pick:
            return
        ks = [keys[i] for i in pick]
        bs = [self.boundary[k] if kind == "checkpoint" else 0 for k in ks]
        host = self.tier

        def stage(units):
            for u, i in zip(units.tolist(), pick):
                for dst, src in zip(self.outbox.parts(group, u), host.entry_parts(group, int(slots[i]))):
                    dst[:] = src
            return None
        self._put(group, ks, bs, stage)

    def on_publish(self, nodes, placed) -> None:
        """A finish cached these pages and resume points (`placed`: the ones it placed; every
        resume point on its path is offered, so one whose put did not land goes again): write
        them through."""
        self._settle()
        tree = self.prefix.tree
        pages = [n for n in nodes if tree.page_of(n) > 0 and self._offer("page", int(tree.key[n]))]
        if pages:
            dev = tree.pages_of(pages)
            self._put(HOST_PAGES, [int(tree.key[n]) for n in pages], [0] * len(pages),
                      lambda units: self.tier.copy_out(HOST_PAGES, self.outbox.memory, units, dev[:len(units)]))
        cks = [tree.ckpt[n] for n in nodes if tree.ckpt[n] is not None and tree.ckpt[n].unit > 0
               and self._offer("checkpoint", int(tree.key[n]))]
        if cks:
            at = [CheckpointAt(swa_pages=tuple(np.asarray(ck.swa_pages).tolist()), unit=ck.unit) for ck in cks]
            self._put(HOST_CHECKPOINTS, [int(tree.key[ck.node]) for ck in cks], [ck.boundary_tokens for ck in cks],
                      lambda units: self.tier.copy_out(HOST_CHECKPOINTS, self.outbox.memory, units, at[:len(units)]))

    # ---------------------------------------------------------------- up
    def _retire_quarantine(self) -> None:
        left = []
        for fut, claims in self._quarantine:
            if fut.done():
                for c in claims:
                    self.tier.release_claim(c)
            else:
                left.append((fut, claims))
        self._quarantine = left

    def _has_checkpoint(self, keys, path, j: int) -> bool:
        key = int(keys[j - 1])
        return (j <= len(path) and self.prefix.tree.ckpt[path[j - 1]] is not None) or self.tier.contains("checkpoint", key)

    def _below(self, keys, path, host: int, cap: int) -> int:
        self._settle()
        end_s = time.monotonic() + self.shared.deadline_s    # one deadline: the lookup and the read
        self._retire_quarantine()
        self._fetched = set()
        best = next((j for j in range(host, 0, -1) if self._has_checkpoint(keys, path, j)), 0)
        if host >= cap and best == host:
            return host
        pages = [Entry("page", int(k), 0) for k in keys[host:cap]]
        cks = [Entry("checkpoint", int(keys[j - 1]), j * self.P) for j in range(best + 1, cap + 1)
               if not self._has_checkpoint(keys, path, j)]
        have = self.shared.exists(pages + cks, end_s)
        if have is None:
            return host
        run = host + next((i for i, h in enumerate(have[:len(pages)]) if not h), len(pages))
        if run < cap:
            self.shared.miss("page", "absent")   # the chain stops here (one lookup, one miss)
        in_store = {e.page_key for e, h in zip(cks, have[len(pages):]) if h}
        j = next((j for j in range(run, best, -1) if int(keys[j - 1]) in in_store
                  or self._has_checkpoint(keys, path, j)), None)
        if j is None:
            return host
        ck = next((e for e in cks if e.boundary_tokens == j * self.P and e.page_key in in_store), None)
        return self._fetch(keys, len(path), host, j, ck, end_s)

    def _reserve(self, kind: str, keys: list):
        if not keys:
            return None
        claim, evicted = self.tier.reserve(kind, keys)
        for k in evicted:
            if kind == "page":
                self._forget_page(k)
            else:
                self.boundary.pop(k, None)
        return claim

    def _fetch(self, keys, device: int, host: int, j: int, ck, end_s: float) -> int:
        """Read pages keys[host:j] (and resume point `ck`) into host slots; the new host depth."""
        ks = [int(k) for k in keys[host:j]]
        self.tier.touch("page", [int(k) for k in keys[device:host]])   # the reservation must not drop them
        try:
            pc = self._reserve("page", ks)
            cc = self._reserve("checkpoint", [ck.page_key] if ck is not None else [])
        except PoolExhaustedError:
            return host
        entries = [Entry("page", k, 0, self.tier.entry_parts(HOST_PAGES, int(s)) if self.bytes else ())
                   for k, s in zip(ks, pc.slots if pc is not None else [])]
        if cc is not None:
            entries.append(Entry("checkpoint", ck.page_key, ck.boundary_tokens,
                                 self.tier.entry_parts(HOST_CHECKPOINTS, int(cc.slots[0])) if self.bytes else ()))
        got = self.shared.get(entries, end_s)
        claims = [c for c in (pc, cc) if c is not None]
        if got.landing is not None:
            self._quarantine.append((got.landing, claims))
            return host
        m = next((i for i, r in enumerate(got.reasons[:len(ks)]) if r is not None), len(ks))
        parent = int(keys[host - 1]) if host else 0
        if host and not (self.tier.contains("page", parent) or parent in self.prefix.tree.index):
            m = 0                                 # its parent left host memory meanwhile
        if pc is not None:
            use, drop = _split(pc, m)
            self.tier.adopt(use)
            self.tier.release_claim(drop)
            for k in ks[:m]:
                self.parent[k] = parent
                self.children.setdefault(parent, set()).add(k)
                parent = k
            self._fetched = set(ks[:m])
            self._remember(("page", k) for k in ks[:m])
        if cc is not None:
            if got.reasons[-1] is None and host + m >= j:
                self.tier.adopt(cc)
                self.boundary[ck.page_key] = ck.boundary_tokens
                self._remember([("checkpoint", ck.page_key)])
                self._fetched.add(("checkpoint", ck.page_key))
            else:
                self.tier.release_claim(cc)
        return host + m

    def _origin(self, key) -> str:
        return "shared" if key in self._fetched else "host"

    def _count_hit(self, keys, pages: int) -> None:
        shared = sum(1 for k in keys if k in self._fetched)
        if shared:   # (a resume point alone restores no token from the store: not a hit request)
            self.shared_hit_requests += 1
            self.shared.hit_requests = self.shared_hit_requests
        if pages > shared:
            super()._count_hit(keys, pages - shared)
        self._fetched = set()

    def _no_hit(self) -> None:
        self._fetched = set()

    # ---------------------------------------------------------------- reports
    def shared_snapshot(self):
        from dataclasses import replace
        snap = replace(self.shared.snapshot(), hit_tokens=self.prefix.stats.shared_hit_tokens)
        if self.outbox is not None:
            snap = replace(snap, outbox_bytes=self.outbox.nbytes)
        return snap

    def close(self) -> None:
        self.prefix.publisher = None
        self.tier.on_victims = None
        self.shared.close()
        super().close()
        if self.outbox is not None:
            self.outbox.close()
