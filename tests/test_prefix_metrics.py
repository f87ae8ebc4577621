"""Prefix-cache metrics and /state: every miss reason is exported (zeros too), the counters equal
the cache's, and cached bytes are the pages' and resume points' payload."""

import numpy as np

from kvatlas import allocate, plan
from kvatlas.observing.metrics import KvatlasCollector, exposition
from kvatlas.observing.server import state_document
from kvatlas.prefix import MISS_REASONS


def test_prefix_metrics_and_state():
    c = allocate(plan("tiny-v4", "64MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=4,
                      chunked_prefill_tokens=1024), prefix_policy="every-page")
    text = exposition(KvatlasCollector(c)).decode()
    for reason in MISS_REASONS:   # before any request: the reasons are there, at 0
        assert f'kvatlas_prefix_missed_tokens_total{{reason="{reason}"}} 0.0' in text
    ids = np.random.default_rng(0).integers(0, 1000, 700)
    for rid in ("a", "b"):
        adm = c.admit(rid, 700, 1, token_ids=ids)
        c.extend(rid, 700 - adm.cached_tokens)
        c.finish(rid, token_ids=ids)
    text = exposition(KvatlasCollector(c)).decode()
    assert "kvatlas_prefix_queried_tokens_total 1400.0" in text
    assert "kvatlas_prefix_hit_tokens_total 512.0" in text
    assert 'kvatlas_prefix_missed_tokens_total{reason="partial_page"} 376.0' in text   # 2 x 188
    assert 'kvatlas_prefix_missed_tokens_total{reason="no_cached_prefix"} 512.0' in text
    assert "kvatlas_prefix_checkpoints 2.0" in text and "kvatlas_prefix_cached_pages 2.0" in text
    snap = c.ledger.snapshot()
    # nothing runs: every cached byte is evictable, and the ledger agrees with the cache
    assert snap.evictable_bytes == c.prefix.cached_bytes() > 0
    line = next(x for x in text.splitlines() if x.startswith("kvatlas_prefix_cached_bytes "))
    assert float(line.split()[1]) == c.prefix.cached_bytes()
    doc = state_document(KvatlasCollector(c))
    pc = doc["caches"][0]["prefix_cache"]
    assert pc["nodes"] == 2 and pc["checkpoints"] == 2 and pc["hit_tokens"] == 512
    assert pc["summary"].startswith("hit 36.6%")
