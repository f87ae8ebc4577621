"""The outbox: host memory laid out like the host tier's (the same host plan, fewer units) from
which the store reads what is being put. An entry is copied here first — from a host slot the
host LRU is about to reuse, or from the device at a finish — so a put in flight never holds up
the host tier or the device, and the bytes stay still until the store has read them. No free
unit: the put is skipped (counted), never waited for."""

from __future__ import annotations

import threading

from ...planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES, plan_host
from ..memory import HostMemory


class Outbox:
    def __init__(self, host_tier, nbytes: int) -> None:
        self.host = host_tier
        self.plan = plan_host(host_tier.device_plan, nbytes, host_tier.plan.checkpoint_share)
        self.memory = HostMemory(self.plan)
        self._free = {g: list(range(self.plan.units[g] - 1, -1, -1)) for g in (HOST_PAGES, HOST_CHECKPOINTS)}
        self._lock = threading.Lock()    # units come back from the store's write thread

    @property
    def nbytes(self) -> int:
        return self.memory.tensor_bytes

    def array(self):
        return self.memory.slab.numpy()

    def take(self, group: str, n: int) -> list[int]:
        """Up to n free units (fewer when the outbox is full)."""
        with self._lock:
            free = self._free[group]
            got = free[-n:] if n else []
            del free[len(free) - len(got):]
            return got[::-1]

    def give(self, group: str, units) -> None:
        with self._lock:
            self._free[group].extend(units)

    def parts(self, group: str, unit: int) -> tuple:
        return self.host.entry_parts(group, unit, self.memory)

    def close(self) -> None:
        self.memory.release()
