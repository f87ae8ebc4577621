"""Prometheus metrics: a custom Collector that reads ONE ledger snapshot per cache per scrape.

Nothing here is pushed into the accounting objects (DESIGN §5): the collector pulls a snapshot,
which is O(1) in requests and pages (a few dozen counters), so a scrape costs the same with 16 or
1,024 running requests. Every figure is in base units (bytes, tokens, rows, pages, slots), named
`kvatlas_<what>_<unit>`; the README lists them with their help texts (the `HELP` table below is
the single source of both).

Several ranks may report through one collector (`add(cache, tp_rank=…, …)`): every sample then
carries that cache's rank labels. All caches of one collector must use the same rank label names,
so that each metric family has one label set.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily

from ..planning.buffers import FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..checks import of_type, whole
from ..errors import ConfigError
from ..cache.ledger import MEASURES
from ..planning.model import LayerKind

RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")
_UNIT_OF_GROUP = {SWA_PAGES: "pages", FULL_PAGES: "pages", REQUEST_SLOTS: "slots"}

# name → help text. The README section "Metrics" is generated from this table.
HELP = {
    "kvatlas_kv_cache_bytes": "KV cache bytes per pool and measure (planned, tensor, reserved, physical, "
                              "addressable, occupied, evictable), equal to the ledger",
    "kvatlas_kv_cache_total_bytes": "KV cache bytes of the whole cache per measure (includes slab alignment "
                                    "that no pool owns)",
    "kvatlas_pool_used_rows": "Rows (entries per layer) holding live request data, per pool",
    "kvatlas_pool_free_rows": "Addressable rows (entries per layer) not in use, per pool",
    "kvatlas_pool_total_rows": "Addressable rows (entries per layer) of the pool, null units excluded",
    "kvatlas_pool_used_tokens": "Token positions covered by live rows of a paged KV/indexer pool "
                                "(rows x compress ratio)",
    "kvatlas_pool_free_tokens": "Token positions the free rows of a paged KV/indexer pool can still cover",
    "kvatlas_pool_total_tokens": "Token positions the addressable rows of a paged KV/indexer pool cover",
    "kvatlas_pool_used_pages": "Pages handed out to requests, per paged pool",
    "kvatlas_pool_free_pages": "Addressable pages not handed out, per paged pool",
    "kvatlas_pool_total_pages": "Addressable pages of a paged pool (the null page excluded)",
    "kvatlas_pool_used_slots": "Request slots in use, per per-request pool",
    "kvatlas_pool_free_slots": "Request slots free, per per-request pool",
    "kvatlas_pool_total_slots": "Addressable request slots (the null slot excluded)",
    "kvatlas_pool_evictable_pages": "Pages an engine's prefix cache holds that no running request uses, per "
                                    "paged pool (SGLang: its radix cache's unlocked pages)",
    "kvatlas_pool_used_blocks": "Blocks of vLLM's shared KV block pool held by running requests, per KV cache "
                                "group (pool=blocks: every group)",
    "kvatlas_pool_evictable_blocks": "Blocks of a vLLM KV cache group its prefix cache keeps and no request holds "
                                     "(vllm:kv_cache_usage_perc counts them free)",
    "kvatlas_pool_free_blocks": "Blocks of vLLM's shared KV block pool free and holding no prefix-cache entry",
    "kvatlas_pool_total_blocks": "Blocks of vLLM's shared KV block pool (the null block excluded)",
    "kvatlas_prefix_tail_quota_tokens": "SGLang's SWA prefix-tail quota in SWA tokens: what its radix cache holds "
                                        "(state=used) and what its SWA pool keeps for prefix tails (state=total)",
    "kvatlas_running_requests": "Requests admitted and not yet finished",
    "kvatlas_admission_refusals": "Admissions refused because a pool was exhausted (counter)",
    "kvatlas_bytes_per_token": "Capacity slope: page-padded bytes one more cached token costs",
    "kvatlas_bytes_per_request": "Capacity intercept: fixed bytes of one running request",
    "kvatlas_max_total_tokens": "Tokens all live requests together can hold in this plan",
    "kvatlas_max_running_requests": "Request slots of this plan (the most requests that can run at once)",
    "kvatlas_prefix_queried_tokens": "Prompt tokens looked up in the prefix cache at admission (counter)",
    "kvatlas_prefix_hit_tokens": "Prompt tokens taken from the prefix cache: not computed again (counter)",
    "kvatlas_prefix_missed_tokens": "Prompt tokens not taken from the prefix cache, by reason: no_cached_prefix, "
                                    "no_checkpoint (pages cached but no resume point), evicted, not_written_yet (a running "
                                    "request had not yet written the shared prefix), partial_page "
                                    "(rounded off the partial last page) (counter)",
    "kvatlas_prefix_evicted_pages": "Full-token pages the prefix cache evicted (counter)",
    "kvatlas_prefix_evicted_checkpoints": "Resume points the prefix cache evicted (counter)",
    "kvatlas_prefix_evicted_awaited_pages": "Of the evicted pages, those a waiting request would have hit: evicted "
                                            "only when nothing else was evictable (counter)",
    "kvatlas_prefix_queued_requests": "Requests waiting for admission that the scheduler enqueued with the prefix "
                                      "cache (their pages are evicted last)",
    "kvatlas_prefix_checkpoints": "Resume points (SWA tail + compressor state at a page boundary) the cache holds",
    "kvatlas_prefix_cached_pages": "Full-token pages the prefix cache holds (shared or evictable)",
    "kvatlas_prefix_cached_bytes": "Bytes the prefix cache holds: its pages and resume points (evictable and "
                                   "shared with running requests)",
    "kvatlas": "kvatlas build and cache configuration (value always 1)",
    "kvatlas_host_tier_bytes": "Host-tier bytes per entry kind (pages, checkpoints) and measure: host "
                               "memory, never summed with the device's kvatlas_kv_cache_bytes",
    "kvatlas_host_tier_entries": "Host-tier entries per kind (pages, checkpoints) and state (used, total)",
    "kvatlas_host_tier_staging_device_bytes": "Device memory of the host tier's copy staging buffer "
                                              "(outside the KV plan)",
    "kvatlas_host_tier_moved_bytes": "Bytes copied between device and host tier, per direction (counter)",
    "kvatlas_host_tier_moved_entries": "Entries copied per kind and direction (to_host, to_device) (counter)",
    "kvatlas_host_tier_evicted_entries": "Host-tier entries dropped by its own LRU to make room, per kind "
                                         "(counter)",
    "kvatlas_host_tier_dropped_entries": "Host-tier entries dropped because their prefix left the host tier "
                                         "(unreachable), per kind (counter)",
    "kvatlas_host_tier_refused_entries": "Evictions the host tier could not take, every host slot being "
                                          "claimed by a restore under way: the entry is lost, per kind (counter)",
    "kvatlas_host_tier_restore_seconds": "Restores from the host tier (summary): seconds from issue to the "
                                         "last copy landing",
    "kvatlas_prefix_tier_hit_tokens": "Prompt tokens served by the prefix cache per tier (device, host, shared) "
                                         "(counter)",
    "kvatlas_shared_tier_moved_bytes": "Bytes moved between this cache and the shared store, per direction "
                                       "(to_store, from_store; header included): store traffic, never summed with "
                                       "device or host bytes (counter)",
    "kvatlas_shared_tier_moved_entries": "Entries written to (first writer) or read as hits from the shared store, "
                                         "per kind and direction (counter)",
    "kvatlas_shared_tier_hits": "Shared-store reads that were hits (expected size, header and checksum hold), "
                                "per kind (counter)",
    "kvatlas_shared_tier_misses": "Shared-store lookups that were not hits, per kind and reason: absent, stale, "
                                  "foreign, corrupt, size_mismatch, deadline, tier_unavailable (counter)",
    "kvatlas_shared_tier_errors": "Shared-store calls that failed or missed their deadline, per operation (counter)",
    "kvatlas_shared_tier_breaker_open": "1 while the shared store's circuit breaker is open (or trying one call), "
                                        "or the store has not opened yet (start-up), else 0",
    "kvatlas_shared_tier_op_seconds": "Shared-store calls that completed (summary): seconds per operation",
    "kvatlas_shared_tier_offered_entries": "Entries offered to the shared store, per kind and outcome: stored, exists (another "
                                "writer was first), full, failed, skipped (breaker open or outbox full) (counter)",
}


@dataclass(slots=True)
class _Source:
    cache: object
    ranks: dict = field(default_factory=dict)


def _rank_values(cache, ranks: dict) -> dict:
    """Explicit rank labels win; otherwise pp_rank from the plan when pipeline parallel."""
    from ..cache.kvcache import KVCache
    of_type("cache", cache, KVCache, "a KVCache", "give what kvatlas.allocate() returns")
    for k in ranks:
        if k not in RANK_LABELS:
            raise ConfigError(k, "is not a rank label", f"use one of {', '.join(RANK_LABELS)}")
    out = {k: str(whole(k, v)) for k, v in ranks.items() if v is not None}
    o = cache.plan.options
    if not out and o.pp > 1:
        out["pp_rank"] = str(o.pp_rank)
    return out


class KvatlasCollector:
    """prometheus_client Collector over one or more KVCaches (one per rank).

    `lock`: held while a snapshot is taken, so a driver that mutates the cache under the same lock
    is never seen half-way through a step (the snapshot itself takes microseconds).
    """

    def __init__(self, cache=None, *, lock=None, version: str | None = None, **ranks) -> None:
        self.sources: list[_Source] = []
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.version = version or _version()
        if cache is not None:
            self.add(cache, **ranks)

    def add(self, cache, **ranks) -> "KvatlasCollector":
        src = _Source(cache, _rank_values(cache, ranks))
        if self.sources and set(src.ranks) != set(self.sources[0].ranks):
            raise ConfigError("ranks", f"labels {sorted(src.ranks)} differ from {sorted(self.sources[0].ranks)}",
                              "give every cache of one collector the same rank label names")
        if any(s.ranks == src.ranks for s in self.sources):
            raise ConfigError("ranks", f"{src.ranks or 'no rank labels'} already reported",
                              "give each cache distinct tp_rank/pp_rank/dp_rank values")
        self.sources.append(src)
        return self

    def describe(self):
        return []   # families depend on the caches; an empty describe() skips a collect at register

    def snapshots(self) -> list:
        with self.lock:
            return [s.cache.ledger.snapshot() for s in self.sources]

    def host_snapshots(self) -> list:
        """Per cache (its host tier's snapshot, its shared tier's snapshot), None where absent."""
        with self.lock:
            return [(s.cache.host.snapshot(), s.cache.host.shared_snapshot()) if s.cache.host is not None
                    else (None, None) for s in self.sources]

    def collect(self):
        if not self.sources:
            return
        snaps, hosts = self.snapshots(), self.host_snapshots()
        rank_names = sorted(self.sources[0].ranks, key=RANK_LABELS.index)
        fams = _Families(rank_names)
        for src, snap, (host, shared) in zip(self.sources, snaps, hosts):
            rv = [src.ranks[k] for k in rank_names]
            _pool_samples(fams, src.cache.plan, snap, rv)
            _cache_samples(fams, src.cache, snap, rv, self.version)
            if host is not None:
                host_samples(fams, src.cache, host, rv, shared)
            if shared is not None:
                shared_samples(fams, shared, rv)
        yield from fams.all()


class _Families:
    """The metric families of one scrape, created on first use with their label names."""

    def __init__(self, rank_names: list[str]) -> None:
        self.rank_names = rank_names
        self.fams: dict[str, object] = {}

    def add(self, name: str, labels: list[str], values: list[str], value: float, kind=GaugeMetricFamily) -> None:
        fam = self.fams.get(name)
        if fam is None:
            fam = self.fams[name] = kind(name, HELP[name], labels=labels + self.rank_names)
        fam.add_metric(values, value)

    def all(self):
        return self.fams.values()


def _ratio(layer_kind: str) -> int:
    try:
        return LayerKind(layer_kind).ratio or 1
    except ValueError:
        return 1


def _pool_samples(f: _Families, plan, snap, rv: list[str]) -> None:
    for name, p in snap.pools.items():
        base = [name, p.layer_kind]
        for m in MEASURES:
            f.add("kvatlas_kv_cache_bytes", ["pool", "measure", "layer_kind"], [name, m, p.layer_kind] + rv,
                  getattr(p.measures, f"{m}_bytes"))
        used, total = p.entries_used, p.entries_total
        for what, v in (("used", used), ("free", total - used), ("total", total)):
            f.add(f"kvatlas_pool_{what}_rows", ["pool", "layer_kind"], base + rv, v)
        if p.role in ("kv", "indexer") and p.group in (SWA_PAGES, FULL_PAGES):
            r = _ratio(p.layer_kind) if p.group == FULL_PAGES else 1
            for what, v in (("used", used * r), ("free", (total - used) * r), ("total", total * r)):
                f.add(f"kvatlas_pool_{what}_tokens", ["pool", "layer_kind"], base + rv, v)
        unit = _UNIT_OF_GROUP.get(p.group)
        if unit:
            for what, v in (("used", p.units_used), ("free", p.units_total - p.units_used), ("total", p.units_total)):
                f.add(f"kvatlas_pool_{what}_{unit}", ["pool", "layer_kind"], base + rv, v)


def _cache_samples(f: _Families, cache, snap, rv: list[str], version: str) -> None:
    for m in MEASURES:
        f.add("kvatlas_kv_cache_total_bytes", ["measure"], [m] + rv, getattr(snap, f"{m}_bytes"))
    p = cache.plan
    f.add("kvatlas_running_requests", [], rv, snap.running_requests)
    f.add("kvatlas_admission_refusals", [], rv, snap.admission_refusals, kind=CounterMetricFamily)
    f.add("kvatlas_bytes_per_token", [], rv, p.bytes_per_token)
    f.add("kvatlas_bytes_per_request", [], rv, p.bytes_per_request)
    f.add("kvatlas_max_total_tokens", [], rv, p.max_total_tokens)
    f.add("kvatlas_max_running_requests", [], rv, p.max_running_requests)
    if cache.prefix is not None:
        _prefix_samples(f, cache.prefix, rv)
    info = {"model": p.model.name, "layout": p.options.kv_layout, "version": version,
            "backend": snap.backend, "device": snap.device}
    fam = f.fams.get("kvatlas")
    if fam is None:
        fam = f.fams["kvatlas"] = InfoMetricFamily("kvatlas", HELP["kvatlas"], labels=f.rank_names)
    fam.add_metric(rv, info)


def host_samples(f: _Families, cache, host, rv: list[str], shared=None) -> None:
    """The host tier's own families: a host byte never lands in a device family."""
    for kind, g in host.groups.items():
        for m in MEASURES:
            f.add("kvatlas_host_tier_bytes", ["kind", "measure"], [kind, m] + rv, getattr(g.measures, f"{m}_bytes"))
        for state, v in (("used", g.units_used), ("total", g.units_total)):
            f.add("kvatlas_host_tier_entries", ["kind", "state"], [kind, state] + rv, v)
        for d, moved in (("to_host", host.moved_to_host), ("to_device", host.moved_to_device)):
            f.add("kvatlas_host_tier_moved_entries", ["kind", "direction"], [kind, d] + rv, moved[kind],
                  kind=CounterMetricFamily)
        for name, counts in (("evicted", host.evicted), ("dropped", host.dropped)):
            f.add(f"kvatlas_host_tier_{name}_entries", ["kind"], [kind] + rv, counts[kind], kind=CounterMetricFamily)
        f.add("kvatlas_host_tier_refused_entries", ["kind"], [kind] + rv, host.refused[kind], kind=CounterMetricFamily)
    f.add("kvatlas_host_tier_staging_device_bytes", [], rv, host.staging_device_bytes)
    for d, v in (("to_host", host.bytes_to_host), ("to_device", host.bytes_to_device)):
        f.add("kvatlas_host_tier_moved_bytes", ["direction"], [d] + rv, v, kind=CounterMetricFamily)
    name = "kvatlas_host_tier_restore_seconds"
    if name not in f.fams:
        f.fams[name] = SummaryMetricFamily(name, HELP[name], labels=f.rank_names)
    f.fams[name].add_metric(rv, count_value=host.restores_completed, sum_value=host.restore_latency_sum_s)
    if host.hits and cache.prefix is not None:
        s = cache.prefix.stats   # each tier its own counter, counted at admission: none ever goes down
        for tier in ("device", "host") + (("shared",) if shared is not None else ()):
            f.add("kvatlas_prefix_tier_hit_tokens", ["tier"], [tier] + rv, getattr(s, f"{tier}_hit_tokens"),
                  kind=CounterMetricFamily)


def shared_samples(f: _Families, s, rv: list[str]) -> None:
    """The shared tier's own families (store bytes: never in a device or host family)."""
    C = CounterMetricFamily
    for d, v in s.moved_bytes.items():
        f.add("kvatlas_shared_tier_moved_bytes", ["direction"], [d] + rv, v, kind=C)
    for kind in s.hits:
        for d, v in s.moved_entries[kind].items():
            f.add("kvatlas_shared_tier_moved_entries", ["kind", "direction"], [kind, d] + rv, v, kind=C)
        f.add("kvatlas_shared_tier_hits", ["kind"], [kind] + rv, s.hits[kind], kind=C)
        for reason, v in s.misses[kind].items():   # every reason, zeros too
            f.add("kvatlas_shared_tier_misses", ["kind", "reason"], [kind, reason] + rv, v, kind=C)
        for outcome, v in s.puts[kind].items():
            f.add("kvatlas_shared_tier_offered_entries", ["kind", "outcome"], [kind, outcome] + rv, v, kind=C)
    for op, v in s.errors.items():
        f.add("kvatlas_shared_tier_errors", ["op"], [op] + rv, v, kind=C)
    f.add("kvatlas_shared_tier_breaker_open", [], rv, 1 if s.breaker_open else 0)
    name = "kvatlas_shared_tier_op_seconds"
    if name not in f.fams:
        f.fams[name] = SummaryMetricFamily(name, HELP[name], labels=["op"] + f.rank_names)
    for op in s.op_count:
        f.fams[name].add_metric([op] + rv, count_value=s.op_count[op], sum_value=s.op_seconds[op])


def _prefix_samples(f: _Families, prefix, rv: list[str]) -> None:
    s = prefix.stats
    f.add("kvatlas_prefix_queried_tokens", [], rv, s.queried_tokens, kind=CounterMetricFamily)
    f.add("kvatlas_prefix_hit_tokens", [], rv, s.hit_tokens, kind=CounterMetricFamily)
    for reason, n in s.missed().items():   # every reason, zeros too: a 0 hit rate says why
        f.add("kvatlas_prefix_missed_tokens", ["reason"], [reason] + rv, n, kind=CounterMetricFamily)
    f.add("kvatlas_prefix_evicted_pages", [], rv, s.evicted_pages, kind=CounterMetricFamily)
    f.add("kvatlas_prefix_evicted_checkpoints", [], rv, s.evicted_checkpoints, kind=CounterMetricFamily)
    f.add("kvatlas_prefix_evicted_awaited_pages", [], rv, s.evicted_awaited_pages, kind=CounterMetricFamily)
    f.add("kvatlas_prefix_queued_requests", [], rv, prefix.queued)
    held = prefix.summary()   # (as the cache holds it: a scrape reads, never shares pages; PrefixCache reports)
    f.add("kvatlas_prefix_checkpoints", [], rv, held["checkpoints"])
    f.add("kvatlas_prefix_cached_pages", [], rv, held["cached_pages"])
    f.add("kvatlas_prefix_cached_bytes", [], rv, held["cached_bytes"])


def _version() -> str:
    from .. import __version__
    return __version__


def registry_for(collector: KvatlasCollector):
    """A private registry holding only `collector` (no process/platform collectors)."""
    from prometheus_client import CollectorRegistry
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def exposition(collector: KvatlasCollector) -> bytes:
    """The Prometheus text format of one scrape."""
    from prometheus_client import generate_latest
    return generate_latest(registry_for(collector))

