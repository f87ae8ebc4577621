"""Live figures: pages handed out and taken back by SGLang's own allocator move `occupied` by exactly
their bytes, and the metrics SGLang's /metrics would serve (prometheus_client multiprocess mode,
aggregated the way its HTTP server does) equal the ledger."""

import pytest
import torch

GIB = 2**30
MEASURES = ("planned", "tensor", "reserved", "physical", "addressable", "occupied")


@pytest.fixture(scope="module")
def flash(plugins_loaded, sglang_sequence):
    from kvatlas.integrations.sglang import plugin as ks
    args, pools = sglang_sequence("deepseek-v4-flash", "4GiB", 32)
    (ledger,) = [lg for lg in ks.ledgers() if lg.source is pools.token_to_kv_pool]
    return args, pools, ledger


def _scrape() -> dict:
    """What SGLang's /metrics serves: a MultiProcessCollector over PROMETHEUS_MULTIPROC_DIR."""
    from prometheus_client import CollectorRegistry, multiprocess
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            if s.name.startswith("kvatlas_") and s.labels.get("engine") == "sglang":
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(scrape, name, **labels):
    labels = {"engine": "sglang", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0", **labels}
    return scrape[(name, tuple(sorted(labels.items())))]


def _admit(pools, tokens: int):
    """One request through SGLang's allocators: a request-table row, then its pages (prefill)."""
    req, alloc = pools.req_to_token_pool, pools.token_to_kv_pool_allocator
    (slot,) = req.alloc_rows(1)
    zero, n = torch.tensor([0]), torch.tensor([tokens])
    locs = alloc.alloc_extend(zero, zero, n, n, torch.tensor([-1]), tokens)
    assert locs is not None and len(locs) == tokens
    return slot, locs


_COLLECTOR = []


def _stats(args):
    """SGLang's scheduler stats cadence: the log_stats hook refreshes the gauges. One collector per
    process, as in a scheduler (its gauges register in prometheus_client's default registry)."""
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector, SchedulerStats
    if not _COLLECTOR:
        _COLLECTOR.append(SchedulerMetricsCollector(
            labels={"model_name": "m", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0},
            server_args=args))
    _COLLECTOR[0].log_stats(SchedulerStats())


# bytes one page / slot holds in each pool, from the formats (583-B entry payload of fp8_ds_mla,
# 132-B fp8 indexer entry, fp32 state rows) and V4-Flash's 43 layers: 21 C4, 20 C128
PER_FULL_PAGE = {"c4_kv": 21 * 64 * 583, "c128_kv": 20 * 2 * 583, "c4_indexer": 21 * 64 * 132,
                 "full_to_swa_index": 256 * 8}
PER_SWA_PAGE = {"swa_kv": 43 * 256 * 583, "c4_state": 21 * 8 * 2048 * 4, "c4_indexer_state": 21 * 8 * 512 * 4}
PER_SLOT = {"c128_state": 20 * 128 * 1024 * 4, "req_to_token": (1_048_576 + 4) * 4}


def test_pages_through_sglangs_allocator_move_occupied_by_their_bytes(flash):
    _, pools, ledger = flash
    before = ledger.snapshot()
    assert before.total.occupied_bytes == 0
    slot, locs = _admit(pools, 600)                 # 3 full pages and 3 SWA pages, one slot
    after = ledger.snapshot()
    for name, per in {**PER_FULL_PAGE, **PER_SWA_PAGE, **PER_SLOT}.items():
        units = 1 if name in PER_SLOT else 3
        assert after.pools[name].measures.occupied_bytes == units * per, name
    expected = 3 * sum(PER_FULL_PAGE.values()) + 3 * sum(PER_SWA_PAGE.values()) + sum(PER_SLOT.values())
    assert after.total.occupied_bytes == expected == 42_053_016
    pools.token_to_kv_pool_allocator.free(locs)
    pools.req_to_token_pool.free_rows([slot])
    assert ledger.snapshot().total.occupied_bytes == 0


def test_metrics_equal_the_ledger_after_sglangs_stats_refresh(flash):
    args, pools, ledger = flash
    slot, locs = _admit(pools, 1000)                # 4 pages of each kind, one slot
    try:
        _stats(args)
        snap, scrape = ledger.snapshot(), _scrape()
        for name, p in snap.pools.items():
            for m in MEASURES:
                got = _value(scrape, "kvatlas_kv_cache_bytes", pool=name, measure=m, layer_kind=p.layer_kind)
                assert got == getattr(p.measures, f"{m}_bytes"), (name, m)
        for m in MEASURES:
            assert _value(scrape, "kvatlas_kv_cache_total_bytes", measure=m) == getattr(snap.kv_cache, f"{m}_bytes")
        assert _value(scrape, "kvatlas_kv_cache_total_bytes", measure="tensor") == pools.token_to_kv_pool.mem_usage * GIB
        for space, unit, kind, total in (("full_pages", "pages", "all", 2165), ("swa_pages", "pages", "swa", 216),
                                         ("request_slots", "slots", "all", 32)):
            used = 1 if unit == "slots" else 4
            assert _value(scrape, f"kvatlas_pool_used_{unit}", pool=space, layer_kind=kind) == used
            assert _value(scrape, f"kvatlas_pool_free_{unit}", pool=space, layer_kind=kind) == total - used
            assert _value(scrape, f"kvatlas_pool_total_{unit}", pool=space, layer_kind=kind) == total
    finally:
        pools.token_to_kv_pool_allocator.free(locs)
        pools.req_to_token_pool.free_rows([slot])
    _stats(args)
    assert _value(_scrape(), "kvatlas_kv_cache_total_bytes", measure="occupied") == 0


def test_state_endpoint_serves_the_ledger(flash):
    import json
    import urllib.request

    from kvatlas.integrations import foreign
    _, _, ledger = flash
    handle = foreign.serve_state(lambda: [ledger.snapshot()])
    try:
        with urllib.request.urlopen(handle.url + "/state", timeout=10) as resp:
            doc = json.loads(resp.read())
    finally:
        handle.close()
    (lg,) = doc["ledgers"]
    assert doc["schema"] == "kvatlas.foreign_state" and lg["engine"] == "sglang"
    assert lg["kv_cache"]["tensor"] == 4_312_416_328 and lg["unreachable_bytes"] == 28_814_784
