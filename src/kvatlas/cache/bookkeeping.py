"""The bookkeeping backend ("none"): a cache with allocator and ledger but no pool memory.

Hit ratios, admission and occupancy are properties of the bookkeeping, not of the bytes, so a
simulation can run a plan far larger than the machine (120 GiB of V4-Flash KV on a 24-GiB host)
with this backend. Every buffer is a tensor on torch's "meta" device: it has the plan's shapes and
dtypes, so pools, views and block tables are built as usual, but it holds no storage, and
nothing can be stored or read through it.

What the ledger says, honestly: planned and addressable are the plan's (what a real allocation
would hold and hand out); occupied moves exactly as with a real backend (the allocator is the
same code); tensor, reserved and physical are 0, because nothing is allocated. The integrity
check then holds occupied ≤ addressable ≤ planned instead of ≤ tensor.
"""

from __future__ import annotations

from .arena import Backend


class BookkeepingBackend(Backend):
    """Allocates nothing: meta tensors of the plan's shapes; tensor = reserved = physical = 0."""

    name = "none"
    commits_upfront = False    # nothing to fit on the device: no memory check
    holds_memory = False

    def allocate(self, plan, device) -> dict[str, object]:
        import torch
        slab = torch.empty(plan.total_bytes, dtype=torch.uint8, device="meta")
        return {b.name: slab.narrow(0, b.offset_bytes, b.bytes) for b in plan.buffers}

    @property
    def tensor_bytes(self) -> int:
        return 0

    @property
    def reserved_bytes(self) -> int:
        return 0

    @property
    def physical_bytes(self) -> int:
        return 0

    def buffer_backing(self, buffer: str, tensor_bytes: int) -> tuple[int, int]:
        return 0, 0
