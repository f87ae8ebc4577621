"""The Prometheus collector: every figure equals the ledger, one snapshot per scrape, rank labels."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvatlas
from kvatlas.errors import ConfigError, PoolExhaustedError
from kvatlas.cache.ledger import MEASURES
from kvatlas.observing.metrics import HELP, KvatlasCollector, exposition


@pytest.fixture(scope="module")
def plan():
    return kvatlas.plan("tiny-v4", "96MiB", max_running_requests=4, max_model_len=2048, chunked_prefill_tokens=1024)


def scrape(collector) -> dict:
    """name → [(labels, value)], parsed from the text exposition as Prometheus would."""
    out: dict = {}
    for fam in text_string_to_metric_families(exposition(collector).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(samples, **labels):
    hits = [v for lab, v in samples if all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(hits) == 1, (labels, hits)
    return hits[0]


def busy_cache(plan):
    c = kvatlas.allocate(plan)
    c.admit("a", 700, 50)
    c.extend("a", 700)
    c.admit("b", 100, 10)
    c.extend("b", 100)
    c.step(["a", "b"], 1)
    return c


def test_every_byte_figure_equals_the_ledger(plan):
    c = busy_cache(plan)
    m = scrape(KvatlasCollector(c))
    snap = c.ledger.snapshot()
    assert snap.occupied_bytes > 0
    for name, p in snap.pools.items():
        for meas in MEASURES:
            v = one(m["kvatlas_kv_cache_bytes"], pool=name, measure=meas, layer_kind=p.layer_kind)
            assert v == getattr(p.measures, f"{meas}_bytes")
        assert one(m["kvatlas_pool_used_rows"], pool=name) == p.entries_used
        assert one(m["kvatlas_pool_free_rows"], pool=name) == p.entries_total - p.entries_used
        assert one(m["kvatlas_pool_total_rows"], pool=name) == p.entries_total
    for meas in MEASURES:
        assert one(m["kvatlas_kv_cache_total_bytes"], measure=meas) == getattr(snap, f"{meas}_bytes")
    assert len(m["kvatlas_kv_cache_bytes"]) == len(MEASURES) * len(snap.pools)


def test_units_tokens_requests_and_capacity(plan):
    c = busy_cache(plan)
    m = scrape(KvatlasCollector(c))
    snap = c.ledger.snapshot()
    swa, c4 = snap.pools["swa_kv"], snap.pools["c4_kv"]
    assert one(m["kvatlas_pool_used_pages"], pool="swa_kv") == swa.units_used
    assert one(m["kvatlas_pool_total_pages"], pool="c4_kv") == c4.units_total
    assert one(m["kvatlas_pool_used_tokens"], pool="swa_kv") == swa.entries_used
    assert one(m["kvatlas_pool_used_tokens"], pool="c4_kv") == c4.entries_used * 4
    assert one(m["kvatlas_pool_used_slots"], pool="c4_state") == 2
    assert one(m["kvatlas_pool_free_slots"], pool="c4_state") == plan.max_running_requests - 2
    assert "c4_state" not in {lab["pool"] for lab, _ in m["kvatlas_pool_used_tokens"]}
    assert m["kvatlas_running_requests"][0][1] == 2
    assert m["kvatlas_bytes_per_token"][0][1] == plan.bytes_per_token
    assert m["kvatlas_bytes_per_request"][0][1] == plan.bytes_per_request
    assert m["kvatlas_max_total_tokens"][0][1] == plan.max_total_tokens
    (labels, value), = m["kvatlas_info"]
    assert value == 1 and labels == {"model": "tiny-v4", "layout": "v4", "version": kvatlas.__version__,
                                     "backend": "plain", "device": "cpu"}


def test_admission_refusals_is_a_counter(plan):
    c = kvatlas.allocate(plan)
    for i in range(plan.max_running_requests):
        c.admit(i, 10, 0)
    with pytest.raises(PoolExhaustedError):
        c.admit("late", 10, 0)
    fams = {f.name: f for f in text_string_to_metric_families(exposition(KvatlasCollector(c)).decode())}
    fam = fams["kvatlas_admission_refusals"]
    assert fam.type == "counter"
    assert [(s.name, s.value) for s in fam.samples] == [("kvatlas_admission_refusals_total", 1.0)]


def test_one_snapshot_per_cache_per_scrape(plan, monkeypatch):
    c = kvatlas.allocate(plan)
    calls = []
    real = c.ledger.snapshot
    monkeypatch.setattr(c.ledger, "snapshot", lambda: calls.append(1) or real())
    exposition(KvatlasCollector(c))
    assert len(calls) == 1


def test_several_ranks_report_through_one_collector(plan):
    c0, c1 = busy_cache(plan), kvatlas.allocate(plan)
    col = KvatlasCollector(c0, tp_rank=0).add(c1, tp_rank=1)
    m = scrape(col)
    for rank, cache in (("0", c0), ("1", c1)):
        snap = cache.ledger.snapshot()
        v = one(m["kvatlas_kv_cache_bytes"], pool="swa_kv", measure="occupied", tp_rank=rank)
        assert v == snap.pools["swa_kv"].measures.occupied_bytes
        assert one(m["kvatlas_running_requests"], tp_rank=rank) == snap.running_requests
        assert one(m["kvatlas_info"], tp_rank=rank) == 1
    with pytest.raises(ConfigError, match="same rank label names"):
        col.add(kvatlas.allocate(plan), pp_rank=1)
    with pytest.raises(ConfigError, match="already reported"):
        col.add(kvatlas.allocate(plan), tp_rank=1)
    with pytest.raises(ConfigError, match="rank label"):
        KvatlasCollector(c0, gpu=3)


# the shared tier's event counters and its breaker gauge: names other teams' dashboards use
EVENT_NAMES = {"kvatlas_shared_tier_hits", "kvatlas_shared_tier_misses", "kvatlas_shared_tier_errors",
               "kvatlas_shared_tier_breaker_open"}


def test_names_follow_the_convention_and_have_help():
    for name, text in HELP.items():
        assert name == "kvatlas" or name in EVENT_NAMES or name.rsplit("_", 1)[1] in {
            "bytes", "rows", "tokens", "pages", "slots", "requests", "refusals", "token", "request", "entries",
            "seconds", "checkpoints", "blocks"}
        assert text and not text.endswith(".")


def test_docs_document_every_metric():
    import pathlib
    readme = (pathlib.Path(__file__).parents[1] / "docs" / "observability.md").read_text()
    for name, text in HELP.items():
        shown = "kvatlas_info" if name == "kvatlas" else name
        shown = "kvatlas_admission_refusals_total" if name == "kvatlas_admission_refusals" else shown
        shown = f"{name}_total" if f"`{name}_total`" in readme else shown
        assert f"`{shown}`" in readme and text in readme, name


def test_a_pipeline_stage_reports_its_pp_rank():
    p = kvatlas.plan("tiny-v4", "96MiB", max_running_requests=4, max_model_len=2048, pp=2, pp_rank=1)
    m = scrape(KvatlasCollector(kvatlas.allocate(p)))
    assert {lab["pp_rank"] for lab, _ in m["kvatlas_kv_cache_bytes"]} == {"1"}
    assert m["kvatlas_running_requests"] == [({"pp_rank": "1"}, 0.0)]
