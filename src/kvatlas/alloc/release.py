"""Taking pages back: rollback of rejected drafts, trimming past a request's length, finishing.

A mixin of Allocator (kvatlas.alloc.allocator), split out so each file stays readable: these
methods read and write the allocator's arrays and free lists exactly as its own methods do.
"""

from __future__ import annotations

import numpy as np

from ..planning.buffers import CHECKPOINTS, FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..errors import KvatlasError, RequestStateError
from ..units import cdiv


class Release:
    def rollback(self, request_id, num_tokens: int) -> None:
        """Drop the last num_tokens written (rejected drafts); they must come from the last write."""
        slot = int(self._slots([request_id])[0])
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) \
                or not 0 <= num_tokens <= self.last_write[slot]:
            raise KvatlasError(f"num_tokens: {num_tokens!r} is not within the last write of "
                               f"{int(self.last_write[slot])} tokens; roll back only rejected drafts, before "
                               "the next forward pass begins (the next step/extend or flush)")
        if num_tokens == 0:
            return
        self._writes += 1   # positions move back: no steady batch's schedule holds
        L1 = self.length[slot:slot + 1]
        L0 = L1 - num_tokens
        self._count_entries(L0, L1, int(num_tokens), sign=-1)
        self.length[slot] = L0[0]
        self.last_write[slot] -= num_tokens
        self._trim(slot)

    def _trim(self, slot: int) -> None:
        """Release pages beyond the request's length (after a rollback)."""
        L = int(self.length[slot])
        if self.swa is not None:
            keep = max(cdiv(L, self.Ps), int(self.swa_lo[slot]))
            extra = np.arange(keep, self.swa_hi[slot]) % self.ring
            self._release_swa(slot, extra)
            self.swa_hi[slot] = keep
        if self.full is not None:
            keep = cdiv(L, self.P)
            held = int(self.full_held[slot])
            if held > keep:
                self._free(self.full, FULL_PAGES, self.full_table[slot, keep:held].copy())
                self.full_table[slot, keep:held] = 0
                self.outstanding += max(int(self.reserved[slot]) - keep, 0) - max(int(self.reserved[slot]) - held, 0)
                self.full_held[slot] = keep
                if self.ledger is not None:
                    self.ledger.add_units(FULL_PAGES, keep - held)

    def _release_swa(self, slot: int, cols: np.ndarray) -> None:
        if len(cols) == 0:
            return
        pages = self.swa_table[slot, cols].copy()
        if self.prefix_on:   # cache-held pages lose this reader; only the request's own are freed
            cached = self._unref_swa(pages)
            pages = pages if cached is None else pages[~cached]
        self._free(self.swa, SWA_PAGES, pages)
        self.swa_table[slot, cols] = 0
        if self.ledger is not None:
            self.ledger.add_units(SWA_PAGES, -len(pages))

    def finish(self, request_id, keep_pages=None) -> None:
        """keep_pages (prefix cache): table columns of the request's own full pages that the
        cache keeps instead of freeing."""
        try:
            running = request_id in self.slot_of
        except TypeError:   # unhashable: never admitted
            running = False
        if not running:
            raise RequestStateError(f"request_id {request_id!r} is not running (never admitted or already "
                                    "finished); finish each request once")
        slot = self.slot_of[request_id]
        if self.prefix_on:
            self._commit_captures([slot])   # its last write is final: resume points it reached
            self._drop_pending(slot)
            if self.on_slot_end is not None:
                self.on_slot_end(slot)
        del self.slot_of[request_id]
        self._epoch += 1
        L = int(self.length[slot])
        if self.ledger is not None:
            for key, n in self._private_entries(slot, L).items():
                self.ledger.add_entries(key, -n)
        if self.swa is not None:
            self._release_swa(slot, np.arange(self.swa_lo[slot], self.swa_hi[slot]) % self.ring)
            self.swa_hi[slot] = self.swa_lo[slot]
        if self.prefix_on and self.full is not None:
            self._finish_shared(slot, keep_pages)
        self.length[slot] = 0
        self._trim(slot)
        self.outstanding -= max(int(self.reserved[slot]) - int(self.full_held[slot]), 0)
        self.reserved[slot] = self.swa_lo[slot] = self.swa_hi[slot] = self.last_write[slot] = 0
        self._group_start[slot] = 0   # (a request admitted here within the group has written nothing committed)
        self.rid_of[slot] = None
        self.slots.owner[slot] = 0
        self._free(self.slots, REQUEST_SLOTS, np.array([slot]))
        if self.ledger is not None:
            self.ledger.add_units(REQUEST_SLOTS, -1)
            self.ledger.running_requests -= 1

    def _drop_pending(self, slot: int) -> None:
        """Resume points the request did not reach (rolled back, or finished before them)."""
        units = [u for u in (*self.older.pop(slot, {}).values(), int(self.pend_u[slot])) if u]
        self._clear_pending(slot)
        if units:
            self._free(self.ckpt, CHECKPOINTS, np.array(units, np.int64))
            if self.ledger is not None:
                self.ledger.add_units(CHECKPOINTS, -len(units))

    def _finish_shared(self, slot: int, keep_pages) -> None:
        """Full pages at finish: shared ones lose a reader, kept ones pass to the cache; _trim
        then frees the rest (it skips the zeroed columns)."""
        k, held = int(self.full_shared[slot]), int(self.full_held[slot])
        self._unref_full(slot)
        kept = self._keep_full(slot, keep_pages if keep_pages is not None else [])
        gone = k + len(kept)
        if gone:   # compact the request's remaining own pages to the front, as _trim expects
            own = self.full_table[slot, :held]
            rest = own[own != 0]
            self.full_table[slot, :held] = 0
            self.full_table[slot, :len(rest)] = rest
            self.outstanding -= max(int(self.reserved[slot]) - held, 0)
            self.full_held[slot] = len(rest)
            self.reserved[slot] = max(int(self.reserved[slot]) - gone, 0)
            self.outstanding += max(int(self.reserved[slot]) - len(rest), 0)
        self.full_shared[slot] = 0
