"""The allocator's resume-point upkeep (alloc/sharing.py): captures made in batches, units taken
ahead for the tails requests are about to write, tails leaving the window's bookkeeping. These
are what keep the decode step cheap; the tests pin that they never lose a tail, never cost a
resume point that a free unit could have spared, and leave nothing behind."""

import numpy as np

from kvatlas import allocate, plan
from kvatlas.alloc.sharing import CACHE_OWNER, NO_ROW


def cache(requests=4, checkpoints=8, **kw):
    opts = dict(max_model_len=4096, max_running_requests=requests, prefix_checkpoints=checkpoints,
                chunked_prefill_tokens=1024)
    opts.update(kw)
    return allocate(plan("tiny-v4", "64MiB", **opts), backend="none")


def start(c, rid, tokens, seed=0):
    ids = np.random.default_rng(seed).integers(0, 1000, tokens + 600)
    c.admit(rid, tokens, 600, token_ids=ids[:tokens])
    c.extend(rid, tokens)
    return ids


def test_a_decode_step_reads_its_rows_from_units_taken_ahead():
    c = cache()
    a = c.allocator
    start(c, "r", 230)      # 26 tokens before the 256 boundary: within the upkeep's look-ahead
    c.flush()                # the upkeep: a unit for the boundary's tail, before it is written
    slot = a.slot_of["r"]
    unit = int(a.pend_u[slot])
    assert a.pend_b[slot] == 256 and unit > 0
    assert a.row_base[slot] == unit * 4 - 252
    seen = {}
    for _ in range(30):
        w = c.step(["r"])
        for name, (tok, rows) in w.checkpoint_rows.items():
            for t, r in zip(tok.tolist(), rows.tolist()):
                seen.setdefault(name, []).append((int(w.positions[t]), r))
    # the 4 positions before the boundary, each written once, into rows 0..3 of the unit
    want = [(252 + i, unit * 4 + i) for i in range(4)]
    assert seen == {"ckpt.c4_state": want, "ckpt.c4_indexer_state": want}
    c.check_integrity()


def test_a_capture_waits_for_the_upkeep_and_keeps_the_exact_tail():
    c = cache()
    a = c.allocator
    start(c, "r", 200)
    slot = a.slot_of["r"]
    tail = None
    for _ in range(100):
        L = int(a.length[slot])
        if L == 256:         # the boundary is reached: these are the pages its tail must keep
            tail = a.swa_table[slot, np.arange(2, 4) % a.ring].copy()
        if L >= 256 and a.pend_b[slot] == 0:
            break
        c.step(["r"])
        c.check_integrity()
    assert tail is not None
    assert 256 < int(a.length[slot]) <= 256 + a._defer_limit   # made by the upkeep, not later
    # well before the tail's first page could have retired (256 + 63), and exactly those pages
    assert int(a.length[slot]) < 256 + 63
    assert np.array_equal(c.prefix._tent_pages[:, slot], tail)
    assert np.all(a.swa.owner[tail] == CACHE_OWNER) and np.all(a.swa_refs[tail] == 1)
    assert a.swa_lo[slot] == 4   # the tail left the window's bookkeeping; the request still reads it
    while a.length[slot] < 512 + 40:   # past the tail's retirement and the next boundary's capture
        c.step(["r"])
    c.flush()
    assert a.swa.owner[tail].tolist() == [0, 0]   # dropped with the point (the policy keeps none)
    c.check_integrity()


def test_units_taken_ahead_go_back_before_a_cached_resume_point_is_evicted():
    c = cache(requests=4, checkpoints=2)
    a = c.allocator
    ids = start(c, "done", 600, seed=1)
    for _ in range(5):
        c.step(["done"])
    c.finish("done", token_ids=ids[:605])   # its points join the tree
    kept = c.prefix.tree.checkpoints
    assert kept >= 1
    for i in range(4):                        # running requests with units taken for their tails
        start(c, f"r{i}", 240 + i, seed=10 + i)
    c.flush()
    ahead = int(np.count_nonzero((a.pend_b > 0) & (a.length <= a.pend_b - 4)))
    assert ahead >= 1
    taken = []
    while a.ckpt.free:                        # use up the free units
        taken.append(a._take_checkpoint_unit(0))
    unit = a._take_checkpoint_unit(0)         # short: the units taken ahead go back first
    assert unit > 0 and c.prefix.tree.checkpoints == kept
    assert not np.any((a.pend_b > 0) & (a.length <= a.pend_b - 4))
    a.release_checkpoints(np.array(taken + [unit]), np.zeros((len(taken) + 1, 0), np.int64))
    for _ in range(40):                       # the requests still write exact rows: the general path
        w = c.step([f"r{i}" for i in range(4)])
        for tok, rows in w.checkpoint_rows.values():
            assert np.all(rows >= 0)
    c.check_integrity()


def test_a_request_finished_on_the_allocator_leaves_no_resume_point_behind():
    c = cache()
    a = c.allocator
    start(c, "r", 700)
    c.flush()
    slot = a.slot_of["r"]
    assert c.prefix._tent_u[slot] > 0            # its latest point, undecided
    a.finish("r")                                  # past the cache
    assert "r" not in c.prefix.requests
    assert c.prefix._tent_u[slot] == 0 and a.pend_b[slot] == 0 and a.row_base[slot] == NO_ROW
    assert a.ckpt.used == 0 and c.prefix.tree.checkpoints == 0
    c.check_integrity()


def test_a_request_written_twice_in_one_pass_gets_the_unit_of_the_tail_it_reaches():
    """A grouped pass may write one request more than once: its second write here crosses 256
    and reaches the tail of 512 before any upkeep has captured 256. Its rows must be those of a
    unit for 512, not rows past the one for 256 (beyond the checkpoint buffers)."""
    c = cache()
    a = c.allocator
    start(c, "r", 200)
    c.flush()
    slot = a.slot_of["r"]
    first = int(a.pend_u[slot])
    with a.forward():
        w1 = a.extend("r", 200)   # 200..399: the tail of 256
        w2 = a.extend("r", 200)   # 400..599: the tail of 512
    assert w1.positions[w1.checkpoint_rows["ckpt.c4_state"][0]].tolist() == [252, 253, 254, 255]
    assert w1.checkpoint_rows["ckpt.c4_state"][1].tolist() == [first * 4 + i for i in range(4)]
    tok, rows = w2.checkpoint_rows["ckpt.c4_state"]
    assert w2.positions[tok].tolist() == [508, 509, 510, 511]
    second = int(a.pend_u[slot])
    assert a.pend_b[slot] == 512 and second not in (0, first)
    assert rows.tolist() == [second * 4 + i for i in range(4)]
    c.flush()   # both captures made, each with its own tail
    assert a.pend_b[slot] == 0 and not a.older
    c.check_integrity()


def test_small_writes_grouped_in_one_pass_still_capture_before_the_tail_retires():
    """The upkeep's wait is counted in tokens of progress: two 40-token writes of one request in
    one pass count 80, so the capture of 256 comes before the tail's first page retires (at 319)."""
    c = cache()
    a = c.allocator
    start(c, "r", 240)
    c.flush()
    slot = a.slot_of["r"]
    with a.forward():
        a.extend("r", 40)   # 240..279: crosses 256
        a.extend("r", 40)   # 280..319
    tail = a.swa_table[slot, np.arange(2, 4) % a.ring].copy()
    c.step(["r"])           # the next pass begins: the upkeep first, then retiring
    assert a.pend_b[slot] == 0
    assert np.array_equal(c.prefix._tent_pages[:, slot], tail)
    c.check_integrity()


def expected_rows(a, w) -> set:
    """The rows a write must name, from the pending points as they stand after it: each token in
    a boundary's last 4 positions, in the unit pending for that boundary (if one was taken)."""
    out = set()
    pos, slots = w.positions, w.request_slots
    for j in np.flatnonzero(pos % a.P >= a.P - 4).tolist():
        s, b = int(slots[j]), int(pos[j]) // a.P * a.P + a.P
        unit = int(a.pend_u[s]) if a.pend_b[s] == b else a.older.get(s, {}).get(b, 0)
        if unit:
            out.add((j, unit * 4 + int(pos[j]) - (b - 4)))
    return out


def named_rows(w) -> set:
    tok, rows = w.checkpoint_rows.get("ckpt.c4_state", (np.zeros(0, np.int64),) * 2)
    return set(zip(tok.tolist(), rows.tolist()))


def test_a_steady_batch_reads_its_rows_from_a_schedule_that_matches_the_pending_points():
    """Decode steps of an unchanged batch take their rows from a schedule made once per page of progress;
    disruptions (a rollback, another request's chunk, an admission, a finish) end it. Every step
    names exactly the rows of the units pending for the tails its tokens are in."""
    c = cache(requests=6, checkpoints=16)
    a = c.allocator
    rng = np.random.default_rng(5)
    for i in range(4):
        start(c, f"r{i}", int(rng.integers(150, 700)), seed=i)
    batch = [f"r{i}" for i in range(4)]
    scheduled = 0
    for step in range(600):
        w = c.step(batch)
        scheduled += a._schedule is not None
        assert named_rows(w) == expected_rows(a, w)
        if step % 97 == 50:
            a.rollback(batch[step % 4], 1)
        if step % 131 == 70:   # another request's prefill chunk in its own pass
            start(c, f"x{step}", 100, seed=step)
            c.finish(f"x{step}")
        c.check_integrity()
    assert scheduled > 500   # the schedule served most steps


def short_batch(seed: int, lengths: tuple, n: int = 20):
    """n requests started at lengths drawn from [lo, hi) in a plan with few units to spare (28 in
    all, 5 held back for chunks): (cache, allocator, the batch's ids)."""
    c = allocate(plan("tiny-v4", "256MiB", max_model_len=1024, max_running_requests=20, prefix_checkpoints=2,
                      chunked_prefill_tokens=1024), backend="none")
    rng = np.random.default_rng(seed)
    for i in range(n):
        start(c, f"r{i}", int(rng.integers(*lengths)), seed=i)
    return c, c.allocator, [f"r{i}" for i in range(n)]


def test_a_steady_batch_short_of_units_keeps_its_schedule_and_names_the_rows_of_the_units_it_took():
    """More tails about to be written than spare units (20 requests a few tokens apart): the
    tails no unit was taken ahead for take one as they are first written, or get none, between
    upkeeps. The schedule survives that (its rows are patched where row_base changes), and every
    step names exactly the rows of the units pending for the tails its tokens are in."""
    c, a, batch = short_batch(11, (200, 215))
    touched, touch = [], a._touch

    def counted(s, bnd, units, miss):   # (tails first written with no unit taken ahead)
        got = touch(s, bnd, units, miss)
        touched.append((a._schedule is not None, int(np.count_nonzero(got[miss])), int(miss.sum())))
        return got

    a._touch = counted
    scheduled = 0
    for _ in range(400):
        w = c.step(batch)
        scheduled += a._schedule is not None
        assert named_rows(w) == expected_rows(a, w)
        c.check_integrity()
    assert len(touched) >= 8 and all(on for on, _, _ in touched)   # on the schedule, each time
    assert 0 < sum(got for _, got, _ in touched) < sum(n for _, _, n in touched)   # some got a unit, some none
    assert scheduled > 390


def test_the_schedule_takes_the_units_the_scan_takes_step_by_step():
    """The same steady batch, short of units, stepped twice: once from the schedule, once by the
    scan every step (the schedule off). Every step names the same rows, and after every step the
    pending boundaries, units, rows and free units agree: the schedule changes the cost of a
    step, never which tail gets which unit. Disruptions (a rollback, a finish and an admission)
    end the schedule now and then."""
    runs = []
    for scheduled in (True, False):
        c, a, batch = short_batch(3, (200, 230), n=18)
        if not scheduled:
            a._steady_rows = lambda *args: None
        seen, used = [], 0
        for step in range(420):
            w = c.step(batch)
            used += a._schedule is not None
            seen.append((sorted(named_rows(w)), a.pend_b.tolist(), a.pend_u.tolist(), a.row_base.tolist(),
                         a.ckpt.free))
            if step == 150:
                a.rollback(batch[3], 1)
            if step == 300:
                c.finish(batch.pop(5))
                start(c, "late", 240, seed=99)
                batch.append("late")
            c.check_integrity()
        runs.append((seen, used))
    (on, used_on), (off, used_off) = runs
    assert used_on > 380 and used_off == 0
    for step, (x, y) in enumerate(zip(on, off)):
        assert x == y, f"step {step}"


def test_units_taken_ahead_go_to_the_nearest_tails_in_slot_order_among_ties():
    """Short of units, an upkeep gives the spare ones to the tails nearest to being written
    (ties: the lower slot first) and sets the next interval from the nearest tail left without
    one. Checked at every upkeep of a batch of 20 requests spread over a page, against the rule
    restated here, with none, few and many units to spare."""
    c, a, batch = short_batch(4, (150, 400))
    take, checked, spares = a._take_ahead, [], set()

    def checked_take():
        P, k, most, slack = a.P, a.resume_tokens, a._interval_most, a._ahead_slack
        spare = max(a.ckpt.free - a._unit_reserve, 0)
        before = {s: (P - k) - int(a.length[s]) % P for s in range(len(a.length))}
        want = [s for s, b in before.items() if 0 <= b <= most + slack - k and a.length[s] < a._last_boundary
                and a.pend_b[s] == 0]
        near = sorted(want, key=lambda s: (before[s], s))
        given = near[:spare]
        interval = most if len(want) <= spare else max(before[near[spare]] + k - slack - 1, min(16, most))
        was = a.pend_b.copy()
        take()
        got = sorted(s for s in range(len(was)) if was[s] == 0 and a.pend_b[s] != 0)
        assert got == sorted(given) and a._defer_limit == interval
        checked.append(len(want) > spare)
        spares.add(min(spare, 2))

    a._take_ahead = checked_take
    held = [a._take_checkpoint_unit(0) for _ in range(a.ckpt.free - a._unit_reserve - 2)]   # (few left to spare)
    for _ in range(400):
        c.step(batch)
    a.release_checkpoints(np.array(held), np.zeros((len(held), 0), np.int64))
    c.check_integrity()
    assert sum(checked) >= 8 and spares == {0, 1, 2}   # short of units at some upkeeps: none, one, several spare


def test_the_schedule_follows_one_slot_changed_whether_given_as_int_numpy_integer_or_array():
    c, a, batch = short_batch(3, (200, 230))
    for _ in range(30):
        c.step(batch)
    sched = a._schedule
    assert sched is not None
    s = a.slot_of[batch[0]]
    i, b0, u0 = int(sched.where[s]), int(a.pend_b[s]), int(a.pend_u[s])
    for slot in (int(s), np.int64(s), np.array([s])):
        a._set_pending(slot, b0 + a.P, 0)
        assert sched.rows[i] == NO_ROW + sched.pos[i]
        a._clear_pending(slot)
        assert sched.rows[i] == NO_ROW + sched.pos[i]
        a._set_pending(slot, b0, u0)   # (as it was)
        assert sched.rows[i] == a.row_base[s] + sched.pos[i]
    a._clear_pending(np.zeros(0, np.int64))   # (no slot: nothing changes)
    c.step(batch)
    c.check_integrity()


def test_units_short_within_a_write_capture_nothing_that_write_reached():
    """A chunk crossing several boundaries with no free unit: sparing units within the write
    must not capture the boundaries the same (not yet final) write reached; their rows are still
    to be saved and a rollback could rewrite them."""
    c = cache(requests=4, checkpoints=2)
    a = c.allocator
    start(c, "r", 200)
    c.flush()
    slot = a.slot_of["r"]
    first = int(a.pend_u[slot])
    assert a.pend_b[slot] == 256 and first
    taken = []
    while a.ckpt.free:
        taken.append(a._take_checkpoint_unit(0))
    w = a.extend("r", 600)   # 200..799: the tails of 256, 512 and 768
    assert named_rows(w) == expected_rows(a, w)
    assert {a.pend_b[slot]: a.pend_u[slot], **a.older.get(slot, {})}.get(256) == first   # not captured yet
    a.rollback("r", 300)   # back to 500: rewrites the tail of 512 later, 256 stays
    a.release_checkpoints(np.array(taken), np.zeros((len(taken), 0), np.int64))
    held_rows(a, a.extend("r", 300))
    c.flush()
    assert not a.older and a.pend_b[slot] == 0
    c.check_integrity()


def _random_session(seed: int, operations: int) -> int:
    """Random admissions (most sharing one prompt), chunks, decode steps with drafts and
    rollbacks, finishes (some past the cache) and flushes, with few units: integrity after every
    operation, and every resume row in a unit the cache holds."""
    rng = np.random.default_rng(seed)
    c = cache(requests=6, checkpoints=int(rng.choice([2, 4, 8])), chunked_prefill_tokens=512,
              draft_tokens=int(rng.choice([0, 1, 3])))
    a = c.allocator
    shared = rng.integers(0, 50, 4096)
    running, n = {}, 0   # id -> [token ids, tokens written, prompt tokens]
    for _ in range(operations):
        op = rng.random()
        if op < 0.08 and len(running) < 6:
            prompt = int(rng.integers(50, 1500))
            ids = shared.copy() if rng.random() < 0.6 else rng.integers(0, 50, 4096)
            ids[rng.integers(0, 4096)] += int(rng.integers(0, 2))
            if c.prefix.can_admit(prompt, 1200, token_ids=ids[:prompt]):
                running[f"r{n}"] = [ids, c.admit(f"r{n}", prompt, 1200, token_ids=ids[:prompt]).cached_tokens, prompt]
                n += 1
        elif op < 0.25 and running:
            rid = list(running)[rng.integers(len(running))]
            r = running[rid]
            if r[1] < r[2]:
                k = min(int(rng.integers(1, 513)), r[2] - r[1])
                if rng.random() < 0.3 and r[1] + k < r[2]:   # two chunks of it in one pass
                    k2 = min(int(rng.integers(1, 300)), r[2] - r[1] - k)
                    with a.forward():
                        held_rows(a, c.extend(rid, k))
                        held_rows(a, c.extend(rid, k2))
                    k += k2
                else:
                    held_rows(a, c.extend(rid, k))
                r[1] += k
        elif op < 0.85:
            batch = [rid for rid, r in running.items() if r[2] <= r[1] < r[2] + 1190]
            if batch:
                each = int(rng.integers(1, 2 + a.plan.options.draft_tokens))
                held_rows(a, c.step(batch, each))
                for rid in batch:
                    back = int(rng.integers(0, each)) if rng.random() < 0.3 else 0
                    if back:
                        a.rollback(rid, back)
                    running[rid][1] += each - back
        elif op < 0.93 and running:
            rid = list(running)[rng.integers(len(running))]
            ids, written, _ = running.pop(rid)
            if rng.random() < 0.1:
                a.finish(rid)   # past the cache
            else:
                c.finish(rid, token_ids=ids[:written])
        elif op < 0.97:
            c.flush()
        c.check_integrity()
    return c.prefix.stats.hit_tokens


def held_rows(a, w) -> None:
    """Every resume row a write names lies in a checkpoint unit the cache holds, and they are
    exactly the rows of the units pending for the tails its tokens are in."""
    for tok, rows in w.checkpoint_rows.values():
        assert np.all(rows >= 0) and np.all(rows < len(a.ckpt.owner) * 4)
        assert np.all(a.ckpt.owner[rows // 4] == CACHE_OWNER)
    assert named_rows(w) == expected_rows(a, w)


def test_random_sessions_keep_integrity_and_resume_rows_in_held_units():
    hits = [_random_session(seed, 700) for seed in (1, 2)]
    assert min(hits) > 0   # the sessions do share prefixes


def test_tails_short_of_units_take_the_free_ones_in_one_pop_as_one_by_one_would():
    """_touch takes the free units for fresh slots' tails in one pop, then goes one by one for
    the rest (sparing, evicting, or none). The same batch stepped with a _touch that takes every
    unit one by one (_pending_unit per token, the rule restated) ends every step with the same
    pending boundaries, units, rows and free units; some steps had fewer free units than tails."""
    runs = []
    for batched in (True, False):
        c, a, batch = short_batch(4, (240, 243))   # (tails first written together: 5 free units for 7)
        partial = []
        if batched:
            touch = a._touch

            def watched(s, bnd, units, miss):
                partial.append(0 < a.ckpt.free < int(miss.sum()))
                return touch(s, bnd, units, miss)
            a._touch = watched
        else:
            def one_by_one(s, bnd, units, miss):
                for j in miss.nonzero()[0].tolist():
                    units[j] = a._pending_unit(int(s[j]), int(bnd[j]))
                return units
            a._touch = one_by_one
        seen = []
        for _ in range(300):
            w = c.step(batch)
            seen.append((sorted(named_rows(w)), a.pend_b.tolist(), a.pend_u.tolist(), a.row_base.tolist(),
                         a.ckpt.free, a.ledger.checkpoints_skipped))
            c.check_integrity()
        runs.append((seen, partial))
    (on, partial), (off, _) = runs
    assert any(partial)   # a touch found some free units, fewer than its tails
    for step, (x, y) in enumerate(zip(on, off)):
        assert x == y, f"step {step}"


def test_pending_units_given_as_an_array_with_zeros_leave_those_slots_without_a_row():
    c, a, batch = short_batch(3, (200, 230))
    for _ in range(30):
        c.step(batch)
    s0, s1 = a.slot_of[batch[0]], a.slot_of[batch[1]]
    keep = [(s, int(a.pend_b[s]), int(a.pend_u[s])) for s in (s0, s1)]
    slots = np.array([s0, s1])
    a._set_pending(slots, np.array([512, 768]), np.array([7, 0]))
    assert a.row_base[s0] == 7 * 4 - (512 - 4) and a.row_base[s1] == NO_ROW
    assert a.pend_u[s1] == 0 and a.pend_b[s1] == 768
    for s, b, u in keep:   # (as it was)
        a._set_pending(s, b, u)
    c.check_integrity()


def test_a_free_slot_with_a_pending_point_is_found():
    c, a, batch = short_batch(3, (200, 230), n=4)
    c.finish(batch[0])
    free = next(s for s in range(1, len(a.pend_b)) if a.rid_of[s] is None)
    a.pend_b[free] = 256
    problems = a.cached_swa_check(sorted(a.slot_of.values()))
    assert any("free request slot has a pending resume point" in p for p in problems)
    a.pend_b[free] = 0
    a.row_base[free] = 5
    assert any("free request slot" in p for p in a.cached_swa_check(sorted(a.slot_of.values())))
    a.row_base[free] = NO_ROW
    c.check_integrity()



def test_a_tail_kept_at_once_rejoins_its_window_only_with_its_own_pages():
    """Captures the policy keeps at once (every page here) put their tails back in their
    requests' windows with a reference each (keep_own_tail); a tail whose pages are not what the
    window's columns hold (here: the same call with one page changed) is left alone."""
    c = allocate(plan("tiny-v4", "256MiB", max_model_len=2048, max_running_requests=6, prefix_checkpoints=64,
                      chunked_prefill_tokens=1024), backend="none", prefix_policy="every-page")
    a = c.allocator
    one, calls = a.keep_own_tail, []

    def watched(slot, boundary, pages):
        state = (a.swa_lo.copy(), a.swa_refs.copy(), a._windowed_cached)
        wrong = np.array(pages).copy()
        wrong[-1] += 1
        one(slot, boundary, wrong)   # not its pages: nothing changes
        assert a._windowed_cached == state[2] and np.array_equal(a.swa_lo, state[0])
        assert np.array_equal(a.swa_refs, state[1])
        one(slot, boundary, pages)
        calls.append(a._windowed_cached - state[2])
        if calls[-1]:   # rejoined: the window starts at the tail again, each page one reference more
            lo = boundary // a.Ps - len(pages)
            assert a.swa_lo[slot] == lo and np.array_equal(a.swa_refs[pages], state[1][pages] + 1)
    a.keep_own_tail = watched
    for i, n in enumerate((200, 230, 250, 300, 420, 510)):
        start(c, f"r{i}", n, seed=i)
    batch = [f"r{i}" for i in range(6)]
    for _ in range(600):
        c.step(batch)
        c.check_integrity()
    assert len(calls) >= 10 and sum(1 for d in calls if d) >= 5
