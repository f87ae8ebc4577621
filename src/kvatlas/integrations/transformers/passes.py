"""One forward pass of the model over kvatlas requests: where its new rows go and what its layers
read back, made once per pass (numpy on the host, one copy to the device) and shared by every
layer. Nothing here imports transformers: it speaks kvatlas's allocator and pools only.

The model hands a cache, per layer and pass, B rows of S new tokens each (every row at the same
length L0: transformers' DeepSeek-V4 keeps one compression window position per layer for the whole
batch). What the layers read back, per row:
- the SWA keys of positions max(0, L0 - (window - 1)) .. L0 + S - 1 (the window before the pass
  and every new row, however long the chunk);
- every compressed entry so far, 0 .. (L0 + S) // r - 1, for each ratio r;
- from the compressor-state rings: the raw projections of the L0 % r tokens since the last
  window (the model's "buffer") and, for ratio 4, the 4 tokens of the block before that window
  (the overlap the next window reads). The rings keep each token's raw kv and gate, exactly as
  the model computed them; the overlap's position bias is added by the layer when it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

OVERLAP = 4   # the C4 window of 8 reads the 4 tokens of the block before it


class _Packer:
    """Index arrays gathered on the host, moved to the device in one copy, handed out as views."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, a) -> int:
        self.parts.append(np.ascontiguousarray(a, dtype=np.int64))
        return len(self.parts) - 1

    def device(self, dev) -> list[torch.Tensor]:
        flat = torch.from_numpy(np.concatenate([p.ravel() for p in self.parts]) if self.parts else
                                np.zeros(0, np.int64)).to(dev)
        out, at = [], 0
        for p in self.parts:
            out.append(flat[at:at + p.size].view(p.shape))
            at += p.size
        return out


@dataclass(slots=True)
class Where:
    """Entries of a paged pool: their slots (for store / gather), and the same split into (page,
    offset in the page) (for a raw format's entries_view)."""
    slots: torch.Tensor
    at: tuple

    def __getitem__(self, cols) -> "Where":
        return Where(self.slots[cols], (self.at[0][cols], self.at[1][cols]))


def _where(pk: _Packer, slots: np.ndarray, per_page: int) -> tuple:
    return pk.add(slots), pk.add(slots // per_page), pk.add(slots % per_page)


def _made(t: list, ids: tuple) -> Where:
    return Where(t[ids[0]], (t[ids[1]], t[ids[2]]))


@dataclass(slots=True)
class RingRows:
    """Rows of one ring size (per request slot: slot, row in its ring), as [B, n] index pairs."""
    buffer: tuple            # the L0 % r tokens since the last window
    overlap: tuple | None    # ratio 4: the block before that window (None at its first window)
    write: tuple             # the last min(S, ring) tokens of the pass: their rows are (over)written
    write_from: int          # the token offset (0..S-1) of the first of those


class EntrySlots:
    """The slots of every compressed entry of the bound rows' held pages, on the device, kept
    between passes: a request's pages only grow (a page every 256 tokens), so most passes read a
    prefix of the same tensor instead of making and copying tens of thousands of slots (a 256K
    context has 65,536 C4 entries). Made again when pages are added or requests come or go."""

    def __init__(self) -> None:
        self.key, self.held = None, {}

    def read(self, kv, slots: np.ndarray, r: int, count: int) -> Where:
        a = kv.allocator
        key = (a.epoch, slots.tobytes(), a.full_held[slots].tobytes())
        if key != self.key:
            self.key, self.held = key, {}
        if r not in self.held:
            per = a.P // r
            pages = a.full_table[slots, : int(a.full_held[slots].max(initial=0))]
            table = (pages[:, :, None] * per + np.arange(per)).reshape(len(slots), -1)
            pk = _Packer()
            ids = _where(pk, table, per)
            self.held[r] = _made(pk.device(kv.device), ids)
        return self.held[r][:, :count]


class Pass:
    """The indices of one pass. `tokens`: B * S; arrays over tokens are row-major (row b's S tokens
    together), as the allocator wrote them."""

    def __init__(self, kv, slots: np.ndarray, L0: int, S: int, w, entries: "EntrySlots") -> None:
        a = kv.allocator
        self.B, self.S, self.L0, self.L1 = len(slots), S, L0, L0 + S
        pk = _Packer()
        ids = {"swa_store": _where(pk, w.swa_slots, a.Ps), "swa_read": _where(pk, self._swa_read(a, slots), a.Ps)}
        self.new_counts = {}
        for r in a.ratios:
            mask, entry = w.compressed[r]
            ids[("new", r)] = _where(pk, entry[mask], a.P // r)
            self.new_counts[r] = self.L1 // r - L0 // r
        rings = {}
        for ring_rows, ratio in self._rings(kv):
            rings[ring_rows, ratio] = self._ring_rows(pk, slots, ring_rows, ratio)
        ckpt = {}
        for name, (tok, row) in w.checkpoint_rows.items():
            rows = kv.pools[name].spec.entries_per_unit
            ckpt[name] = (pk.add(tok), pk.add(row // rows), pk.add(row % rows))
        t = pk.device(kv.device)
        self.swa_store, self.swa_read = _made(t, ids["swa_store"]), _made(t, ids["swa_read"])
        self.new_entries = {r: _made(t, ids["new", r]) for r in a.ratios}
        self.read_entries = {r: entries.read(kv, slots, r, self.L1 // r) for r in a.ratios}
        self.rings = {k: RingRows(buffer=(t[b[0]], t[b[1]]), overlap=None if o is None else (t[o[0]], t[o[1]]),
                                  write=(t[wr[0]], t[wr[1]]), write_from=f)
                      for k, (b, o, wr, f) in rings.items()}
        self.checkpoints = {n: tuple(t[i] for i in v) for n, v in ckpt.items()}

    @property
    def window_rows(self) -> int:
        """Keys each row reads in the SWA: the window before the pass and the pass's own."""
        return self.swa_read.slots.shape[1]

    def _swa_read(self, a, slots) -> np.ndarray:
        pos = np.arange(max(0, self.L0 - (a.window - 1)), self.L1)
        pages = a.swa_table[slots[:, None], (pos // a.Ps) % a.ring]
        return pages * a.Ps + pos % a.Ps

    @staticmethod
    def _rings(kv):
        """(ring rows, ratio) of every ring the cache keeps: the C4 and C128 rings."""
        seen = []
        for pool in kv.pools.values():
            if pool.role == "state":
                key = (pool.ring_rows, 4 if pool.spec.layer_kind == "c4" else 128)
                if key not in seen:
                    seen.append(key)
        return seen

    def _ring_rows(self, pk, slots, ring: int, r: int):
        def rows(first: int, n: int):
            pos = np.arange(first, first + n)
            return pk.add(np.repeat(slots[:, None], n, 1)), pk.add(np.broadcast_to(pos % ring, (self.B, n)))
        m = self.L0 % r
        fw = self.L0 - m   # the first position of the next window
        overlap = rows(fw - OVERLAP, OVERLAP) if r == OVERLAP and fw >= OVERLAP else None
        k = min(self.S, ring)
        return rows(fw, m), overlap, rows(self.L1 - k, k), self.S - k
