"""What a move between the host tier and the device costs in time, as measured on an H200.

The time model (bench/host_tier_gpu.py, H200, bench/RESULTS.md): a move costs its bytes at the
measured staged-copy bandwidth of a contiguous run, plus a fixed cost per run of consecutive host
slots and per host buffer (one more copy call each: the scattered restore's extra time over the
contiguous one, per copy). Every HostIndex stamps its transfers with it (`modeled_s`), and the
modeled tier (tiers/modeled.py) reports it as their latency: both import it from here.
"""

from __future__ import annotations

import numpy as np

from .copies import _runs

RESTORE_BYTES_PER_S = 47.3e9     # 3,000 V4-Flash pages, host slots contiguous: 0.86 × plain copy_
OFFLOAD_BYTES_PER_S = 50.7e9     # device to host, same pages
COPY_CALL_S = 5e-6               # per run of host slots and buffer: a random half of the host slots
                                 # (~1,500 runs × 3 buffers) took 85.6 ms against 63.3 contiguous


def move_seconds(direction: str, nbytes: int, runs: int, buffers: int) -> float:
    rate = RESTORE_BYTES_PER_S if direction == "device" else OFFLOAD_BYTES_PER_S
    return nbytes / rate + runs * buffers * COPY_CALL_S


def modeled_move_seconds(direction: str, host_plan, group: str, slots: np.ndarray) -> float:
    """move_seconds of moving these host slots of `group` (every HostIndex stamps its transfers)."""
    nbytes = len(slots) * host_plan.unit_bytes(group)
    runs = len(_runs(np.sort(slots))) if len(slots) else 0
    return move_seconds(direction, nbytes, runs, len(host_plan.group_buffers(group)))
