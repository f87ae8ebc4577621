"""The allocator: random lifecycles keep every invariant; admission is exact; errors change nothing."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import kvatlas  # noqa: E402
from kvatlas import KvatlasError, PoolExhaustedError, RequestStateError  # noqa: E402
from lifecycle import apply_op  # noqa: E402


def fingerprint(cache):
    a, led = cache.allocator, cache.ledger
    arrays = [a.length, a.full_held, a.reserved, a.swa_lo, a.swa_hi, a.full_table, a.swa_table, a.last_write,
              a.slots.owner, a.slots._stack[: a.slots.free]]
    for fl in (a.full, a.swa):
        if fl is not None:
            arrays += [fl.owner, fl._stack[: fl.free]]
    return (tuple(x.tobytes() for x in arrays), a.outstanding, dict(a.slot_of), dict(led.entries_used),
            dict(led.units_used), led.running_requests)


def unchanged_after_error(cache, fn, *args, error=KvatlasError):
    before = fingerprint(cache)
    with pytest.raises(error):
        fn(*args)
    assert fingerprint(cache) == before


def small_cache(model="tiny-v4", **kw):
    opts = dict(max_running_requests=4, max_model_len=2048, chunked_prefill_tokens=300, draft_tokens=3)
    opts.update(kw)
    p = kvatlas.budget_for(model, opts.pop("max_running_requests"), opts.pop("max_model_len"), **opts)
    return kvatlas.allocate(p)


ops = st.lists(st.tuples(st.sampled_from(["admit", "extend", "step", "rollback", "finish", "flush", "bad"]),
                         st.integers(0, 10**6)), min_size=1, max_size=60)


@pytest.mark.parametrize("model", ["tiny-v4", "tiny-v4.1"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_random_lifecycles_keep_invariants(model, script):
    cache = small_cache(model)
    next_id, running = 0, []
    for op, x in script:
        try:
            if op == "admit":
                prompt, new = 1 + x % 700, x % 300
                expect = cache.can_admit(prompt, new)
                try:
                    cache.admit(next_id, prompt, new)
                    running.append(next_id)
                    assert expect
                except PoolExhaustedError:
                    assert not expect
                next_id += 1
            elif op != "bad":
                apply_op(cache, op, x, running)
            else:
                unchanged_after_error(cache, cache.finish, "nobody", error=RequestStateError)
                unchanged_after_error(cache, cache.step, ["nobody"], error=RequestStateError)
                if running:
                    unchanged_after_error(cache, cache.extend, running[0], 0)
                    unchanged_after_error(cache, cache.step, [running[0], running[0]], error=RequestStateError)
        except PoolExhaustedError:
            pass  # a write beyond the reserved length may find the pool full; integrity is checked below
        cache.check_integrity()
    for rid in running:
        cache.finish(rid)
    snap = cache.check_integrity()
    assert snap.occupied_bytes == 0 and snap.running_requests == 0
    assert all(p.units_used == 0 and p.entries_used == 0 for p in snap.pools.values())


def test_refused_write_changes_nothing():
    cache = small_cache(max_running_requests=2, max_model_len=1024)
    cache.admit("a", 1000)
    cache.admit("b", 1000)
    for _ in range(4):
        cache.extend("a", 250)
        cache.extend("b", 250)
    unchanged_after_error(cache, cache.extend, "a", 301)        # beyond the chunk budget
    unchanged_after_error(cache, cache.step, ["a", "b"], 30)   # beyond max_model_len
    cache.check_integrity()


@pytest.mark.parametrize("model,context", [("deepseek-v4-flash", 4096), ("deepseek-v4-flash", 5000),
                                           ("deepseek-v4-pro", 8192), ("deepseek-v4-pro", 1000)])
def test_fill_to_the_brim(model, context):
    p = kvatlas.plan(model, "3GiB", max_running_requests=64, max_model_len=8192, chunked_prefill_tokens=1024)
    cache = kvatlas.allocate(p)
    expected = p.concurrency_in_plan(context)
    admitted = 0
    while cache.can_admit(context):
        cache.admit(admitted, context)
        admitted += 1
    assert admitted == expected
    with pytest.raises(PoolExhaustedError) as err:
        cache.admit("one-more", context)
    assert err.value.pool in ("full_pages", "request_slots")
    assert cache.ledger.admission_refusals == 1
    assert (p.num_full_pages - 1) // -(-context // 256) == expected or expected == 64
    cache.check_integrity()


def test_errors_are_clear_and_harmless():
    cache = small_cache()
    cache.admit("a", 100, 10)
    unchanged_after_error(cache, cache.admit, "a", 10, error=RequestStateError)
    unchanged_after_error(cache, cache.admit, "z", 0)
    unchanged_after_error(cache, cache.admit, "z", -5)
    unchanged_after_error(cache, cache.admit, "z", 5000)            # beyond max_model_len
    unchanged_after_error(cache, cache.step, ["a"], 0)
    unchanged_after_error(cache, cache.step, ["a"], 5)             # 1 + draft_tokens (3) at most
    unchanged_after_error(cache, cache.rollback, "a", 1)            # nothing written yet
    cache.finish("a")
    unchanged_after_error(cache, cache.finish, "a", error=RequestStateError)
    unchanged_after_error(cache, cache.step, ["a"], error=RequestStateError)
    with pytest.raises(RequestStateError):
        cache.request_usage("a")


def test_indices_follow_the_layout():
    cache = small_cache("tiny-v4", max_model_len=4096, chunked_prefill_tokens=1024)
    a = cache.allocator
    cache.admit("r", 600)
    w = cache.extend("r", 600)
    assert np.array_equal(w.positions, np.arange(600))
    page_of = a.full_table[w.request_slots[0]]
    assert np.array_equal(w.full_slots, page_of[w.positions // 256] * 256 + w.positions % 256)
    mask4, slot4 = w.compressed[4]
    assert mask4.sum() == 150 and np.array_equal(slot4[mask4], page_of[np.arange(3, 600, 4) // 256] * 64
                                                 + (np.arange(3, 600, 4) % 256) // 4)
    mask128, _ = w.compressed[128]
    assert np.flatnonzero(mask128).tolist() == [127, 255, 383, 511]
    s = w.request_slots[0]
    assert np.array_equal(w.state_rows["c4_state"], s * 16 + np.arange(600) % 16)
    # SWA: after the next forward begins, only pages holding the last window stay
    cache.step(["r"])
    held = a.swa_hi[s] - a.swa_lo[s]
    assert a.swa_lo[s] * 64 <= 601 - 128 and held <= 4
    assert cache.request_usage("r")["swa_kv"]["occupied_bytes"] == (601 - a.swa_lo[s] * 64) * 583 * 7  # 6 layers + the MTP layer


def test_grouped_forward_keeps_pages_until_it_ends():
    cache = small_cache(max_model_len=4096, chunked_prefill_tokens=1024)
    a = cache.allocator
    for rid in "ab":
        cache.admit(rid, 1000)
    with cache.allocator.forward():
        cache.extend("a", 500)
        cache.extend("b", 500)
        cache.extend("a", 300)   # same forward: a's first chunk pages stay valid
        slot = a.slot_of["a"]
        assert a.swa_lo[slot] == 0
    cache.flush()
    assert a.swa_lo[a.slot_of["a"]] == (800 - 127) // 64
    cache.check_integrity()


def test_usage_sums_to_ledger():
    cache = small_cache()
    cache.admit("a", 500)
    cache.admit("b", 300)
    cache.extend("a", 250)
    cache.extend("a", 250)
    cache.extend("b", 300)
    cache.step(["a", "b"], 3)
    cache.rollback("a", 2)
    snap = cache.check_integrity()
    for pool, usage in snap.pools.items():
        total = sum(cache.request_usage(r)[pool]["occupied_bytes"] for r in "ab")
        assert total == usage.measures.occupied_bytes, pool


def test_state_cleared_on_admission():
    cache = small_cache()
    st_pool = cache.pools["c4_state"]
    st_pool.tensor.fill_(7.0)
    adm = cache.admit("a", 10)
    rows = st_pool.tensor[adm.request_slot]
    w = rows.shape[-1]
    assert torch.all(rows[..., : w // 2] == 0) and torch.all(rows[..., w // 2:] == float("-inf"))
    assert torch.all(st_pool.tensor[adm.request_slot + 1] == 7.0)  # other slots untouched


def test_request_batch_matches_ids_and_goes_stale_safely():
    cache = small_cache()
    for rid in "abc":
        cache.admit(rid, 100, 50)
        cache.extend(rid, 100)
    batch = cache.batch(["a", "c"])
    w = cache.step(batch)
    assert w.request_slots.tolist() == [cache.allocator.slot_of["a"], cache.allocator.slot_of["c"]]
    cache.finish("b")
    cache.admit("d", 10)            # slots move under the batch: it is re-resolved, not reused
    w = cache.step(batch)
    assert w.positions.tolist() == [101, 101]
    cache.finish("c")
    unchanged_after_error(cache, cache.step, batch, error=RequestStateError)
    cache.check_integrity()


def test_rollback_belongs_to_the_forward_that_wrote():
    cache = small_cache()
    cache.admit("a", 300, 100)
    cache.extend("a", 255)
    cache.step(["a"], 4)
    cache.rollback("a", 2)          # same forward: fine
    cache.flush()                   # the forward is over: its tokens are committed
    unchanged_after_error(cache, cache.rollback, "a", 1)
    cache.check_integrity()


def test_returned_indices_belong_to_the_caller():
    cache = small_cache()
    for rid in "ab":
        cache.admit(rid, 10, 10)
        cache.extend(rid, 10)
    want = [cache.allocator.slot_of[r] for r in "ab"]
    w = cache.step(["a", "b"])
    w.request_slots[:] = 0            # the caller may scribble on what it was given …
    assert cache.step(["a", "b"]).request_slots.tolist() == want   # … without reaching the allocator
    cache.check_integrity()
