"""The host tier on a real GPU: pinned memory, the copy stream and its events. Skipped without
CUDA; the same sessions run on CPU in test_host_tier.py."""

import pytest

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas.tiers import HostTier  # noqa: E402

from host_session import Session  # noqa: E402

pytestmark = pytest.mark.gpu


def _tier(**kw):
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4), device="cuda")
    return cache, HostTier(cache, "2MiB", checkpoint_share=0.55, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_random_sessions_on_cuda_restore_byte_identical(seed):
    cache, tier = _tier(staging_bytes=224_640)   # one SWA page: every transfer runs in chunks
    assert tier.memory.pinned and tier.memory.slab.is_pinned()
    s = Session(cache, tier, seed)
    for _ in range(50):
        s.step()
    tier.close()


def test_wait_orders_the_compute_stream_without_a_host_sync():
    cache, tier = _tier()
    kv = cache.arena.regions["c4_kv"].tensor
    kv[1:9].random_(0, 256)
    want = kv[1:9].clone()
    tier.offload_pages(list(range(8)), list(range(1, 9)))
    kv[1:9] = 0                      # compute stream: runs after the offload read the pages
    t = tier.restore_pages(list(range(8)), list(range(11, 19)))
    t.wait()
    got = kv[11:19].clone()          # issued on the compute stream right after wait()
    assert torch.equal(got, want)
    t.synchronize()
    assert t.done() and t.latency_s > 0
    assert not kv[1:9].any()
