"""The plugin inside vLLM's own engine core (0.34.0, or 0.33.0 in its venv): loaded by vLLM's plugin
loader, its tensor bytes equal the one allocation vLLM's worker makes (allocated here by vLLM's own
`allocate_kv_cache` and audited), per group and kind against vLLM's per-layer pages; no hook ever raises
into vLLM."""

import json
import logging
import os
import subprocess
import sys

import pytest
from truth import check_snapshot

GIB = 2**30
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def kv():
    from kvatlas.integrations.vllm import offline as vllm
    return vllm


def _tracker(eng):
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    return vllm_plugin._P.trackers[eng.scheduler]


def _allocate(eng):
    """The worker's own allocation (vLLM's allocate_kv_cache), its pages reserved but never touched."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache
    cfg = eng.worker_kv_cache_configs[0]
    zeros, torch.zeros = torch.zeros, torch.empty
    try:
        return allocate_kv_cache(cfg, torch.device("cpu"), eng.vllm_config.cache_config.get_resolved_kv_cache_layout())
    finally:
        torch.zeros = zeros


@pytest.mark.parametrize("model", ["deepseek-v4-flash", "deepseek-v4-pro"])
@pytest.mark.parametrize("budget", [2 * GIB, 120 * GIB])
def test_tensor_bytes_are_the_one_allocation(kv, model, budget):
    from kvatlas import audit
    eng = kv.build_engine(model, budget, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024)
    snap = _tracker(eng).snapshot()
    cfg = eng.worker_kv_cache_configs[0]
    one = cfg.num_blocks * cfg.kv_cache_tensors[0].block_stride
    assert snap.total.tensor_bytes == one == cfg.kv_cache_tensors[0].size <= budget
    # the KVCacheTensors are views of that one buffer: summing their sizes counts it once per view
    assert sum(t.size for t in cfg.kv_cache_tensors) == len(cfg.kv_cache_tensors) * one
    assert snap.budget_bytes == budget and snap.over_budget_bytes == one - budget
    if budget <= 2 * GIB:   # allocate it for real (untouched pages) and count its storages
        report = audit(_allocate(eng))
        assert sum(e.bytes for e in report.entries) == snap.total.tensor_bytes and len(report.entries) == 1
    # per group, the bytes its cache kinds take of a block are vLLM's per-layer pages
    layout = _tracker(eng).layout
    for g, group in zip(layout.groups, cfg.kv_cache_groups):
        specs = group.kv_cache_spec.kv_cache_specs
        assert sum(p.bytes_per_block for p in g.parts) == g.page_bytes == sum(s.page_size_bytes for s in specs.values())
        assert sum(p.layers for p in g.parts) == len(group.layer_names)
    # nothing running: every block but the null block is free
    assert snap.pools["free_blocks"].measures.tensor_bytes == (cfg.num_blocks - 1) * layout.bytes_per_block
    assert snap.pools["null_block"].measures.tensor_bytes == layout.bytes_per_block
    from kvatlas.observing import shipped   # what /state serves for it validates against the shipped schema
    doc = json.loads(json.dumps(snap.to_dict()))
    assert (doc["schema"], doc["schema_version"]) == ("kvatlas.foreign_ledger", 1) and doc["notes"]["num_blocks"]
    shipped.validator(doc).validate(doc)


def test_startup_line_beside_vllms_figure(kv):
    from kvatlas.engines import run_engine
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    vllm_plugin.log.addHandler(handler)
    level = vllm_plugin.log.level
    vllm_plugin.log.setLevel(logging.INFO)   # what vLLM's configure_logging gives its engine core
    try:
        eng = kv.build_engine("deepseek-v4-flash", 120 * GIB, max_model_len=1_048_576, max_num_seqs=256)
    finally:
        vllm_plugin.log.removeHandler(handler)
        vllm_plugin.log.setLevel(level)
    line = [m for m in seen if m.startswith("kvatlas: vLLM DeepSeek-V4 KV cache")]
    assert len(line) == 1
    ours = run_engine("vllm", "deepseek-v4-flash", 120 * GIB, max_model_len=1_048_576, max_running_requests=256)
    assert f"holds {ours.pool_tokens:,} tokens" in line[0] and ours.pool_tokens == 29_504_512
    assert "'GPU KV cache size: 12,507,513 tokens'" in line[0] and "block_size 4" in line[0]
    assert _tracker(eng).layout.full_tokens == ours.pool_tokens


def test_a_failing_hook_leaves_vllm_unchanged(kv, monkeypatch):
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    eng = kv.build_engine("deepseek-v4-flash", 2 * GIB, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    vllm_plugin.log.addHandler(handler)
    monkeypatch.setattr(vllm_plugin.Tracker, "refresh", lambda self: 1 / 0)
    vllm_plugin._P.warned.discard("Scheduler.make_stats")
    try:
        eng.add_request("x", [3] * 600, max_tokens=2)
        eng.run()
    finally:
        vllm_plugin.log.removeHandler(handler)
    assert eng.last_stats() is not None and not eng.has_requests()
    failures = [m for m in seen if "make_stats hook failed" in m]
    assert len(failures) == 1 and "ZeroDivisionError" in failures[0]   # one line, however many steps


@pytest.fixture(scope="module")
def roles() -> dict:
    # a fresh API server: not this process's metrics directory (its engines' boards are there)
    env = {k: v for k, v in os.environ.items() if k != "KVATLAS_VLLM_METRICS_DIR"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "serve_roles.py"), "0.35.0"], capture_output=True,
                         text=True, timeout=420, cwd=HERE, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_metrics_reach_the_api_servers_metrics_from_the_engine_core(roles):
    r = roles
    assert r["loaded_by_vllm"] and r["entry_point"] == "kvatlas.integrations.vllm.plugin:register"
    assert len(r["engine_core_samples"]) > 100
    for mode in ("one_api_server", "several_api_servers"):
        assert r[mode] == r["engine_core_samples"], mode
    assert r["after_exit"] == 0   # the engine core gone, its board is too


def test_the_dashboards_vllm_panels_read_families_the_api_server_serves(roles):
    import re
    from kvatlas.observing import shipped
    served = {key.split("{", 1)[0] for key in roles["one_api_server"]}
    dash = json.loads(shipped.read("dashboard"))
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", ()) if 'engine="vllm"' in t["expr"]]
    drawn = {m for q in queries for m in re.findall(r"\bkvatlas_[a-z0-9_]+\b", q)}
    assert {"kvatlas_pool_used_blocks", "kvatlas_pool_free_blocks"} <= drawn <= served, sorted(drawn - served)
    assert all("engine=vllm" in key and "dp_rank=" in key for key in roles["one_api_server"])


def test_other_version_refused_with_one_line(roles):
    r = roles["other_version"]
    assert r["registered"] is False and r["hooked"] is False and r["metrics_dir"] is False
    assert r["lines"] == ["kvatlas: vLLM 0.35.0 is not 0.33.x or 0.34.x, the versions this plugin knows; plugin "
                          "off, vLLM runs unchanged"]


def _is_034() -> bool:
    from kvatlas.integrations.vllm import offline as vllm
    return vllm.series() == "0.34"


@pytest.mark.skipif("not _is_034()", reason="the extensible KV cache is vLLM 0.34's")
def test_extensible_cache_reserved_and_committed_after_each_extension(kv):
    """0.34's extensible cache, built by vLLM's own ExtensibleKVCache over the offline VMM driver and
    sized by its own measurement after warm-up; the plugin (loaded by vLLM's plugin loader in the
    engine core) follows each extension through vLLM's own Executor.extend_kv_cache."""
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    vllm_plugin.log.addHandler(handler)
    level = vllm_plugin.log.level
    vllm_plugin.log.setLevel(logging.INFO)
    try:
        # 8 GiB free at start-up; warm-up and graphs take 1 GiB, its transient peak 0.5 GiB: vLLM keeps
        # max(1 GiB floor, 0.75 x 0.5 GiB) of margin and the 0.5 GiB peak, so 5.5 GiB go to the cache
        eng = kv.build_engine("deepseek-v4-flash", 8 * GIB, max_model_len=8192, max_num_seqs=8,
                              max_num_batched_tokens=1024, extensible_kv_cache=True,
                              warmup={"init_free_memory": 8 * GIB, "non_kv_bytes": GIB, "transient_peak_bytes": GIB // 2})
        cache, tracker = eng.extensible_kv_cache, _tracker(eng)
        bpb = cache.bytes_per_block
        assert eng.core.model_executor.worker.measured_bytes == 11 * GIB // 2
        assert cache.num_committed_blocks == eng.kv_cache_config.num_blocks == 11 * GIB // 2 // bpb == 5_892
        assert cache.capacity_blocks == 8 * GIB // bpb == 8_570        # the reservation: the planner's blocks
        assert eng.vllm_config.cache_config.resolved_gpu_memory_utilization == 1.0

        def check(committed: int) -> None:
            snap, layout = tracker.snapshot(), tracker.layout
            assert (layout.reserved_blocks, layout.committed_blocks) == (cache.capacity_blocks, committed)
            assert snap.total.reserved_bytes == cache.capacity_blocks * bpb >= snap.total.physical_bytes
            assert snap.total.physical_bytes == committed * bpb == snap.total.tensor_bytes
            # vLLM's own physical figure maps whole 2 MiB granules; the driver saw exactly those
            assert 0 <= cache.physical_bytes - committed * bpb < 2 << 20 and cache.physical_bytes % (2 << 20) == 0
            assert eng.core.model_executor.worker.vmm.mapped_bytes == cache.physical_bytes
            groups = sum(p.measures.physical_bytes for n, p in snap.pools.items() if n != "uncommitted")
            assert groups == eng.kv_cache_config.num_blocks * bpb     # per group + pad + free + null: the pool's
            for name, p in snap.pools.items():
                assert not p.measures.violations(name), p.measures.violations(name)
            check_snapshot(tracker, eng)

        check(5_892)
        eng.add_request("a", [3] * 3000, max_tokens=4)
        for _ in range(3):
            eng.step()
            check(5_892)
        eng.run()
        eng.core.model_executor.extend_kv_cache(cache.capacity_blocks)   # a later extension, to the whole range
        check(cache.capacity_blocks)
    finally:
        vllm_plugin.log.removeHandler(handler)
        vllm_plugin.log.setLevel(level)
    lines = [m for m in seen if m.startswith("kvatlas: vLLM DeepSeek-V4 KV cache dp0 (extensible)")]
    assert len(lines) == 2, seen                                     # start-up, then the later extension
    assert f"reserved 8,570 blocks x {bpb:,} B = {8_570 * bpb:,} B of address space" in lines[0]
    assert f"committed after warm-up 5,892 blocks = {5_892 * bpb:,} B" in lines[0]
    assert "'Extended KV cache to 5892 blocks'" in lines[0] and "'GPU KV cache size:" in lines[0]
    assert "committed after warm-up 8,570 blocks" in lines[1]


def test_fixed_cache_has_no_reserve_pool(kv):
    """Without the extensible cache (0.33, or 0.34 with it off) nothing is reserved beyond the pool."""
    eng = kv.build_engine("deepseek-v4-flash", 2 * GIB, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024)
    snap = _tracker(eng).snapshot()
    assert "uncommitted" not in snap.pools and not _tracker(eng).layout.extensible
    assert snap.total.reserved_bytes == snap.total.physical_bytes == snap.total.tensor_bytes


def test_extensible_cache_refused_where_it_cannot_be(kv):
    from kvatlas.errors import ConfigError
    if not _is_034():
        with pytest.raises(ConfigError, match="no extensible KV cache"):
            kv.vllm_config("deepseek-v4-flash", extensible_kv_cache=True)
        return
    with pytest.raises(ConfigError, match="warmup.free"):
        kv.vllm_config("deepseek-v4-flash", warmup={"free": 1})
    with pytest.raises(ConfigError, match="num_gpu_blocks_override"):
        kv.vllm_config("deepseek-v4-flash", extensible_kv_cache=True, num_gpu_blocks_override=100)


@pytest.mark.parametrize("raw,ok", [("0", 0.0), ("2.5", 2.5), ("-1", None), ("soon", None), ("7200", None)])
def test_refresh_interval_setting(raw, ok):
    from kvatlas.integrations.vllm.plugin import REFRESH_ENV, Settings
    if ok is None:
        with pytest.raises(ValueError, match=REFRESH_ENV):
            Settings.from_env({REFRESH_ENV: raw})
    else:
        assert Settings.from_env({REFRESH_ENV: raw}).refresh_s == ok
    assert Settings.from_env({}).refresh_s == 1.0


def test_sleep_releases_physical_bytes_until_wake_up(kv):
    """vLLM's own Executor.discard / wake_up (what release_kv_cache_memory and sleep level 1 use): the
    KV cache's physical bytes are 0 while its tag sleeps, and the board is written then."""
    eng = kv.build_engine("deepseek-v4-flash", 2 * GIB, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024)
    tracker, executor = _tracker(eng), eng.core.model_executor
    before = tracker.snapshot().total
    writes = tracker.writes
    executor.discard(("kv_cache",))
    asleep = tracker.snapshot().total
    assert asleep.physical_bytes == 0 and asleep.tensor_bytes == asleep.reserved_bytes == before.tensor_bytes
    assert tracker.writes == writes + 1 and tracker.last == tracker.census.counts()
    executor.wake_up(["kv_cache"])
    assert tracker.snapshot().total == before and tracker.writes == writes + 2
    check_snapshot(tracker, eng)
