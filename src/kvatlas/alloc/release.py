"""Taking pages back: rollback of rejected drafts, trimming past a request's length, finishing.

A mixin of Allocator (kvatlas.alloc.allocator), split out so each file stays readable: these
methods read and write the allocator's arrays and free lists exactly as its own methods do.
"""

from __future__ import annotations

import numpy as np

from ..planning.buffers import FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
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
        self._free(self.swa, SWA_PAGES, self.swa_table[slot, cols].copy())
        self.swa_table[slot, cols] = 0
        if self.ledger is not None:
            self.ledger.add_units(SWA_PAGES, -len(cols))

    def finish(self, request_id) -> None:
        try:
            running = request_id in self.slot_of
        except TypeError:   # unhashable: never admitted
            running = False
        if not running:
            raise RequestStateError(f"request_id {request_id!r} is not running (never admitted or already "
                                    "finished); finish each request once")
        slot = self.slot_of.pop(request_id)
        self._epoch += 1
        L = int(self.length[slot])
        if self.ledger is not None and self.swa is not None:
            self.ledger.add_entries("swa", -(L - int(self.swa_lo[slot]) * self.Ps))
        if self.swa is not None:
            self._release_swa(slot, np.arange(self.swa_lo[slot], self.swa_hi[slot]) % self.ring)
            self.swa_hi[slot] = self.swa_lo[slot]
        self._count_entries(np.zeros(1, np.int64), np.array([L]), 0, sign=-1)
        self.length[slot] = 0
        self._trim(slot)
        self.outstanding -= max(int(self.reserved[slot]) - int(self.full_held[slot]), 0)
        self.reserved[slot] = self.swa_lo[slot] = self.swa_hi[slot] = self.last_write[slot] = 0
        self.rid_of[slot] = None
        self.slots.owner[slot] = 0
        self._free(self.slots, REQUEST_SLOTS, np.array([slot]))
        if self.ledger is not None:
            self.ledger.add_units(REQUEST_SLOTS, -1)
            self.ledger.running_requests -= 1
