"""A stand-in model for prefix-cache exactness tests: every token's kv/score rows are a fixed
function of the token ids up to it (a prefix hash), so equal prefixes give equal rows, and a
cache that reads a stale or foreign row is caught. `Model.write` turns a WriteIndices into real
stores through kvatlas.datapath (SWA rows, compressor rings, compressed KV and indexer entries,
checkpoint rows); `Model.reads` reads back what the next token of a request reads."""

from __future__ import annotations

import numpy as np
import torch

from kvatlas.datapath import PageGeometry, compress_batch, gather, store
from kvatlas.datapath.compressor import CompressorSpec, state_rows
from kvatlas.driving.simwrite import _row_format

BANK = 997


def prefix_hashes(token_ids, seed: int = 17) -> np.ndarray:
    """h_p depends on tokens 0..p (and the seed: the hash before them): the identity of a row."""
    out, h = np.empty(len(token_ids), np.int64), seed
    for i, t in enumerate(token_ids):
        h = (h * 1000003 + int(t) + 7) % (1 << 61)
        out[i] = h
    return out


class Model:
    RATIO = {"c4_state": 4, "c4_indexer_state": 4, "c128_state": 128}
    TARGET = {"c4_state": "c4_kv", "c4_indexer_state": "c4_indexer", "c128_state": "c128_kv"}

    def __init__(self, cache, impl="torch") -> None:
        self.cache, self.impl = cache, impl
        g = torch.Generator().manual_seed(1)
        dev = cache.device
        self.banks = {w: (torch.randn(BANK, w, generator=g) * 2).to(dev) for w in (128, 256, 512, 1024)}
        self.geom = {n: PageGeometry(_row_format(cache.plan, p.spec), p.spec.entries_per_unit)
                     for n, p in cache.pools.items() if p.role in ("kv", "indexer")}

    def rows(self, width, hashes, salt):
        key = torch.as_tensor((hashes * 31 + salt) % BANK, device=self.cache.device)
        return self.banks[width].index_select(0, key)

    def write(self, idx, hashes) -> None:
        if idx.num_tokens == 0:
            return
        c, dev = self.cache, self.cache.device
        pos = torch.as_tensor(idx.positions, device=dev)
        req = torch.as_tensor(idx.request_slots, device=dev)
        swa = c.pools["swa_kv"]
        vals = torch.stack([self.rows(512, hashes, li).to(torch.bfloat16) for li in range(len(swa.layers))])
        store(self.geom["swa_kv"], swa.tensor, range(len(swa.layers)), torch.as_tensor(idx.swa_slots, device=dev),
              vals, impl=self.impl)
        for name, ratio in self.RATIO.items():
            if name in c.pools:
                self._compress(name, ratio, idx, hashes, pos, req)

    def _compress(self, name, ratio, idx, hashes, pos, req) -> None:
        c = self.cache
        state, target = c.pools[name], c.pools[self.TARGET[name]]
        spec = CompressorSpec.for_state(state.tensor, ratio)
        cd = spec.coff * spec.head_dim
        mask, entry = idx.compressed[ratio]
        ckpt = idx.checkpoint_rows.get(f"ckpt.{name}")
        for li in range(len(state.layers)):
            salt = 1000 * (li + 1) + ratio + cd
            kv, sc = self.rows(cd, hashes, salt), self.rows(cd, hashes, salt + 1)
            blocks = compress_batch(state.tensor, li, req, pos, kv, sc, ratio=ratio, impl=self.impl)
            if mask.any():
                store(self.geom[target.name], target.tensor, li, torch.as_tensor(entry[mask], device=c.device),
                      blocks.entries.to(torch.bfloat16), impl=self.impl)
            if ckpt is not None and len(ckpt[0]):
                tok, dest = (torch.as_tensor(a, device=c.device) for a in ckpt)
                rows = c.pools[f"ckpt.{name}"].tensor
                k = rows.shape[2]
                rows[dest // k, li, dest % k] = state_rows(spec, kv[tok], sc[tok], pos[tok], None, rows.dtype)

    def reads(self, request_id) -> dict:
        """What the next token of the request reads, pool by pool (bytes as the pools decode them)."""
        c, a = self.cache, self.cache.allocator
        slot = a.slot_of[request_id]
        L = int(a.length[slot])
        out = {}
        lo = max(0, L - (a.window - 1))
        p = np.arange(lo, L)
        pages = a.swa_table[slot, (p // a.Ps) % a.ring]
        swa = c.pools["swa_kv"]
        out["swa"] = gather(self.geom["swa_kv"], swa.tensor, range(len(swa.layers)),
                            torch.as_tensor(pages * a.Ps + p % a.Ps, device=c.device), impl=self.impl)
        for name, ratio in self.RATIO.items():
            if name not in c.pools:
                continue
            target = c.pools[self.TARGET[name]]
            e = np.arange(L // ratio)
            per = a.P // ratio
            slots = a.full_table[slot, e // per] * per + e % per
            out[target.name] = gather(self.geom[target.name], target.tensor, range(len(target.layers)),
                                      torch.as_tensor(slots, device=c.device), impl=self.impl)
            state = c.pools[name]
            start = max(0, L // ratio * ratio - (ratio if ratio == 4 else 0))
            ring = state.ring_rows
            out[name] = state.tensor[slot][:, [q % ring for q in range(start, L)]].clone()
        return out


def assert_same_reads(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k in got:
        assert got[k].shape == want[k].shape, f"{where}: {k} shape {got[k].shape} != {want[k].shape}"
        assert torch.equal(got[k], want[k]), f"{where}: {k} differs"
