"""Live entries of a request, and the ledger counter each compressed ratio moves."""

from __future__ import annotations

from ..planning.model import LayerKind

_KEYS = {k.ratio: k.value for k in LayerKind if k.ratio}


def ratio_key(ratio: int) -> str:
    """The ledger counter of a compressed ratio (its layer kind)."""
    return _KEYS[ratio]


def request_entries(alloc, slot: int) -> dict[str, int]:
    """Live entries per layer of one request (an Allocator's request slot), by ledger key."""
    L = int(alloc.length[slot])
    out = {ratio_key(r): L // r for r in alloc.ratios}
    if alloc.swa is not None:
        out["swa"] = L - int(alloc.swa_lo[slot]) * alloc.Ps
    return out
