"""STAND-IN driver: an in-memory imitation of CUDA virtual memory, for CPU tests only.

It is NOT a VMM: nothing is reserved or mapped in any address space. The "reservation" is one
host tensor; "mapping" a chunk only records it (and fills it with a poison byte, since fresh
physical memory holds garbage); "unmapping" records that and poisons it again, so a test that
reads data the bookkeeping let go of sees poison instead of the old bytes — on a GPU that read
would fault. `capacity_bytes` imitates a device running out of memory; `fail_after` makes the
n-th next map fail, to test that a refused request leaves everything as it was.
"""

from __future__ import annotations

from .driver import DeviceOutOfMemory, Driver

POISON_MAPPED = 0xA5     # what a freshly mapped chunk reads before anyone writes it
POISON_UNMAPPED = 0x5A   # what an unmapped chunk reads here (a GPU would fault instead)


class StandInDriver(Driver):
    label = "stand-in (CPU test double, not CUDA)"

    def __init__(self, granularity: int = 2 << 20, capacity_bytes: int | None = None,
                 fail_after: int | None = None) -> None:
        self.granularity = granularity
        self.capacity_bytes = capacity_bytes
        self.fail_after = fail_after
        self.memory = self._bytes = None
        self._mapped: dict[int, int] = {}
        self.map_calls = self.unmap_calls = self.quiesce_calls = 0

    @property
    def mapped_bytes(self) -> int:
        return sum(self._mapped.values())

    def reserve(self, nbytes: int) -> None:
        import torch
        self.memory = torch.full((nbytes,), POISON_UNMAPPED, dtype=torch.uint8)
        self._bytes = self.memory.numpy()   # poisoning through numpy: a plain memset, no thread pool

    def map(self, offset: int, nbytes: int) -> None:
        if offset in self._mapped:
            raise RuntimeError(f"stand-in: chunk at {offset} mapped twice")   # a bookkeeping bug
        if self.fail_after is not None:
            if self.fail_after == 0:
                raise DeviceOutOfMemory("stand-in: configured to fail this map")
            self.fail_after -= 1
        if self.capacity_bytes is not None and self.mapped_bytes + nbytes > self.capacity_bytes:
            raise DeviceOutOfMemory(f"stand-in: {self.mapped_bytes} of {self.capacity_bytes} B in use")
        self.map_calls += 1
        self._mapped[offset] = nbytes
        self._bytes[offset:offset + nbytes] = POISON_MAPPED

    def unmap(self, offset: int, nbytes: int) -> None:
        if self._mapped.pop(offset, None) != nbytes:
            raise RuntimeError(f"stand-in: unmap of {nbytes} B at {offset} that is not mapped")
        self.unmap_calls += 1
        self._bytes[offset:offset + nbytes] = POISON_UNMAPPED

    def quiesce(self) -> None:
        self.quiesce_calls += 1

    def tensor(self):
        return self.memory

    def mapped_offsets(self) -> set[int]:
        return set(self._mapped)

    def close(self) -> None:
        self._mapped.clear()
        self.memory = self._bytes = None
