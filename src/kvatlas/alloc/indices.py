"""What each lifecycle call hands the data path: flat numpy index arrays, one entry per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteIndices:
    """Where the tokens of one call go. All arrays have one entry per written token unless noted.

    request_slots: the request-table slot of each token's request
    positions:     each token's position in its sequence
    swa_slots:     entry index in the SWA pool (page * swa_page_tokens + offset); V4.1: window row
                   (slot * window_rows + position % window_rows)
    full_slots:    entry index in full-token space (page * page_tokens + offset); -1 where this rank
                   has no compressed pool
    compressed:    ratio → (token mask: the token completes a block, entry index in that pool)
    state_rows:    state pool name → ring row of each token (slot * ring + position % ring)
    workspace_rows: V4.1 prefill: each token's row in the shared workspace (empty otherwise)
    checkpoint_rows: prefix cache: checkpoint buffer name → (token index in this write, row in the
                   buffer [unit * resume rows + offset]): rows the caller also saves there (the
                   compressor-state row, or V4.1's window row, of those tokens)
    """

    request_slots: np.ndarray
    positions: np.ndarray
    swa_slots: np.ndarray
    full_slots: np.ndarray
    compressed: dict
    state_rows: dict
    workspace_rows: np.ndarray
    checkpoint_rows: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """A request's place: its slot and the state rows to clear before first use."""

    request_id: object
    request_slot: int
    reserved_pages: int
    state_rows: dict    # state pool name → every ring row of the slot
    cached_tokens: int = 0   # prompt tokens taken from the prefix cache: start writing here
    resume_unit: int = 0     # the checkpoint unit whose rows the request's rings start from


class RequestBatch:
    """A running batch resolved to request slots once: engines keep their batch across decode
    steps, so step() need not look 1,024 ids up again. Stale after any admit or finish (the
    allocator re-resolves it then), so it can never point at another request's slot."""

    __slots__ = ("request_ids", "slots", "epoch")

    def __init__(self, request_ids, slots: np.ndarray, epoch: int) -> None:
        self.request_ids = tuple(request_ids)
        self.slots = slots
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.request_ids)
