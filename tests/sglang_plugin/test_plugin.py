"""The plugin inside SGLang 0.5.23's own code: loaded by its load_plugins() through the real entry
point, pools built by its argument pipeline and configurator, figures asserted to the byte."""

import logging
from importlib import metadata

import pytest

GIB = 2**30
TARGETS = ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools",
           "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator.calculate_pool_sizes",
           "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats",
           "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.__init__")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _built(sglang_sequence, model, memory, requests, swa_mode="ratio"):
    from kvatlas.integrations.sglang import plugin as ks
    logger, lines = logging.getLogger("kvatlas.integrations.sglang"), Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        args, pools = sglang_sequence(model, memory, requests, swa_mode)
    finally:
        logger.removeHandler(lines)
    (ledger,) = [lg for lg in ks.ledgers() if lg.source is pools.token_to_kv_pool]
    return args, pools, ledger, lines.lines


@pytest.fixture(scope="module")
def flash(plugins_loaded, sglang_sequence):
    return _built(sglang_sequence, "deepseek-v4-flash", "4GiB", 32)


@pytest.fixture(scope="module")
def flash_cap(plugins_loaded, sglang_sequence):
    return _built(sglang_sequence, "deepseek-v4-flash", "4GiB", 32, "cap")


@pytest.fixture(scope="module")
def pro(plugins_loaded, sglang_sequence):
    return _built(sglang_sequence, "deepseek-v4-pro", "8GiB", 32)


def test_the_entry_point_names_the_plugin():
    (ep,) = [e for e in metadata.entry_points(group="sglang.srt.plugins") if e.name == "kvatlas"]
    assert ep.value == "kvatlas.integrations.sglang.plugin:register" and ep.dist.name == "kvatlas"


def test_load_plugins_applies_exactly_our_four_hooks(plugins_loaded):
    registry = plugins_loaded
    for target in TARGETS:
        assert target in registry._patched
        assert [src.plugin_name for _, _, src in registry._hooks[target]] == ["kvatlas"]
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    assert KVCacheConfigurator._init_pools.__wrapped__.__name__ == "_init_pools"


@pytest.mark.parametrize("case, total", [("flash", 4_312_416_328), ("pro", 8_611_961_032),
                                          ("flash_cap", 4_314_050_632)])
def test_mem_usage_is_the_audited_pool_to_the_byte(case, total, request):
    import kvatlas
    _, pools, ledger, _ = request.getfixturevalue(case)
    kv = pools.token_to_kv_pool
    audited = kvatlas.audit(kv).total_bytes
    assert kv.mem_usage * GIB == audited == total      # SGLang's own unit: GB = bytes / 2^30
    assert pools.token_to_kv_pool_allocator.get_kvcache() is kv   # what the scheduler emits


def test_mem_usage_counts_the_index_map_the_allocator_registers_after_init(flash):
    _, pools, ledger, _ = flash
    kv, alloc = pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    assert kv.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping   # registered by the allocator
    snap = ledger.snapshot()
    assert snap.pools["full_to_swa_index"].measures.tensor_bytes == 4_435_976 == (554_240 + 256 + 1) * 8
    # a hook on the pool's __init__ would have seen everything but the map
    assert kv.mem_usage * GIB - 4_435_976 == 4_307_980_352


def test_request_table_and_free_lists_are_buffers_of_their_own(flash):
    _, pools, ledger, _ = flash
    snap = ledger.snapshot()
    assert snap.pools["req_to_token"].measures.tensor_bytes == 33 * (1_048_576 + 4) * 4 == 138_412_560
    # the free page lists, int64: full pages 1..2165 and SWA pages 1..216
    assert snap.pools["allocator"].measures.tensor_bytes == (2165 + 216) * 8 == 19_048
    beside = sum(p.measures.tensor_bytes for n, p in snap.pools.items()
                 if n in ("req_to_token", "other_request_table", "allocator"))
    assert snap.total.tensor_bytes - snap.kv_cache.tensor_bytes == beside


def test_ratio_is_the_default_and_cap_mode_is_reached(flash, flash_cap):
    assert flash[2].over_budget_bytes == 4_307_980_352 - 4 * GIB == 13_013_056
    assert flash_cap[2].over_budget_bytes == 4_311_900_224 - 4 * GIB
    from kvatlas.integrations.sglang import plugin as ks
    assert ks.startup_line(flash[2]) in flash[3]


def test_startup_line_has_totals_over_budget_and_unreachable(flash, pro):
    (line,) = [x for x in flash[3] if x.startswith("kvatlas: DeepSeek-V4")]
    assert "4,312,416,328 B in the KV pool" in line and "13,013,056 B over it" in line
    assert "28,814,784 B unreachable" in line     # SPEC §6, from the real objects
    assert "44,233,536 B unreachable" in pro[3][-1]


def test_measures_chain_holds_for_every_pool(flash):
    snap = flash[2].snapshot()
    for name, p in snap.pools.items():
        assert p.measures.violations(name) == []
    assert all(b.layout_matches for b in flash[2].buffers)   # the layout describes every tensor exactly
    assert snap.kv_cache.planned_bytes <= 4 * GIB < snap.kv_cache.tensor_bytes


def test_the_engine_model_of_compare_matches_the_real_pools(flash, pro):
    """kvatlas compare re-derives SGLang's pools in pure Python; the real objects agree per pool."""
    from kvatlas.engines import run_engine
    for (_, _, ledger, _), model, memory in ((flash, "deepseek-v4-flash", 4 * GIB), (pro, "deepseek-v4-pro", 8 * GIB)):
        model_buffers = {b.name: b for b in run_engine("sglang", model, memory, max_running_requests=32).buffers}
        real = {b.name: b for b in ledger.buffers}
        # compare's model names the allocators' free lists and the request table's counter one by
        # one; the audit finds them as the storages of the allocator and of the rest of the table
        grouped = {"allocator": ("free_full_pages", "free_swa_pages"), "other_request_table": ("req_generation",)}
        for real_name, names in grouped.items():
            assert real[real_name].tensor_bytes == sum(model_buffers.pop(n).bytes for n in names), real_name
        for name, mb in model_buffers.items():
            assert (real[name].tensor_bytes, real[name].unreachable_bytes) == (mb.bytes, mb.unreachable_bytes), name
