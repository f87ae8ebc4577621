"""A host tier with no memory behind it: the same slots, LRU and counters as the real one, and
each move charged the time the H200 measurements give. For simulations of plans larger than the
machine (the prefix cache's bookkeeping-only runs): hit ratios are a property of the bookkeeping,
transfer times of the bandwidth.

Time model (bench/host_tier_gpu.py, H200, bench/RESULTS.md): a move costs its bytes at the
measured staged-copy bandwidth of a contiguous run, plus a fixed cost per run of consecutive
host slots and per host buffer (one more copy call each: the scattered restore's extra time
over the contiguous one, per copy).
"""

from __future__ import annotations

import numpy as np

from ..errors import BudgetError
from ..planning.hostplan import plan_host
from ..units import fmt_bytes
from .copies import Transfer, _runs
from .index import HostIndex

RESTORE_BYTES_PER_S = 47.3e9     # 3,000 V4-Flash pages, host slots contiguous: 0.86 × plain copy_
OFFLOAD_BYTES_PER_S = 50.7e9     # device to host, same pages
# What a modeled host slot costs in this process when the tier is full: its free-list entry, its
# LRU entry and the prefix link's parent/child entries (~590 B measured with tracemalloc).
BOOKKEEPING_BYTES_PER_SLOT = 600
COPY_CALL_S = 5e-6               # per run of host slots and buffer: a random half of the host slots
                                 # (~1,500 runs × 3 buffers) took 85.6 ms against 63.3 contiguous


def check_modeled_fits(host_plan, field: str = "host_memory_bytes") -> None:
    """A modeled tier holds no memory, but its bookkeeping does: refuse one whose slots, full,
    would not fit in this machine's available memory."""
    from ..cache.arena import host_available_bytes
    slots = sum(host_plan.units.values())
    need, avail = slots * BOOKKEEPING_BYTES_PER_SLOT, host_available_bytes()
    if need > avail:
        most = avail // BOOKKEEPING_BYTES_PER_SLOT
        raise BudgetError(f"{field}: a modeled host tier of {fmt_bytes(host_plan.budget_bytes)} has {slots:,} slots, whose "
                          f"bookkeeping needs {fmt_bytes(need)} when full, but this machine has {fmt_bytes(avail)} "
                          f"available; model at most {most:,} slots (about "
                          f"{host_plan.budget_bytes * most // slots:,} B of host tier)")


def move_seconds(direction: str, nbytes: int, runs: int, buffers: int) -> float:
    rate = RESTORE_BYTES_PER_S if direction == "device" else OFFLOAD_BYTES_PER_S
    return nbytes / rate + runs * buffers * COPY_CALL_S


def modeled_move_seconds(direction: str, host_plan, group: str, slots: np.ndarray) -> float:
    """move_seconds of moving these host slots of `group` (every HostIndex stamps its transfers)."""
    nbytes = len(slots) * host_plan.unit_bytes(group)
    runs = len(_runs(np.sort(slots))) if len(slots) else 0
    return move_seconds(direction, nbytes, runs, len(host_plan.group_buffers(group)))


class ModeledHost(HostIndex):
    """HostIndex whose transfers complete at once and report the modeled seconds as latency."""

    copy_device = "modeled"

    def __init__(self, device_plan, host_memory_bytes, checkpoint_share=None) -> None:
        kw = {} if checkpoint_share is None else {"checkpoint_share": checkpoint_share}
        check_modeled_fits(plan_host(device_plan, host_memory_bytes, **kw))
        super().__init__(device_plan, host_memory_bytes, **kw)

    def _copy(self, direction: str, group: str, slots: np.ndarray, where) -> Transfer:
        """Lands at once; its latency is the modeled time (HostIndex._modeled sums it)."""
        t = Transfer(direction, len(slots) * self.plan.unit_bytes(group), len(slots), None, None, 0.0)
        t._latency_s = modeled_move_seconds(direction, self.plan, group, slots)
        return t
