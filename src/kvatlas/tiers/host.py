"""The host tier: cached pages and checkpoints evicted from the device wait in pinned host
memory and come back byte for byte.

    tier = HostTier(cache, "128GiB")
    moved = tier.offload_pages(keys, device_pages)       # before the device pages are freed
    moved.evicted                                        # host LRU entries dropped to make room
    t = tier.restore_pages(keys, new_device_pages)       # on the copy stream; returns at once
    t.done() / t.wait()                                  # ready / compute stream waits for it

The tier owns: its host buffer map (`planning.hostplan`), the pinned slab (`memory`), one
index space per kind with its own LRU (`slots`), the copy engine (`copies`) and its ledger
section (`ledger`). It never frees or allocates device units: the caller (the prefix cache)
decides which units to move and hands units back to the allocator itself; a move to host
fences the compute stream, so handing the units back right after is safe.

Moves are exclusive: a restored entry leaves host memory (its slot is free again; the copy
stream's order keeps it from being overwritten before the restore has read it).
"""

from __future__ import annotations

import numpy as np

from ..planning.buffers import SWA_PAGES
from ..planning.hostplan import DEFAULT_CHECKPOINT_SHARE, HOST_CHECKPOINTS, HOST_PAGES
from ..units import MIB, parse_bytes
from .copies import CopyEngine, RowMove, Transfer, UnitMove
from .index import CheckpointAt, Claim, HostIndex, Offload  # noqa: F401 (re-exported)
from .memory import HostMemory

DEFAULT_STAGING_BYTES = 64 * MIB   # a 64-MiB copy reaches the pinned H2D plateau (SPEC §7)


def _raw(t, dims: int):
    import torch
    return t.view(torch.uint8).reshape(*t.shape[:dims], -1)


class HostTier(HostIndex):
    memory_backed = True

    def __init__(self, cache, host_memory_bytes, *, checkpoint_share: float = DEFAULT_CHECKPOINT_SHARE,
                 pin: bool | None = None, staging_bytes: int | str = DEFAULT_STAGING_BYTES) -> None:
        super().__init__(cache.plan, host_memory_bytes, checkpoint_share)
        self.cache = cache
        largest = max(b.unit_bytes // self.plan.sources[b.name].device_units for b in self.plan.buffers)
        staging = parse_bytes(staging_bytes, "staging_bytes")
        self.memory = HostMemory(self.plan, pin)
        try:
            self.engine = CopyEngine(cache.device, staging, largest)
        except BaseException:
            self.memory.release()
            raise
        regions = cache.arena.regions
        self._device = {b.name: regions[self.plan.sources[b.name].buffer].tensor for b in self.plan.buffers}

    @property
    def pinned(self) -> bool:
        return self.memory.pinned

    @property
    def copy_device(self) -> str:
        return str(self.engine.device)

    @property
    def staging_bytes(self) -> int:
        return self.engine.staging_bytes

    @property
    def tensor_bytes(self) -> int:
        return self.memory.tensor_bytes

    @property
    def span_bytes(self) -> dict:
        return self.memory.span_bytes

    def _copy(self, direction: str, group: str, slots: np.ndarray, where, memory=None) -> Transfer:
        raw = (memory or self.memory).raw
        moves = self._page_moves(slots, where, raw) if group == HOST_PAGES else self._checkpoint_moves(slots, where, raw)
        return self.engine.run(direction, moves)

    def copy_out(self, group: str, memory, units: np.ndarray, where) -> Transfer:
        """Copy device entries into units of another host memory of the same host plan's layout
        (the shared tier's outbox), through the same copy engine; counted in no host measure."""
        return self._copy("host", group, np.asarray(units, np.int64), where, memory)

    def entry_parts(self, group: str, slot: int, memory=None) -> tuple:
        """The bytes of one host entry, one uint8 array per host buffer (a view, in plan order)."""
        raw = (memory or self.memory).raw
        return tuple(raw[b.name][slot].numpy() for b in self.plan.group_buffers(group))

    def _page_moves(self, slots: np.ndarray, pages: np.ndarray, raw) -> list:
        return [UnitMove(raw[b.name], _raw(self._device[b.name], 1), slots, pages)
                for b in self.plan.group_buffers(HOST_PAGES)]

    def _checkpoint_moves(self, slots: np.ndarray, at: list[CheckpointAt], raw) -> list:
        out = []
        units = np.array([a.unit for a in at], dtype=np.int64)
        for b in self.plan.group_buffers(HOST_CHECKPOINTS):
            src, dev, host = self.plan.sources[b.name], self._device[b.name], raw[b.name]
            if src.rows:
                row_bytes = b.entry_bytes
                firsts = np.array([a.first_row for a in at], dtype=np.int64) * row_bytes
                out.append(RowMove(host.view(host.shape[0], len(b.layers), src.rows * row_bytes), _raw(dev, 2),
                                   slots, units, firsts))
            elif self._source_group[b.name] == SWA_PAGES:
                m = src.device_units
                rows = (slots[:, None] * m + np.arange(m)).reshape(-1)
                pages = np.array([p for a in at for p in a.swa_pages], dtype=np.int64)
                out.append(UnitMove(host.view(host.shape[0] * m, -1), _raw(dev, 1), rows, pages))
            else:   # a V4.1 request window: one whole unit of the request slot
                out.append(UnitMove(host, _raw(dev, 1), slots, units))
        return out

    def close(self) -> None:
        super().close()
        self.memory.release()
