"""A host tier with no memory behind it: the same slots, LRU and counters as the real one, and
each move charged the time the H200 measurements give. For simulations of plans larger than the
machine (the prefix cache's bookkeeping-only runs): hit ratios are a property of the bookkeeping,
transfer times of the bandwidth. The time a move is charged is tiers/movetime.py's model.
"""

from __future__ import annotations

import numpy as np

from ..errors import BudgetError
from ..planning.hostplan import plan_host
from ..units import fmt_bytes
from .copies import Transfer
from .index import HostIndex
from .movetime import COPY_CALL_S, OFFLOAD_BYTES_PER_S, RESTORE_BYTES_PER_S, modeled_move_seconds, move_seconds  # noqa: F401 (re-exported)

# What a modeled host slot costs in this process when the tier is full: its free-list entry, its
# LRU entry and the prefix link's parent/child entries (~590 B measured with tracemalloc).
BOOKKEEPING_BYTES_PER_SLOT = 600


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
