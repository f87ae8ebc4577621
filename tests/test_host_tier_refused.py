"""An eviction the host tier cannot take (every host slot claimed by a restore under way) is
counted, in the host snapshot and as kvatlas_host_tier_refused_entries_total: the alerts read it."""

import kvatlas
from kvatlas.observing.metrics import KvatlasCollector, exposition
from kvatlas.prefix.tree import Evicted
from kvatlas.tiers import HostLink
from kvatlas.tiers.modeled import ModeledHost


def test_refused_offloads_are_counted_and_exported():
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4, prefix_checkpoints=8)
    cache = kvatlas.allocate(p, backend="none")
    host = ModeledHost(p, "4MiB", 0)
    link = HostLink(cache.prefix, host)
    cache.host = link
    n = host.plan.num_pages
    host.offload_pages(list(range(n)), list(range(1, n + 1)))
    claim = host.claim("page", list(range(n)))          # a restore of every host page is under way
    link.on_evict(Evicted(kind="page", key=10_000, parent_key=0, depth_pages=1, full_page=1))
    snap = host.check_integrity()
    assert snap.refused == {"pages": 1, "checkpoints": 0} and snap.to_dict()["refused_offloads"]["pages"] == 1
    assert not host.contains("page", 10_000)
    text = exposition(KvatlasCollector(cache)).decode()
    assert 'kvatlas_host_tier_refused_entries_total{kind="pages"} 1.0' in text
    assert 'kvatlas_host_tier_dropped_entries_total{kind="pages"} 0.0' in text
    host.unclaim(claim)
