"""The shared tier's own ledger section: bytes and entries moved each way, hits, misses by
reason, errors and seconds per store operation, the breaker. Its bytes are store bytes: never
added to the device's or the host tier's."""

from __future__ import annotations

from dataclasses import dataclass, field

from .values import MISS_REASONS

SHARED_SCHEMA_VERSION = 1
KINDS = ("page", "checkpoint")
DIRECTIONS = ("to_store", "from_store")
OPS = ("put", "get", "exists", "remove")
PUT_OUTCOMES = ("stored", "exists", "full", "failed", "skipped")


def _per(keys, inner=None) -> dict:
    return {k: (dict.fromkeys(inner, 0) if inner else 0) for k in keys}


@dataclass(slots=True)
class SharedCounters:
    moved_bytes: dict = field(default_factory=lambda: _per(DIRECTIONS))
    moved_entries: dict = field(default_factory=lambda: _per(KINDS, DIRECTIONS))
    hits: dict = field(default_factory=lambda: _per(KINDS))
    misses: dict = field(default_factory=lambda: _per(KINDS, MISS_REASONS))
    errors: dict = field(default_factory=lambda: _per(OPS))
    op_count: dict = field(default_factory=lambda: _per(OPS))
    op_seconds: dict = field(default_factory=lambda: _per(OPS))
    puts: dict = field(default_factory=lambda: _per(KINDS, PUT_OUTCOMES))


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedSnapshot:
    schema_version: int
    store: str
    layout_tag: str
    policy: str
    modeled_payload: bool
    deadline_s: float
    breaker_open: bool
    breaker_state: str
    breaker_opened: int
    moved_bytes: dict
    moved_entries: dict
    hits: dict
    misses: dict
    errors: dict
    op_count: dict
    op_seconds: dict
    puts: dict
    outbox_bytes: int
    in_flight: int
    hit_tokens: int = 0
    hit_requests: int = 0

    def to_dict(self) -> dict:
        return {"schema": "kvatlas.shared_tier", "schema_version": self.schema_version, "store": self.store,
                "layout_tag": self.layout_tag, "policy": self.policy, "modeled_payload": self.modeled_payload,
                "deadline_s": self.deadline_s,
                "breaker": {"open": self.breaker_open, "state": self.breaker_state, "times_opened": self.breaker_opened},
                "store_bytes_moved": self.moved_bytes, "entries_moved": self.moved_entries, "hits": self.hits,
                "misses": self.misses, "errors": self.errors,
                "ops": {op: {"count": self.op_count[op], "seconds": self.op_seconds[op]} for op in OPS},
                "puts": self.puts, "outbox_host_bytes": self.outbox_bytes, "calls_in_flight": self.in_flight,
                "hit_tokens": self.hit_tokens, "hit_requests": self.hit_requests}
