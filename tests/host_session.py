"""A random session of device pages and checkpoints moving to the host tier and back, checked
against a model: every restored entry must equal, byte for byte, what was on the device when it
was evicted. Shared by the CPU tests and the GPU tests (same code, real pinned memory there)."""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from kvatlas.tiers import CheckpointAt


def as_bytes(t):
    return t.contiguous().view(torch.uint8).cpu().clone()   # never an alias of live memory


class Session:
    """Device units are handed out and given back here (the prefix cache's job in production)."""

    def __init__(self, cache, tier, seed: int) -> None:
        self.cache, self.tier, self.rng = cache, tier, random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        plan = cache.plan
        self.free_pages = list(range(1, plan.num_full_pages))
        self.free_swa = list(range(1, plan.num_swa_pages))
        # checkpoint rows live in request slots, or (prefix cache) in checkpoint units
        units = [cache.arena.regions[s.buffer].spec.units for n, s in tier.plan.sources.items()
                 if n.startswith("checkpoint.") and cache.arena.regions[s.buffer].spec.group != "swa_pages"]
        self.free_slots = list(range(1, min(units, default=plan.num_request_slots)))
        self.page_buffers = [b.name for b in tier.plan.group_buffers("host_pages")]
        self.expected: dict = {}                # key -> expected bytes per part
        self.host_lru = {"page": OrderedDict(), "checkpoint": OrderedDict()}   # the model's LRU
        self.on_device: dict = {}               # key -> where it lives on the device now
        self.ring = {s.buffer: cache.arena.regions[s.buffer].spec.entries_per_unit
                     for s in tier.plan.sources.values() if s.rows}
        self.rows = max((s.rows for s in tier.plan.sources.values() if s.rows), default=0)
        self.next_key = 0

    # ---------------------------------------------------------------- device side
    def _fill(self, tensor) -> None:
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=self.gen).to(raw.device))

    def _page_parts(self, page: int) -> dict:
        regions = self.cache.arena.regions
        return {b: regions[b].tensor[page] for b in self.page_buffers}

    def _ckpt_parts(self, at: CheckpointAt) -> dict:
        regions, out = self.cache.arena.regions, {}
        for name, src in self.tier.plan.sources.items():
            if not name.startswith("checkpoint."):
                continue
            t = regions[src.buffer].tensor
            if src.rows:
                out[name] = t[at.unit, :, at.first_row:at.first_row + src.rows]
            elif regions[src.buffer].spec.group == "swa_pages":
                for j, page in enumerate(at.swa_pages):
                    out[f"{name}[{j}]"] = t[page]
            else:
                out[name] = t[at.unit]
        return out

    def new_page(self) -> None:
        if not self.free_pages:
            return
        page = self.free_pages.pop(self.rng.randrange(len(self.free_pages)))
        for t in self._page_parts(page).values():
            self._fill(t)
        key = ("p", self.next_key)
        self.next_key += 1
        self.expected[key] = {n: as_bytes(t) for n, t in self._page_parts(page).items()}
        self.on_device[key] = page

    def _new_at(self):
        tail = max((s.device_units for s in self.tier.plan.sources.values() if s.device_units > 1), default=0)
        if len(self.free_swa) < tail or not self.free_slots:
            return None
        swa = tuple(self.free_swa.pop(self.rng.randrange(len(self.free_swa))) for _ in range(tail))
        unit = self.free_slots.pop(self.rng.randrange(len(self.free_slots)))
        # the resume rows of boundary b start at ring row (b - rows) % ring: a multiple of 4 for C4
        first = self.rng.randrange(0, min(self.ring.values()) - self.rows + 1, 4) if self.rows else 0
        return CheckpointAt(swa_pages=swa, unit=unit, first_row=first)

    def new_checkpoint(self) -> None:
        at = self._new_at()
        if at is None:
            return
        for t in self._ckpt_parts(at).values():
            self._fill(t)
        key = ("c", self.next_key)
        self.next_key += 1
        self.expected[key] = {n: as_bytes(t) for n, t in self._ckpt_parts(at).items()}
        self.on_device[key] = at

    def _give_back(self, where) -> None:
        if isinstance(where, CheckpointAt):
            self.free_swa += list(where.swa_pages)
            self.free_slots.append(where.unit)
        else:
            self.free_pages.append(where)

    # ---------------------------------------------------------------- host moves
    def offload(self, kind: str) -> None:
        keys = [k for k, w in self.on_device.items() if isinstance(w, CheckpointAt) == (kind == "checkpoint")]
        if not keys:
            return
        units = self.tier.slots["host_pages" if kind == "page" else "host_checkpoints"].units
        keys = self.rng.sample(keys, self.rng.randint(1, min(len(keys), 6, units)))
        where = [self.on_device.pop(k) for k in keys]
        if kind == "page":
            moved = self.tier.offload_pages(keys, where)
        else:
            moved = self.tier.offload_checkpoints(keys, where)
        lru = self.host_lru[kind]
        short = len(lru) + len(keys) - units
        expect_evicted = list(lru)[:max(short, 0)]
        assert list(moved.evicted) == expect_evicted
        for k in expect_evicted:
            del lru[k]
            del self.expected[k]
        for k in keys:
            lru[k] = True
        for w in where:    # the device units are reused at once: scribble over them
            self._give_back(w)
            parts = self._ckpt_parts(w) if isinstance(w, CheckpointAt) else self._page_parts(w)
            for t in parts.values():
                t.view(torch.uint8).fill_(0xA5)

    def restore(self, kind: str) -> None:
        lru = self.host_lru[kind]
        if not lru:
            return
        keys = self.rng.sample(list(lru), self.rng.randint(1, min(len(lru), 6)))
        if kind == "page":
            if len(self.free_pages) < len(keys):
                return
            where = [self.free_pages.pop(self.rng.randrange(len(self.free_pages))) for _ in keys]
            transfer = self.tier.restore_pages(keys, where)
        else:
            where = []
            for _ in keys:
                at = self._new_at()
                if at is None:
                    for w in where:
                        self._give_back(w)
                    return
                where.append(at)
            transfer = self.tier.restore_checkpoints(keys, where)
        transfer.synchronize()
        assert transfer.done()
        for k, w in zip(keys, where):
            del lru[k]
            self.on_device[k] = w
            parts = self._ckpt_parts(w) if isinstance(w, CheckpointAt) else self._page_parts(w)
            for n, t in parts.items():
                assert torch.equal(as_bytes(t), self.expected[k][n]), f"{k} {n} differs after restore"

    def touch(self, kind: str) -> None:
        lru = self.host_lru[kind]
        if lru:
            k = self.rng.choice(list(lru))
            self.tier.touch(kind, [k])
            lru.move_to_end(k)

    def step(self) -> None:
        op = self.rng.choice(["new_page", "new_page", "new_page", "new_checkpoint", "new_checkpoint",
                              "offload", "offload", "offload", "offload", "restore", "restore", "touch"])
        kind = self.rng.choice(["page", "page", "checkpoint"])
        getattr(self, op)(*(() if op.startswith("new") else (kind,)))
        snap = self.tier.check_integrity()
        assert snap.groups["pages"].units_used == len(self.host_lru["page"])
        assert snap.groups["checkpoints"].units_used == len(self.host_lru["checkpoint"])
        assert self.tier.resident("page") == list(self.host_lru["page"])
