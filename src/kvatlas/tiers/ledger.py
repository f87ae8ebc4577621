"""The host tier's own ledger section: host measures, moves each way, restore latency.

A host byte is never added to a device byte: these measures live in their own snapshot (the
device ledger's `Measures` type, a separate instance), and the one device-side figure the tier
owns, its staging buffer, is reported on its own line, labelled as device memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.ledger import ZERO, Measures
from ..planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES

HOST_LEDGER_SCHEMA_VERSION = 1
GROUP_LABEL = {HOST_PAGES: "pages", HOST_CHECKPOINTS: "checkpoints"}


@dataclass(slots=True)
class MoveCounters:
    """Moved by the tier on every transfer (O(1) per call)."""

    bytes_to_host: int = 0
    bytes_to_device: int = 0
    moved_to_host: dict = field(default_factory=lambda: {HOST_PAGES: 0, HOST_CHECKPOINTS: 0})
    moved_to_device: dict = field(default_factory=lambda: {HOST_PAGES: 0, HOST_CHECKPOINTS: 0})
    evicted: dict = field(default_factory=lambda: {HOST_PAGES: 0, HOST_CHECKPOINTS: 0})
    dropped: dict = field(default_factory=lambda: {HOST_PAGES: 0, HOST_CHECKPOINTS: 0})
    # evictions the tier could not take (every host slot claimed by a restore under way): the
    # device entry is lost as it would be without the tier
    refused: dict = field(default_factory=lambda: {HOST_PAGES: 0, HOST_CHECKPOINTS: 0})
    restores: int = 0
    restore_latency_sum_s: float = 0.0
    restore_latency_max_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HostGroupUsage:
    measures: Measures
    units_total: int
    units_used: int
    unit_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSnapshot:
    schema_version: int
    pinned: bool
    copy_device: str
    totals: Measures                 # host bytes only
    groups: dict                     # "pages" / "checkpoints" -> HostGroupUsage
    staging_device_bytes: int        # device memory, never summed with the host measures
    bytes_to_host: int
    bytes_to_device: int
    moved_to_host: dict
    moved_to_device: dict
    evicted: dict
    dropped: dict
    refused: dict
    restores_completed: int
    restore_latency_sum_s: float
    restore_latency_max_s: float
    transfers_in_flight: int
    hits: dict = field(default_factory=dict)   # under the prefix cache: prompt tokens served from host

    def to_dict(self) -> dict:
        return {
            "schema": "kvatlas.host_tier", "schema_version": self.schema_version, "pinned": self.pinned,
            "copy_device": self.copy_device, "host_totals": self.totals.as_dict(),
            "host_groups": {g: {"units_total": u.units_total, "units_used": u.units_used,
                                "unit_bytes": u.unit_bytes, **u.measures.as_dict()} for g, u in self.groups.items()},
            "staging_device_bytes": self.staging_device_bytes,
            "bytes_to_host": self.bytes_to_host, "bytes_to_device": self.bytes_to_device,
            "moved_to_host": self.moved_to_host, "moved_to_device": self.moved_to_device,
            "host_evictions": self.evicted, "dropped": self.dropped, "refused_offloads": self.refused,
            "restores_completed": self.restores_completed,
            "restore_latency_sum_s": self.restore_latency_sum_s,
            "restore_latency_max_s": self.restore_latency_max_s,
            "transfers_in_flight": self.transfers_in_flight, "hits": self.hits,
        }


def group_measures(host_plan, group: str, used_units: int, tensor_bytes: dict) -> Measures:
    """Measures of one host index space: tensor/reserved are the slab spans of its buffers;
    physical is what is backed (pinned memory on CUDA hosts; plain memory counts as backed,
    as on the device's CPU path); occupied is the payload of resident units."""
    m = ZERO
    for b in host_plan.group_buffers(group):
        span = tensor_bytes[b.name]
        m = m + Measures(planned_bytes=b.bytes, tensor_bytes=span, reserved_bytes=span, physical_bytes=span,
                         addressable_bytes=b.addressable_bytes, occupied_bytes=used_units * b.unit_payload_bytes)
    return m
