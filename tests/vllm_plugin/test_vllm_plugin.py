"""The plugin inside vLLM 0.33.0's own engine core: loaded by vLLM's plugin loader, its tensor bytes
equal the one allocation vLLM's worker makes (allocated here by vLLM's own `allocate_kv_cache` and
audited), per group and kind against vLLM's per-layer pages; no hook ever raises into vLLM."""

import json
import logging
import os
import subprocess
import sys

import pytest

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
    out = subprocess.run([sys.executable, os.path.join(HERE, "serve_roles.py"), "0.34.0"], capture_output=True,
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
    assert r["lines"] == ["kvatlas: vLLM 0.34.0 is not 0.33.x, the version this plugin knows; plugin off, "
                          "vLLM runs unchanged"]
