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


class Staging:
    """Pinned host memory the index copies go through on CUDA. A copy from pageable memory makes
    the stream wait for all the work queued before it, and the model runs launch-bound, its host
    well ahead of the device: one such wait a pass lets the device run dry. From pinned memory the
    copy is queued like a kernel. Buffers are taken in turn, each reused once the event of its last
    copy has passed (copies of passes long over, in practice: a pass makes one, up to five when
    what is kept between passes is made again)."""

    RING = 8

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.hosts = [torch.empty(0, dtype=torch.int64) for _ in range(self.RING)]
        self.done: list = [None] * self.RING   # each buffer's event, made once, recorded at each copy
        self.next = 0

    def to_device(self, flat: np.ndarray) -> torch.Tensor:
        if not self.cuda:
            return torch.from_numpy(flat).to(self.device)
        i = self.next
        self.next = (i + 1) % self.RING
        if self.done[i] is not None:
            self.done[i].synchronize()
        if self.hosts[i].numel() < flat.size:
            self.hosts[i] = torch.empty(max(flat.size, 2 * self.hosts[i].numel()), dtype=torch.int64, pin_memory=True)
        host = self.hosts[i][: flat.size]
        host.numpy()[:] = flat
        out = host.to(self.device, non_blocking=True)
        if self.done[i] is None:
            self.done[i] = torch.cuda.Event()
        self.done[i].record()
        return out


class _Packer:
    """Index arrays gathered on the host, moved to the device in one copy, handed out as views."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def add(self, a) -> int:
        self.parts.append(np.ascontiguousarray(a, dtype=np.int64))
        return len(self.parts) - 1

    def device(self, staging: Staging) -> list[torch.Tensor]:
        flat = np.concatenate([p.ravel() for p in self.parts]) if self.parts else np.zeros(0, np.int64)
        flat = staging.to_device(flat)
        out, at = [], 0
        for p in self.parts:
            part = flat[at:at + p.size]
            out.append(part if p.ndim == 1 else part.view(p.shape))
            at += p.size
        return out


@dataclass(slots=True)
class Where:
    """Entries to write: their slots (for store), and the same split into (page, offset in the
    page) (for a raw format's entries_view)."""
    slots: torch.Tensor
    at: tuple


class Span:
    """Entries to read, per row: `count` consecutive ones, `start` entries into the pages `pages`
    ([B, n], in the row's order; a raw format's view reads the whole pages in one index_select and
    keeps the span). Their slots are columns `first` .. `first + count - 1` of `table` ([B, N]):
    `slots` ([B, count]) for gather, `flat` the same in one dimension. Each is made when first
    asked for (a pass's layers ask for one kind, and a decode step's host time is what the model
    waits on); `row` is table[0] when kept, `per` the entries a page when `pages` are all of the
    row's (then only those the span reaches are read)."""

    __slots__ = ("B", "start", "count", "table", "first", "row", "per", "_pages", "_slots", "_flat")

    def __init__(self, pages, start: int, count: int, table, first: int = 0, row=None, per: int = 0) -> None:
        self.B, self.start, self.count = table.shape[0], start, count
        self.table, self.first, self.row, self.per = table, first, row, per
        self._pages = pages
        self._slots = self._flat = None

    @property
    def slots(self) -> torch.Tensor:
        if self._slots is None:
            f = self.first
            t = self.table
            self._slots = t if f == 0 and t.shape[1] == self.count else t[:, f: f + self.count]
        return self._slots

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = self.slots.reshape(-1) if self.row is None else self.row[self.first: self.first + self.count]
        return self._flat

    @property
    def pages(self) -> torch.Tensor:
        if self.per:
            self._pages, self.per = self._pages[:, : -(-(self.start + self.count) // self.per)], 0
        return self._pages


def _where(pk: _Packer, slots: np.ndarray, per_page: int) -> tuple:
    return pk.add(slots), pk.add(slots // per_page), pk.add(slots % per_page)


def _column(t: torch.Tensor, j: int) -> torch.Tensor:
    """Column j of [B, n] as a contiguous [B] (a view for one row)."""
    return t[:, j] if t.shape[0] == 1 else t[:, j].contiguous()


def _made(t: list, ids: tuple) -> Where:
    return Where(t[ids[0]], (t[ids[1]], t[ids[2]]))


@dataclass(slots=True)
class RingRows:
    """Rows of one ring size: (slot column [B, 1], ring rows [n]) index pairs, broadcast to [B, n]
    (or, for one row's decode step, (slot slice, rows slice): views)."""
    buffer: tuple            # the L0 % r tokens since the last window
    overlap: tuple | None    # ratio 4: the block before that window (None at its first window)
    write: tuple | None      # the last min(S, ring) tokens of the pass: their rows are (over)written (None with `one`)
    write_from: int          # the token offset (0..S-1) of the first of those
    one: tuple | None = None  # one bound row writing one token (a decode step): (slot, ring row) as ints


class Kept(dict):
    """Tensors kept between passes (index tensors on the device, a slot's ring-row views), for the
    last few sets of bound rows (a serving loop runs its requests in turn, one pass each): at most
    `most`, the oldest dropped."""

    def __init__(self, most: int = 64) -> None:
        super().__init__()
        self.most = most

    def keep(self, key, value):
        if len(self) >= self.most:
            del self[next(iter(self))]
        self[key] = value
        return value


def _page_slots(pages: np.ndarray, per: int, staging: Staging) -> tuple:
    """Pages [B, n], the slots of every entry in them, [B, n * per], on the device (one copy),
    and that table's first row when B is 1 (else None)."""
    pk = _Packer()
    ids = pk.add(pages), pk.add((pages[:, :, None] * per + np.arange(per)).reshape(len(pages), -1))
    t = pk.device(staging)
    table = t[ids[1]]
    return t[ids[0]], table, table[0] if len(pages) == 1 else None


class EntrySlots:
    """The slots of every compressed entry of the bound rows' held pages, on the device, kept
    between passes: a request's pages only grow (a page every 256 tokens), so most passes read a
    prefix of the same tensor instead of making and copying tens of thousands of slots (a 256K
    context has 65,536 C4 entries). Made again when pages are added or requests come or go."""

    def __init__(self) -> None:
        self.kept = Kept()

    def read(self, kv, slots: np.ndarray, r: int, count: int, staging: Staging) -> Span:
        a = kv.allocator
        if len(slots) == 1:   # one request (scalars: a decode step's host time is what the model waits on)
            s = int(slots[0])
            key, valid = (s, r), (a.epoch, int(a.full_held[s]))
        else:
            key, valid = (slots.tobytes(), r), (a.epoch, a.full_held[slots].tobytes())
        per = a.P // r
        got = self.kept.get(key)
        if got is None or got[0] != valid:
            pages = a.full_table[slots, : int(a.full_held[slots].max(initial=0))]
            got = self.kept.keep(key, (valid, *_page_slots(pages, per, staging)))
        _, pages, table, row = got
        return Span(pages, 0, count, table, 0, row, per)


class SwaSlots:
    """The slots of every entry of the SWA pages a decode step reads, on the device, kept between
    passes and keyed by those pages: the window moves a token a step but its pages change once
    every `swa_page_tokens`, so a decode step takes its read span, and the slot it writes, as
    slices of the same tensor. Also a small arange on the device, for in-page offsets."""

    def __init__(self) -> None:
        self.kept = Kept()
        self.ar: torch.Tensor | None = None

    def table(self, a, slots: np.ndarray, first: int, last: int, staging: Staging):
        """The SWA pages first .. last (logical) of the rows `slots`, and their entries' slots."""
        if len(slots) == 1:
            s = int(slots[0])
            key = (a.Ps, *(int(a.swa_table[s, j % a.ring]) for j in range(first, last + 1)))
            got = self.kept.get(key)
            if got is None:
                got = self.kept.keep(key, _page_slots(np.array([key[1:]], np.int64), a.Ps, staging))
            return got
        pages = a.swa_table[slots[:, None], np.arange(first, last + 1) % a.ring]
        key = (pages.shape, a.Ps, pages.tobytes())
        got = self.kept.get(key)
        if got is None:
            got = self.kept.keep(key, _page_slots(pages, a.Ps, staging))
        return got

    def offsets(self, n: int, staging: Staging) -> torch.Tensor:
        if self.ar is None or self.ar.numel() < n:
            self.ar = staging.to_device(np.arange(max(n, 256), dtype=np.int64)).clone()
        return self.ar


# set by tests: a decode pass's derived indices are checked against the allocator's own
CHECK_DECODE = False


class Pass:
    """The indices of one pass. `tokens`: B * S; arrays over tokens are row-major (row b's S tokens
    together), as the allocator wrote them."""

    def __init__(self, kv, slots: np.ndarray, L0: int, S: int, w, entries: "EntrySlots", rings: "Rings",
                 staging: Staging, swa: "SwaSlots | None" = None) -> None:
        a = kv.allocator
        self.reads: dict = {}   # a group of layers' entries read at once (layers.Pooled), until its last layer takes its part
        self.B, self.S, self.L0, self.L1 = len(slots), S, L0, L0 + S
        self.new_counts = {r: self.L1 // r - L0 // r for r in a.ratios}   # windows the pass closes
        self.read_entries = {r: entries.read(kv, slots, r, self.L1 // r, staging) for r in a.ratios}
        self.rings = {(ring, r): rings.get(slots, L0, S, ring, r, staging) for ring, r in rings.kinds(kv)}
        if S == 1 and swa is not None and not w.checkpoint_rows and a.swa is not None:
            return self._decode(kv, slots, w, swa, staging)
        pk = _Packer()
        lo = max(0, L0 - (a.window - 1))   # the first key the pass's rows read
        read_pages, read_slots = self._swa_read(a, slots, lo)
        ids = {"swa_store": _where(pk, w.swa_slots, a.Ps), "swa_read": (pk.add(read_slots), pk.add(read_pages))}
        for r in a.ratios:
            if self.new_counts[r]:   # most decode steps close no window: nothing to index
                mask, entry = w.compressed[r]
                ids[("new", r)] = _where(pk, entry[mask], a.P // r)
        ckpt = {}
        for name, (tok, row) in w.checkpoint_rows.items():
            rows = kv.pools[name].spec.entries_per_unit
            ckpt[name] = (pk.add(tok), pk.add(row // rows), pk.add(row % rows))
        t = pk.device(staging)
        self._swa_store = _made(t, ids["swa_store"])
        sr = ids["swa_read"]
        self.swa_read = Span(t[sr[1]], lo % a.Ps, self.L1 - lo, t[sr[0]])
        self.new_entries = {r: _made(t, ids["new", r]) for r in a.ratios if ("new", r) in ids}
        self.checkpoints = {n: tuple(t[i] for i in v) for n, v in ckpt.items()}

    def _decode(self, kv, slots, w, swa, staging) -> None:
        """A decode step (one token a row, no resume-point rows to save): every index is a slice
        of tensors kept on the device (the SWA pages' slots, every compressed entry's slots), so
        a steady step copies nothing to the device. The slot each row writes is the last of its
        read span (made only if a layer asks: the fp8 SWA's one-launch step takes the span); a
        window that closes adds the last entry of the entries span."""
        a, B, L0, L1 = kv.allocator, self.B, self.L0, self.L1
        lo = max(0, L0 - (a.window - 1))
        first, last = lo // a.Ps, L0 // a.Ps
        pages, table, row = swa.table(a, slots, first, last, staging)
        start = lo - first * a.Ps
        ar = swa.offsets(max(a.Ps, a.P), staging)
        self.swa_read = Span(pages, start, L1 - lo, table, start, row)
        self._swa_store = None
        self._store = (table, pages, L0 - first * a.Ps, last - first, L0 % a.Ps, ar)
        self.new_entries = {}
        for r in a.ratios:
            if self.new_counts[r]:
                e, per, span = L1 // r - 1, a.P // r, self.read_entries[r]
                self.new_entries[r] = Where(_column(span.table, e), (_column(span._pages, e // per),
                                                                     ar[e % per].expand(B)))
        self.checkpoints = {}
        if CHECK_DECODE:
            self._check_decode(w)

    def _check_decode(self, w) -> None:
        """The derived slots equal the allocator's (tests)."""
        got = self.swa_store.slots.cpu().numpy()
        assert np.array_equal(got, w.swa_slots), (got, w.swa_slots)
        for r, (mask, entry) in w.compressed.items():
            want = entry[mask]
            have = self.new_entries[r].slots.cpu().numpy() if r in self.new_entries else np.zeros(0, np.int64)
            assert np.array_equal(have, want), (r, have, want)

    @property
    def swa_store(self) -> Where:
        """Where the pass's SWA rows go."""
        if self._swa_store is None:
            table, pages, at, page, offset, ar = self._store
            self._swa_store = Where(_column(table, at), (_column(pages, page), ar[offset].expand(self.B)))
        return self._swa_store

    @property
    def window_rows(self) -> int:
        """Keys each row reads in the SWA: the window before the pass and the pass's own."""
        return self.swa_read.count

    def _swa_read(self, a, slots, lo: int) -> tuple[np.ndarray, np.ndarray]:
        """The SWA pages holding positions lo .. L1 - 1 of each row, and those positions' slots."""
        first, last = lo // a.Ps, (self.L1 - 1) // a.Ps
        pages = a.swa_table[slots[:, None], np.arange(first, last + 1) % a.ring]
        pos = np.arange(lo, self.L1) - first * a.Ps
        return pages, pages[:, pos // a.Ps] * a.Ps + pos % a.Ps


class Rings:
    """The ring rows of a pass, kept between passes: they depend only on the bound rows, the
    pass's length and the position modulo the ring (once a ring has filled), so a decode step
    takes them from here instead of making and copying them again."""

    def __init__(self) -> None:
        # a steady decode keys one set of rows by its position in each ring: a C128 ring's 128
        # positions (and the C4 ring's) must fit, else every step of it is made and copied again
        self.kept = Kept(1024)
        self._kinds: list | None = None

    def kinds(self, kv) -> list:
        """(ring rows, ratio) of every ring the cache keeps: the C4 and C128 rings."""
        if self._kinds is None:
            seen = []
            for pool in kv.pools.values():
                if pool.role == "state":
                    key = (pool.ring_rows, 4 if pool.spec.layer_kind == "c4" else 128)
                    if key not in seen:
                        seen.append(key)
            self._kinds = seen
        return self._kinds

    def get(self, slots: np.ndarray, L0: int, S: int, ring: int, r: int, staging: Staging) -> RingRows:
        if S == 1 and len(slots) == 1 and ring % r == 0:
            return self._one(int(slots[0]), L0, ring, r)
        steady = L0 >= ring
        key = (int(slots[0]) if len(slots) == 1 else slots.tobytes(), ring, r, S, L0 % ring)
        if steady and key in self.kept:
            return self.kept[key]
        pk = _Packer()
        column = pk.add(slots[:, None])   # [B, 1]: indexing broadcasts it over each row's ring rows

        def rows(first: int, n: int):
            return column, pk.add(np.arange(first, first + n) % ring)
        fw = L0 - L0 % r   # the first position of the next window
        overlap = rows(fw - OVERLAP, OVERLAP) if r == OVERLAP and fw >= OVERLAP else None
        k = min(S, ring)
        b, w = rows(fw, L0 % r), rows(L0 + S - k, k)
        t = pk.device(staging)
        got = RingRows(buffer=(t[b[0]], t[b[1]]), overlap=None if overlap is None else (t[overlap[0]], t[overlap[1]]),
                       write=(t[w[0]], t[w[1]]), write_from=S - k)
        return self.kept.keep(key, got) if steady else got

    def _one(self, s: int, L0: int, ring: int, r: int) -> RingRows:
        """One row's decode step in a ring of whole windows: its ring rows are slices (views of
        the slot; nothing made or copied), since a run from a window's start, or the overlap block
        before it, never wraps then. The layer writes the step's token at `one`."""
        fw = L0 - L0 % r
        row = slice(s, s + 1)
        first = fw % ring
        overlap = (row, slice((fw - OVERLAP) % ring, (fw - OVERLAP) % ring + OVERLAP)) \
            if r == OVERLAP and fw >= OVERLAP else None
        return RingRows(buffer=(row, slice(first, first + L0 % r)), overlap=overlap, write=None, write_from=0,
                        one=(s, L0 % ring))
