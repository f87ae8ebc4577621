"""A ledger for KV pools kvatlas did not allocate: what an engine integration fills in and reports.

An engine's pools are foreign objects. Their integration (e.g. `integrations/sglang/`) audits
them (`kvatlas.audit`), describes each buffer in kvatlas's layout terms (an `EngineBuffer`: units,
unit bytes, null and unreachable units) and says which of the engine's index spaces (full pages,
SWA pages, request slots) a buffer's occupancy follows. From there on nothing here knows the
engine: the six measures of DESIGN §3 per buffer, pool, layer kind and in total, and the metrics
they are written to.

Occupied bytes come from the engine's own allocator counters (`used units × bytes one used unit
holds`), read at snapshot time: a snapshot costs O(pools), whatever the number of requests.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..cache.ledger import MEASURES, ZERO, Measures
from ..engines.base import EngineBuffer

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ForeignBuffer:
    """One pool buffer of an engine (possibly many tensors, e.g. one per layer), measured."""

    layout: EngineBuffer        # units, unit bytes, null/unreachable units, layers, role
    tensor_bytes: int           # audited: distinct storages, each once
    reserved_bytes: int
    physical_bytes: int
    planned_bytes: int          # what the engine's own sizing priced for it (0: never priced)
    index_space: str | None     # the allocator counter its occupancy follows (None: never occupied)
    bytes_per_used_unit: int    # bytes one used unit of that index space occupies here
    in_kv_cache: bool           # part of the KV pool object (counts toward the engine's mem_usage)
    storages: int = 0           # how many distinct storages the audit found for it
    note: str = ""

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def addressable_bytes(self) -> int:
        # a layout that does not describe the tensors exactly cannot vouch for reachability
        return self.layout.reachable_bytes if self.layout_matches else self.tensor_bytes

    @property
    def layout_matches(self) -> bool:
        return self.layout.bytes == self.tensor_bytes

    @property
    def unreachable_bytes(self) -> int:
        return self.layout.unreachable_bytes if self.layout_matches else 0

    def measures(self, used_units: dict[str, int], evictable_units: dict[str, int] | None = None) -> Measures:
        used = used_units.get(self.index_space, 0) if self.index_space else 0
        evictable = (evictable_units or {}).get(self.index_space, 0) if self.index_space else 0
        return Measures(planned_bytes=self.planned_bytes, tensor_bytes=self.tensor_bytes,
                        reserved_bytes=self.reserved_bytes, physical_bytes=self.physical_bytes,
                        addressable_bytes=self.addressable_bytes,
                        occupied_bytes=used * self.bytes_per_used_unit,
                        evictable_bytes=evictable * self.bytes_per_used_unit)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolState:
    name: str
    role: str
    layer_kind: str
    index_space: str | None
    measures: Measures
    units_total: int       # addressable units of its index space
    units_used: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Occupancy:
    """Units of one index space (pages, slots, blocks): `kvatlas_pool_<what>_<unit>{pool=…}`."""

    pool: str
    layer_kind: str
    unit: str
    used: int
    free: int | None = None
    total: int | None = None
    evictable: int | None = None   # held by the prefix cache alone (None: no prefix cache there)

    def values(self) -> list[tuple[str, int]]:
        return [(w, v) for w, v in (("used", self.used), ("free", self.free), ("total", self.total),
                                    ("evictable", self.evictable)) if v is not None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForeignSnapshot:
    schema_version: int
    engine: str
    labels: dict
    pools: dict            # name -> PoolState
    layer_kinds: dict      # layer kind -> Measures
    kv_cache: Measures     # the buffers inside the engine's KV pool object (its mem_usage)
    total: Measures        # every buffer, tables and free lists included
    budget_bytes: int | None
    over_budget_bytes: int | None
    unreachable_bytes: int
    evictable_units: dict = field(default_factory=dict)   # index space -> units only a prefix cache holds
    occupancy: tuple = ()      # Occupancy rows an engine gives itself (else derived from the pools)
    notes: dict = field(default_factory=dict)             # engine figures beside the measures (in /state)
    extra_samples: tuple = ()  # (metric name, {label: value}, value): an engine's own figures

    def to_dict(self) -> dict:
        return {"schema": "kvatlas.foreign_ledger", "schema_version": self.schema_version,
                "engine": self.engine, "labels": dict(self.labels), "budget_bytes": self.budget_bytes,
                "over_budget_bytes": self.over_budget_bytes, "unreachable_bytes": self.unreachable_bytes,
                "kv_cache": self.kv_cache.as_dict(), "total": self.total.as_dict(),
                "pools": {n: {"role": p.role, "layer_kind": p.layer_kind, "index_space": p.index_space,
                              "units_total": p.units_total, "units_used": p.units_used, **p.measures.as_dict()}
                          for n, p in self.pools.items()},
                "layer_kinds": {k: m.as_dict() for k, m in self.layer_kinds.items()},
                "occupancy": [{"pool": o.pool, "unit": o.unit, **dict(o.values())}
                              for o in (self.occupancy or occupancy_of(self))],
                "notes": dict(self.notes),
                "extra": [{"metric": n, **lb, "value": v} for n, lb, v in self.extra_samples]}


class ForeignLedger:
    """The buffers of one engine rank, and a function returning its allocators' used units (and,
    where the engine has a prefix cache, one returning the used units only that cache holds:
    `evictable_units() ≤ used_units()` per index space)."""

    def __init__(self, *, engine: str, buffers: list[ForeignBuffer], used_units: Callable[[], dict],
                 units_total: dict[str, int], labels: dict, budget_bytes: int | None,
                 in_budget_pools: frozenset[str] = frozenset(), source=None, audit_report=None,
                 evictable_units: Callable[[], dict] | None = None, extra: Callable[[], tuple] | None = None) -> None:
        self.engine, self.buffers, self.labels = engine, tuple(buffers), dict(labels)
        self.source, self.audit_report = source, audit_report   # the engine's pool object; what audit() found
        self.used_units, self.units_total = used_units, dict(units_total)
        self.budget_bytes, self.in_budget_pools = budget_bytes, in_budget_pools
        self.evictable_units, self.extra = evictable_units, extra

    @property
    def kv_cache_tensor_bytes(self) -> int:
        return sum(b.tensor_bytes for b in self.buffers if b.in_kv_cache)

    @property
    def unreachable_bytes(self) -> int:
        return sum(b.unreachable_bytes for b in self.buffers)

    @property
    def over_budget_bytes(self) -> int | None:
        if self.budget_bytes is None:
            return None
        sized = sum(b.tensor_bytes for b in self.buffers if b.name in self.in_budget_pools)
        return sized - self.budget_bytes

    def snapshot(self) -> ForeignSnapshot:
        used = self.used_units()
        evictable = self.evictable_units() if self.evictable_units is not None else {}
        pools, kinds, kv, total = {}, {}, ZERO, ZERO
        for b in self.buffers:
            m = b.measures(used, evictable)
            space = b.index_space
            pools[b.name] = PoolState(name=b.name, role=b.layout.spec.role, layer_kind=b.layout.spec.layer_kind,
                                      index_space=space, measures=m, units_total=self.units_total.get(space, 0),
                                      units_used=used.get(space, 0) if space else 0)
            kinds[b.layout.spec.layer_kind] = kinds.get(b.layout.spec.layer_kind, ZERO) + m
            total = total + m
            kv = kv + m if b.in_kv_cache else kv
        return ForeignSnapshot(schema_version=SCHEMA_VERSION, engine=self.engine, labels=self.labels, pools=pools,
                               layer_kinds=kinds, kv_cache=kv, total=total, budget_bytes=self.budget_bytes,
                               over_budget_bytes=self.over_budget_bytes, unreachable_bytes=self.unreachable_bytes,
                               evictable_units=evictable, extra_samples=self.extra() if self.extra else ())


# ---- metrics: prometheus_client multiprocess mode -------------------------------------------

OCCUPANCY_UNITS = {"full_pages": "pages", "swa_pages": "pages", "request_slots": "slots"}
RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")
_GAUGES: dict[str, object] = {}


def _gauge(name: str, labelnames: tuple[str, ...]):
    """One process-wide Gauge per name. `mostrecent`: in multiprocess mode the HTTP server's
    collector keeps each label set's latest value, across the processes that wrote it."""
    g = _GAUGES.get(name)
    if g is None:
        from prometheus_client import Gauge

        from ..observing.metrics import HELP
        g = _GAUGES[name] = Gauge(name, HELP[name], labelnames=labelnames, registry=None,
                                  multiprocess_mode="mostrecent")
    return g


Sample = tuple  # (metric name, label names, label values, value)


def samples(snap: ForeignSnapshot) -> list[Sample]:
    """Every metric sample of one snapshot. Each carries `engine` and the rank labels, so ranks
    never overwrite each other. The one list both exporters write: prometheus_client's gauges
    (`write_gauges`, multiprocess mode) and a collector reading published snapshots (vLLM)."""
    ranks = tuple(str(snap.labels.get(k, "")) for k in RANK_LABELS)
    out: list[Sample] = []
    pool_labels = ("pool", "measure", "layer_kind", "engine") + RANK_LABELS
    for name, p in snap.pools.items():
        for m in MEASURES:
            out.append(("kvatlas_kv_cache_bytes", pool_labels, (name, m, p.layer_kind, snap.engine) + ranks,
                        getattr(p.measures, f"{m}_bytes")))
    for m in MEASURES:
        out.append(("kvatlas_kv_cache_total_bytes", ("measure", "engine") + RANK_LABELS, (m, snap.engine) + ranks,
                    getattr(snap.kv_cache, f"{m}_bytes")))
    labels = ("pool", "layer_kind", "engine") + RANK_LABELS
    for row in snap.occupancy or occupancy_of(snap):
        for what, v in row.values():
            out.append((f"kvatlas_pool_{what}_{row.unit}", labels, (row.pool, row.layer_kind, snap.engine) + ranks, v))
    for name, own, v in snap.extra_samples:
        out.append((name, tuple(own) + ("engine",) + RANK_LABELS, tuple(own.values()) + (snap.engine,) + ranks, v))
    return out


def write_gauges(snap: ForeignSnapshot) -> int:
    """Write one snapshot into kvatlas's gauges; returns the number of samples written."""
    rows = samples(snap)
    for name, labelnames, values, v in rows:
        _gauge(name, labelnames).labels(*values).set(v)
    return len(rows)


def occupancy_of(snap: ForeignSnapshot) -> tuple["Occupancy", ...]:
    """used/free/total (and evictable, where a prefix cache holds units) per index space (full
    pages, SWA pages, request slots), named by its unit; several pools follow one index space, so
    the `pool` label names the index space."""
    out, seen = [], set()
    for p in snap.pools.values():
        unit = OCCUPANCY_UNITS.get(p.index_space or "")
        if unit is None or p.index_space in seen:
            continue
        seen.add(p.index_space)
        out.append(Occupancy(pool=p.index_space, layer_kind="swa" if p.index_space == "swa_pages" else "all",
                             unit=unit, used=p.units_used, free=p.units_total - p.units_used, total=p.units_total,
                             evictable=snap.evictable_units.get(p.index_space)))
    return tuple(out)


# ---- the model, as an engine reads it ----------------------------------------------------------

def model_dir(model, tmp: str, without: tuple = ()) -> str:
    """Engines read a directory holding config.json: a directory is used as it is, a preset or a
    bare config file is copied into `tmp`, less the top-level keys `without`. Anything that is not a
    V4 config is a clear ConfigError."""
    import os

    from ..planning.model import PRESET_DIR, load_model, preset_names
    load_model(model)
    text = os.fspath(model)
    if os.path.isdir(text):
        return text
    src = os.path.join(PRESET_DIR, f"{text}.json") if text in preset_names() else text
    with open(src) as f:
        cfg = json.load(f)
    for key in without:
        cfg.pop(key, None)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tmp


# ---- an optional /state endpoint on a port of kvatlas's own ---------------------------------

def serve_state(snapshot_fn: Callable[[], list], host: str = "127.0.0.1", port: int = 0):
    """Serve `{"schema": "kvatlas.foreign_state", "ledgers": [...]}` at /state and `ok` at /healthz
    on a thread; returns a handle with `.url` and `.close()`."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ..observing.server import ServerHandle

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] == "/state":
                doc = {"schema": "kvatlas.foreign_state", "schema_version": SCHEMA_VERSION,
                       "ledgers": [s.to_dict() for s in snapshot_fn()]}
                body, ctype, code = json.dumps(doc).encode(), "application/json", 200
            elif self.path == "/healthz":
                body, ctype, code = b"ok", "text/plain", 200
            else:
                body, ctype, code = b"not found: try /state", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="kvatlas-state", daemon=True)
    thread.start()
    return ServerHandle(httpd, thread)
