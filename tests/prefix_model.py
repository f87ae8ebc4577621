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
        return self.reads_many([request_id])[request_id]

    def reads_many(self, request_ids) -> dict:
        """reads() of several requests, one gather per pool for them all (a check after every
        operation of a many-request session pays the data path's per-call cost once)."""
        c, a = self.cache, self.cache.allocator
        slots = [a.slot_of[r] for r in request_ids]
        lens = [int(a.length[s]) for s in slots]
        out = {r: {} for r in request_ids}
        swa_idx, kv_idx = [], {name: [] for name in self.RATIO}
        for slot, L in zip(slots, lens):
            p = np.arange(max(0, L - (a.window - 1)), L)
            swa_idx.append(a.swa_table[slot, (p // a.Ps) % a.ring] * a.Ps + p % a.Ps)
            for name, ratio in self.RATIO.items():
                e, per = np.arange(L // ratio), a.P // ratio
                kv_idx[name].append(a.full_table[slot, e // per] * per + e % per)
        self._split(out, "swa", "swa_kv", swa_idx)
        for name, ratio in self.RATIO.items():
            if name not in c.pools:
                continue
            self._split(out, self.TARGET[name], self.TARGET[name], kv_idx[name])
            state, ring = c.pools[name], c.pools[name].ring_rows
            for r, slot, L in zip(request_ids, slots, lens):
                start = max(0, L // ratio * ratio - (ratio if ratio == 4 else 0))
                out[r][name] = state.tensor[slot][:, [q % ring for q in range(start, L)]].clone()
        return out

    def _split(self, out, key, pool, per_request) -> None:
        p = self.cache.pools[pool]
        got = gather(self.geom[pool], p.tensor, range(len(p.layers)),
                     torch.as_tensor(np.concatenate(per_request).astype(np.int64), device=self.cache.device),
                     impl=self.impl)
        at = 0
        for r, idx in zip(out, per_request):
            out[r][key] = got[:, at:at + len(idx)]
            at += len(idx)


def assert_same_reads(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k in got:
        assert got[k].shape == want[k].shape, f"{where}: {k} shape {got[k].shape} != {want[k].shape}"
        assert torch.equal(got[k], want[k]), f"{where}: {k} differs"
