"""The host tier on CPU: random sessions of evictions to host and restores read back exactly what
was evicted; host LRU eviction; its own ledger section; bad input refused with nothing changed."""

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings, strategies as st  # noqa: E402

import kvatlas  # noqa: E402
from kvatlas.errors import ConfigError, PoolExhaustedError, RequestStateError  # noqa: E402
from kvatlas.tiers import CheckpointAt, HostTier  # noqa: E402

from host_session import Session, as_bytes  # noqa: E402

PLANS = {
    "v4": dict(model="tiny-v4", memory="64MiB", max_running_requests=4),
    "v4-draft": dict(model="tiny-v4", memory="64MiB", max_running_requests=4, draft_tokens=3),
    "unified-fp8": dict(model="tiny-v4", memory="64MiB", max_running_requests=4, kv_layout="unified-fp8"),
    "v4.1": dict(model="tiny-v4.1", memory="64MiB", max_running_requests=4),
    "v4-prefix": dict(model="tiny-v4", memory="64MiB", max_running_requests=4, prefix_checkpoints=8),
    "v4.1-prefix": dict(model="tiny-v4.1", memory="64MiB", max_running_requests=4, prefix_checkpoints=8),
}


def _tier(name="v4", host="8MiB", **kw):
    spec = dict(PLANS[name])
    cache = kvatlas.allocate(kvatlas.plan(spec.pop("model"), spec.pop("memory"), **spec))
    return cache, HostTier(cache, host, **kw)


def _one_row(name):
    """Staging for one device unit of the largest buffer: every transfer then runs in chunks."""
    spec = dict(PLANS[name])
    p = kvatlas.plan(spec.pop("model"), spec.pop("memory"), **spec)
    from kvatlas.planning.hostplan import plan_host
    h = plan_host(p, "2MiB", 0.55)
    return max(b.unit_bytes // h.sources[b.name].device_units for b in h.buffers)


@pytest.mark.parametrize("name", list(PLANS))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31), small_staging=st.booleans())
def test_random_sessions_restore_byte_identical(name, seed, small_staging):
    # a small host tier: host LRU evictions happen within a few dozen steps. Staging of one unit
    # of the largest buffer: every transfer runs in many chunks; of 64 MiB: in one
    s = _session(name, seed, small_staging)
    for _ in range(50):
        s.step()
    s.tier.close()


def _session(name, seed, small_staging=True):
    staging = _one_row(name) if small_staging else "64MiB"
    cache, tier = _tier(name, host="2MiB", checkpoint_share=0.55, staging_bytes=staging)
    return Session(cache, tier, seed)


def test_session_reaches_host_eviction_and_restores():
    """The property test's sessions do exercise what they claim to (checked on a fixed seed)."""
    s = _session("v4", 1)
    for _ in range(50):
        s.step()
    snap = s.tier.snapshot()
    assert snap.evicted["checkpoints"] > 0
    assert snap.moved_to_device["pages"] > 0 and snap.moved_to_device["checkpoints"] > 0


def test_lru_eviction_order_and_touch():
    cache, tier = _tier(host="3MiB")
    n = tier.plan.num_pages
    keys = list(range(n))
    tier.offload_pages(keys, list(range(1, n + 1)))
    tier.touch("page", [0])                       # 0 is now the most recently used
    moved = tier.offload_pages(["x", "y"], [n + 1, n + 2])
    assert moved.evicted == (1, 2)
    assert tier.resident("page")[-3:] == [0, "x", "y"]
    snap = tier.check_integrity()
    assert snap.evicted["pages"] == 2 and snap.moved_to_host["pages"] == n + 2


def test_ledger_section_counts_host_bytes_only():
    cache, tier = _tier()
    device_before = cache.ledger.snapshot().to_dict()
    page_payload = sum(b.unit_payload_bytes for b in tier.plan.group_buffers("host_pages"))
    snap = tier.check_integrity()
    assert snap.totals.planned_bytes == snap.totals.tensor_bytes == tier.plan.total_bytes
    assert snap.totals.occupied_bytes == 0
    t = tier.offload_pages(["a", "b"], [1, 2]).transfer
    assert t.nbytes == 2 * tier.plan.unit_bytes("host_pages")
    snap = tier.check_integrity()
    assert snap.groups["pages"].measures.occupied_bytes == 2 * page_payload
    assert snap.bytes_to_host == t.nbytes and snap.bytes_to_device == 0
    tier.restore_pages(["a"], [3])
    snap = tier.check_integrity()
    assert snap.groups["pages"].measures.occupied_bytes == page_payload
    assert snap.bytes_to_device == tier.plan.unit_bytes("host_pages")
    assert snap.restores_completed == 1 and snap.restore_latency_sum_s > 0
    # the device ledger never sees a host byte
    assert cache.ledger.snapshot().to_dict() == device_before
    d = snap.to_dict()
    assert d["host_totals"]["planned"] == tier.plan.total_bytes and "staging_device_bytes" in d


def _fingerprint(cache, tier):
    return ([as_bytes(r.tensor).clone() for r in cache.arena.regions.values()], tier.snapshot().to_dict(),
            {k: s.keys() for k, s in tier.slots.items()})


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def test_bad_input_changes_nothing():
    cache, tier = _tier(host="3MiB")
    tier.offload_pages(["a"], [1])
    before = _fingerprint(cache, tier)
    bad = [
        (RequestStateError, lambda: tier.offload_pages(["a"], [2])),          # already resident
        (RequestStateError, lambda: tier.offload_pages(["b", "b"], [2, 3])),   # repeated key
        (RequestStateError, lambda: tier.restore_pages(["zz"], [2])),         # not resident
        (ConfigError, lambda: tier.restore_pages(["a"], [0])),                 # the null page
        (ConfigError, lambda: tier.restore_pages(["a"], [cache.plan.num_full_pages])),
        (ConfigError, lambda: tier.offload_pages(["b", "c"], [2])),            # one page for two keys
        (ConfigError, lambda: tier.offload_pages(["b", "c"], [2, 2])),         # a page twice
        (PoolExhaustedError, lambda: tier.offload_pages(list(range(tier.plan.num_pages + 1)),
                                                        list(range(1, tier.plan.num_pages + 2)))),
        (ConfigError, lambda: tier.offload_checkpoints(["c"], [CheckpointAt(swa_pages=(1,), unit=1)])),
        (ConfigError, lambda: tier.offload_checkpoints(["c"], [CheckpointAt(swa_pages=(1, 2), unit=0)])),
        (ConfigError, lambda: tier.offload_checkpoints(["c"], [CheckpointAt(swa_pages=(1, 2), unit=1, first_row=7)])),
        (ConfigError, lambda: tier.offload_checkpoints(["c"], [(1, 2)])),
        (ConfigError, lambda: tier.touch("pages", ["a"])),
        (RequestStateError, lambda: tier.drop("page", ["zz"])),
    ]
    for err, call in bad:
        with pytest.raises(err) as e:
            call()
        assert "; " in str(e.value) or isinstance(e.value, PoolExhaustedError)
        _same(before, _fingerprint(cache, tier))


def test_options_refused_clearly():
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4)
    cache = kvatlas.allocate(p)
    with pytest.raises(ConfigError, match="staging_bytes"):
        HostTier(cache, "8MiB", staging_bytes=1024)
    with pytest.raises(ConfigError, match="staging_bytes"):
        HostTier(cache, "8MiB", staging_bytes="lots")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="pin"):
            HostTier(cache, "8MiB", pin=True)


def test_drop_frees_slots():
    cache, tier = _tier()
    tier.offload_pages(["a", "b"], [1, 2])
    tier.drop("page", ["a"])
    assert tier.resident("page") == ["b"] and tier.check_integrity().dropped["pages"] == 1


def test_scattered_restore_writes_only_the_wanted_pages():
    """A restore of every other host slot: only the wanted pages land, the device pages around
    them stay untouched."""
    cache, tier = _tier(host="3MiB", checkpoint_share=0)
    kv = {b.name: cache.arena.regions[b.name].tensor for b in tier.plan.group_buffers("host_pages")}
    n = tier.plan.num_pages
    for t in kv.values():
        t[1:n + 1].view(torch.uint8).random_(0, 256)
    want = {k: t[1:n + 1].clone() for k, t in kv.items()}
    tier.offload_pages(list(range(n)), list(range(1, n + 1)))     # host slots 0..n-1 in order
    for t in kv.values():
        t.view(torch.uint8).fill_(7)
    keys = list(range(0, n, 2))
    dst = [n + 1 + i for i in range(len(keys))]
    tier.restore_pages(keys, dst)
    for k, t in kv.items():
        assert torch.equal(t[dst], want[k][keys])
        assert bool((t[1:n + 1] == 7).all()) and bool((t[n + 1 + len(keys):] == 7).all())


def test_modeled_host_keeps_the_books_and_charges_measured_time():
    from kvatlas.tiers.modeled import COPY_CALL_S, RESTORE_BYTES_PER_S, ModeledHost
    p = kvatlas.plan("deepseek-v4-flash", "120GiB")      # larger than this machine: no tensors
    host = ModeledHost(p, "128GiB")
    page = host.plan.unit_bytes("host_pages")
    moved = host.offload_pages(list(range(100)), list(range(1, 101)))
    assert moved.transfer.done() and moved.evicted == ()
    t = host.restore_pages([0, 1, 2, 50], [7, 8, 9, 10])  # host slots 0-2 and 50: two runs
    assert t.latency_s == pytest.approx(4 * page / RESTORE_BYTES_PER_S + 2 * 3 * COPY_CALL_S)
    snap = host.check_integrity()
    assert snap.totals.tensor_bytes == 0 and snap.groups["pages"].units_used == 96
    assert snap.bytes_to_device == 4 * page and snap.copy_device == "modeled"
