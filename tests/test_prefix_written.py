"""Pages shared as they are written (issue 34): a long system prompt, its first request still in
prefill, followers arriving after each of its chunks. Each follower resumes at the last page the
first has completed in a pass that is over (every page keeps its resume point here), reads exactly
what its cold twin reads, and the miss reason names the pages not written yet. The writer's
drafts rolled back, its being cut short, eviction and the host tier never change what a reader
reads (the twins compared and every book recounted after each operation)."""

import numpy as np
import pytest

from kvatlas import allocate, plan
from kvatlas.tiers import attach_host_tier
from prefix_model import Model
from prefix_session import Session

P, CHUNK, SYSTEM = 256, 256, 2000   # the system prompt: 7 full pages and 208 tokens


def make_session(share=True, policy="every-page", host=None):
    p = plan("tiny-v4", "48MiB", max_model_len=4096, max_running_requests=6, prefix_checkpoints=16,
             chunked_prefill_tokens=CHUNK, draft_tokens=3, pp=2)
    s = Session(p)
    s.hot = allocate(p, prefix_policy=policy)
    s.mh = Model(s.hot)
    s.hot.prefix.share_as_written = share
    link = attach_host_tier(s.hot, host, checkpoint_share=0.5) if host else None
    return s, link


def request(rng, system, extra=300, out=8):
    prompt = np.concatenate((system, rng.integers(0, 50_000, extra)))
    return np.concatenate((prompt, rng.integers(0, 50_000, out))), len(prompt)


def test_followers_hit_the_pages_the_first_has_written_so_far():
    s, _ = make_session()
    rng = np.random.default_rng(3)
    system = rng.integers(0, 50_000, SYSTEM)
    seq, prompt = request(rng, system)
    s.admit(seq, prompt, len(seq) - prompt)
    writer = "r0"
    hits = []
    for chunk in range(4):   # the writer prefills 4 chunks; a follower arrives after each
        s.extend(writer, CHUNK)
        s.hot.flush()        # the pass is over (an engine's pass end): its pages are committed
        s.cold.flush()
        before = s.hot.prefix.stats.missed()["not_written_yet"]
        f_seq, f_prompt = request(rng, system, extra=50 + chunk, out=4)
        s.admit(f_seq, f_prompt, len(f_seq) - f_prompt)
        rid = f"r{s.next_id - 1}"
        cached = int(s.hot.allocator.length[s.hot.allocator.slot_of[rid]])
        hits.append(cached)
        # every page the writer completed, none it has not: chunk + 1 pages of 256
        assert cached == (chunk + 1) * P
        # the system prompt's pages past them: a running request will write them
        assert s.hot.prefix.stats.missed()["not_written_yet"] - before == (SYSTEM // P - (chunk + 1)) * P
        s.extend(rid, min(CHUNK, f_prompt - cached))   # the follower writes past its hit
        s.check(f"follower {chunk} writes")
        s.finish(rid)   # cut short: its pages past the shared ones are its own
        s.check(f"follower {chunk} cut short")
    assert hits == [256, 512, 768, 1024]
    while s.running[writer].written < prompt:
        s.extend(writer, min(CHUNK, prompt - s.running[writer].written))
    for tokens, accepted in ((4, 2), (4, 1), (2, 2), (4, 3)):   # drafts rolled back
        s.step(writer, tokens, accepted)
    s.check("writer's drafts")
    s.finish(writer)
    s.check("writer finished")


def test_without_sharing_as_written_followers_wait_for_the_finish():
    """The control: the same workload with pages shared only at finish hits nothing while the
    first request runs, and counts the system prompt as never cached."""
    s, _ = make_session(share=False)
    rng = np.random.default_rng(3)
    system = rng.integers(0, 50_000, SYSTEM)
    seq, prompt = request(rng, system)
    s.admit(seq, prompt, len(seq) - prompt)
    for _ in range(3):
        s.extend("r0", CHUNK)
        s.hot.flush()
    f_seq, f_prompt = request(rng, system, out=4)
    s.admit(f_seq, f_prompt, len(f_seq) - f_prompt)
    assert s.hot.allocator.length[s.hot.allocator.slot_of["r1"]] == 0
    assert s.hot.prefix.stats.missed()["not_written_yet"] == 0
    s.check("control")


@pytest.mark.parametrize("host", [None, "8MiB"])
def test_readers_of_a_running_writer_read_what_a_cold_run_reads(host):
    """Readers admitted mid-prefill of the writer; the writer then decodes with drafts rolled back
    and is cut short while they still read its pages; everything evictable is evicted (offloaded
    to the host tier when there is one) and a late follower takes the prefix back; every step
    compared with the cold twin, every book recounted."""
    s, link = make_session(host=host)
    rng = np.random.default_rng(5)
    system = rng.integers(0, 50_000, SYSTEM)
    seq, prompt = request(rng, system, extra=600, out=16)
    s.admit(seq, prompt, len(seq) - prompt)
    writer = "r0"
    for _ in range(5):
        s.extend(writer, CHUNK)
        s.hot.flush()
        s.cold.flush()
    readers = []
    for i in range(2):
        f_seq, f_prompt = request(rng, system, extra=100 + i, out=6)
        s.admit(f_seq, f_prompt, len(f_seq) - f_prompt)
        readers.append(f"r{s.next_id - 1}")
    got = [int(s.hot.allocator.length[s.hot.allocator.slot_of[r]]) for r in readers]
    assert all(0 < g <= 5 * P for g in got), got   # both resumed inside what the writer wrote
    s.check("readers admitted")
    while s.running[writer].written < prompt:   # the writer goes on while they read its pages
        s.extend(writer, min(CHUNK, prompt - s.running[writer].written))
        for r in readers:
            q = s.running[r]
            if q.written < q.prompt:
                s.extend(r, min(64, q.prompt - q.written))
    s.check("side by side")
    for tokens, accepted in ((4, 1), (3, 3), (4, 2)):
        s.step(writer, tokens, accepted)
    s.check("writer's drafts")
    s.finish(writer)   # cut short (16 tokens to go): its shared pages stay with the readers
    s.check("writer cut short")
    tree = s.hot.prefix.tree
    while tree.evict_checkpoint():
        pass
    tree.evict_pages(len(tree.nodes))   # the readers' pages are held: only the rest goes
    s.check("evicted what nobody reads")
    for r in readers:
        q = s.running[r]
        while q.written < q.prompt:
            s.extend(r, min(CHUNK, q.prompt - q.written))
        while q.written < len(q.seq):
            s.step(r, 2, 1)
    s.check("readers done")
    for r in readers:
        s.finish(r)
    s.check("all finished")
    if link is not None:   # a late follower: the system prompt comes back from the host tier
        f_seq, f_prompt = request(rng, system, extra=40, out=4)
        ready = link.prefetch(f_prompt, token_ids=f_seq[:f_prompt])
        if ready is not None:
            ready.wait()
        s.admit(f_seq, f_prompt, len(f_seq) - f_prompt)
        s.check("late follower")
        link.tier.check_integrity()


def test_decode_pages_are_shared_as_they_fill():
    """A writer decoding (drafts rolled back) gives its sequence as it goes; a follower whose
    prompt continues that sequence hits the decode pages committed so far, while the writer runs,
    and reads what its cold twin reads. Ids that contradict the prompt are refused."""
    from kvatlas.prefix.keys import ContentMismatchError
    s, _ = make_session()
    rng = np.random.default_rng(9)
    seq, prompt = request(rng, rng.integers(0, 50_000, 400), extra=100, out=700)   # 500-token prompt
    s.admit(seq, prompt, len(seq) - prompt)
    w = s.running["r0"]
    s.extend("r0", 256)
    s.extend("r0", prompt - 256)
    while w.written < 1100:   # decode to page 4 with drafts, giving the sequence now and then
        s.step("r0", 3, 1 + w.written % 3)
        if w.written % 7 == 0 and w.written < 900:   # (pages 0-2 keyed; page 3 waits for the call below)
            s.hot.generated("r0", w.seq[: w.written])
    s.hot.flush()
    s.cold.flush()
    with pytest.raises(ContentMismatchError):
        s.hot.generated("r0", np.concatenate(([w.seq[0] + 1], w.seq[1: w.written])))
    assert s.hot.generated("r0", w.seq[: w.written]) == w.written // P   # every committed page keyed
    s.hot.flush()   # the pass is over: they are shared
    f_prompt = w.written + 30
    f_seq = np.concatenate((w.seq[: w.written], rng.integers(0, 50_000, 34)))
    s.admit(f_seq, f_prompt, 4)
    slot = s.hot.allocator.slot_of["r1"]
    assert s.hot.allocator.length[slot] == w.written // P * P   # 1024: past the 500-token prompt
    s.check("follower of a decoding writer")
    s.finish("r0")   # cut short while the follower reads its decode pages
    q = s.running["r1"]
    s.extend("r1", q.prompt - q.written)
    s.check("follower after the writer left")


def test_a_follower_resumes_at_the_running_writers_latest_point():
    """kvatlas's policy keeps no intermediate point here (its spacing is wider than the prompt), so
    past its hit the writer holds one resume point, the one it reached last, not yet kept or
    dropped: a follower admitted while it runs resumes there (the point is kept from then on),
    reads what its cold twin reads, and so does a second one at the writer's next point; the
    writer then rolls drafts back and finishes while they read its pages."""
    s, _ = make_session(policy="kvatlas")
    assert s.hot.prefix.policy.spacing_pages > SYSTEM // P
    rng = np.random.default_rng(4)
    system = rng.integers(0, 50_000, SYSTEM)
    seq, prompt = request(rng, system)
    s.admit(seq, prompt, len(seq) - prompt)
    stats = s.hot.prefix.stats
    for chunk, want in ((3, 3 * P), (2, 5 * P)):
        for _ in range(chunk):
            s.extend("r0", CHUNK)
            s.hot.flush()
            s.cold.flush()
        f_seq, f_prompt = request(rng, system, extra=70, out=4)
        s.admit(f_seq, f_prompt, len(f_seq) - f_prompt)
        rid = f"r{s.next_id - 1}"
        assert int(s.hot.allocator.length[s.hot.allocator.slot_of[rid]]) == want
        assert s.hot.prefix.tree.nodes[int(s.hot.prefix.requests[rid].keys[want // P - 1])].checkpoint is not None
        s.check(f"follower at {want}")
        s.extend(rid, CHUNK)
        s.check(f"follower at {want} writes")
    assert stats.writer_points_read == 2
    while s.running["r0"].written < prompt:
        s.extend("r0", min(CHUNK, prompt - s.running["r0"].written))
    for tokens, accepted in ((4, 2), (4, 1), (3, 3)):
        s.step("r0", tokens, accepted)
    s.check("writer's drafts")
    s.finish("r0")
    s.check("writer cut short")


def test_a_point_kept_while_its_writer_reads_its_tail_never_frees_that_tail():
    """A writer decoding one token a step passes a boundary; its point there is kept at once
    (every-page) and joins the tree with the decode page (`generated`), while the writer's window
    still reads the point's SWA tail. Every resume point and idle page is evicted and a fresh
    request takes free SWA pages: no page the writer reads was freed (its tail is held for it
    with a reference), and it reads exactly what its cold twin reads."""
    s, _ = make_session(policy="every-page")
    rng = np.random.default_rng(6)
    seq, prompt = request(rng, rng.integers(0, 50_000, 400), extra=212, out=200)   # 612-token prompt
    s.admit(seq, prompt, len(seq) - prompt)
    w = s.running["r0"]
    for n in (CHUNK, CHUNK, prompt - 2 * CHUNK):
        s.extend("r0", n)
    while w.written < 3 * P + 5:   # one token a step, past the boundary at 768
        s.step("r0", 1, 1)
    s.hot.flush()
    s.cold.flush()
    assert s.hot.generated("r0", w.seq[: w.written]) == 3
    s.hot.flush()
    tree = s.hot.prefix.tree
    assert max(n.depth for n in tree.nodes.values() if n.checkpoint is not None) == 3
    while tree.evict_checkpoint():
        pass
    tree.evict_pages(len(tree.nodes))
    s.check("everything evictable evicted")
    a = s.hot.allocator
    slot, L = a.slot_of["r0"], int(a.length[a.slot_of["r0"]])
    read = a.swa_table[slot, np.arange((L - (a.window - 1)) // a.Ps, (L - 1) // a.Ps + 1) % a.ring]
    assert np.all(a.swa.owner[read] != 0), "an SWA page the writer's window reads was freed"
    fresh, fresh_prompt = request(rng, rng.integers(0, 50_000, 600), extra=10, out=4)
    s.admit(fresh, fresh_prompt, len(fresh) - fresh_prompt)
    s.extend("r1", CHUNK)
    s.step("r0", 1, 1)
    s.check("the writer after another took free SWA pages")


def test_eviction_thins_intermediate_points_by_level():
    """With `thin` (kvatlas's policy), intermediate points leave by level, the trailing zero bits
    of their page: the odd pages' first, then those of pages 2 and 6, then 4; the end stays
    last. A cache whose spacing grew keeps an even grid, not its newest regions only."""
    from kvatlas.prefix.policy import MARKED, Policy
    every = Policy("every-page-thinned", keep_intermediate=True, protect_marked=True, spacing_pages=1, thin=True)
    assert [every.eviction_class(end=False, divergence=False, page=p) for p in range(1, 9)] == [0, 1, 0, 2, 0, 1, 0, 3]
    assert every.eviction_class(end=True, divergence=False, page=3) == MARKED
    p = plan("tiny-v4", "48MiB", max_model_len=4096, max_running_requests=2, prefix_checkpoints=16,
             chunked_prefill_tokens=CHUNK, pp=2)
    cache = allocate(p, prefix_policy=every)
    ids = np.random.default_rng(2).integers(0, 50_000, 8 * P + 1)
    cache.admit("a", len(ids), 1, token_ids=ids)
    for _ in range(9):
        cache.extend("a", min(CHUNK, len(ids) - int(cache.allocator.length[0])))
    cache.flush()
    cache.finish("a")
    tree = cache.prefix.tree

    def pages():
        return sorted(n.depth for n in tree.nodes.values() if n.checkpoint is not None)
    assert pages() == [1, 2, 3, 4, 5, 6, 7, 8]
    for left in ([2, 4, 6, 8], [4, 8], [8]):
        while len(pages()) > len(left):
            assert tree.evict_checkpoint()
        assert pages() == left
        cache.check_integrity()


def run_trace(tmp_path, share: bool, hold: int = 0):
    """A long shared system prompt (40 blocks of 512 tokens, several chunks of prefill) and 15
    followers arriving 2 ms apart while its first request is still in prefill, replayed by the
    simulator (bookkeeping backend, every book recounted after every pass); `hold`: passes the
    simulator may hold a follower for its writer (cache-aware admission)."""
    import json

    from kvatlas.cli import _parse
    from kvatlas.cli.common import plan_from_args
    from kvatlas.cli.drive import build
    trace = tmp_path / "system.jsonl"
    system = list(range(40))
    lines = [{"timestamp": 2 * i, "input_length": 41 * 512, "output_length": 64,
              "hash_ids": system + [1000 + i]} for i in range(16)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, args = _parse(["simulate", "deepseek-v4-flash", "--memory", "32GiB", "--backend", "none",
                      "--prefix-checkpoints", "200", "--workload", str(trace), "--no-plot", "--check-integrity",
                      "--hold-for-writers", str(hold), "--out", str(tmp_path / f"{share}{hold}")])
    cache, sim, _ = build(args, plan_from_args)
    cache.prefix.share_as_written = share
    hits = []
    admit = cache.admit
    cache.admit = lambda rid, *a, **k: hits.append(admit(rid, *a, **k)) or hits[-1]
    sim.run_offline()
    assert sim.stats.finished == 16
    return cache.prefix.stats, [h.cached_tokens for h in hits], sim


def test_a_shared_system_prompt_in_prefill_is_hit_by_the_followers_on_a_trace(tmp_path):
    """The followers arrive while the first request prefills its 20,480-token system prompt (8,192
    tokens a pass). Shared as written: the second, admitted after the first pass, resumes at
    8,192 tokens, the writer's latest resume point (the plan's spacing is 512 pages: no
    intermediate point is kept), read while the writer runs; the pages the writer had not yet
    written are named `not_written_yet`, and where its prompt leaves them (20,480: the junction)
    the writer keeps its point, so the other fourteen, admitted once the writer is past it, hit
    the whole system prompt. Shared at finish, all sixteen are admitted before the first
    finishes and hit nothing."""
    (on, on_hits, _), (off, off_hits, _) = run_trace(tmp_path, True), run_trace(tmp_path, False)
    prompt, system = 41 * 512, 40 * 512
    assert on.queried_tokens == off.queried_tokens == 16 * prompt
    assert on_hits == [0, 8192] + [system] * 14
    assert on.writer_points_read == 1
    assert on.missed()["not_written_yet"] == system - 8192
    assert off_hits == [0] * 16 and off.missed()["no_cached_prefix"] == 16 * prompt


def test_held_admission_hits_more_and_starts_sooner(tmp_path):
    """Cache-aware admission on the same trace: a follower whose next pages the first request is
    still writing is passed over (up to 4 passes) instead of computing them itself; admitted
    once they are written, every follower hits the whole system prompt (the junction kept for
    it by the writer), and with less to prefill the followers' first tokens come sooner on the
    simulator's clock, not later."""
    (held, held_hits, sim), (now, _, sim_now) = run_trace(tmp_path, True, hold=4), run_trace(tmp_path, True)
    assert held_hits == [0] + [40 * 512] * 15
    assert held.hit_tokens > now.hit_tokens and held.missed()["not_written_yet"] == 0
    assert sim.stats.held_passes > 0 and sim_now.stats.held_passes == 0
    ttft, ttft_now = sim.latency.summary()["all"]["ttft_s"], sim_now.latency.summary()["all"]["ttft_s"]
    assert ttft["mean"] < ttft_now["mean"] and ttft["p90"] < ttft_now["p90"]


def test_hold_for_writers_is_checked():
    from kvatlas.driving.sim import Simulator
    from kvatlas.errors import ConfigError
    cache = allocate(plan("tiny-v4", "48MiB", max_model_len=4096, max_running_requests=6, prefix_checkpoints=16,
                          pp=2), backend="none")
    with pytest.raises(ConfigError, match="hold_for_writers"):
        Simulator(cache, [], hold_for_writers=-1)


def run_prefix_first(tmp_path, window: int):
    """One request stores a 4-block prompt and finishes; long after, a cold request and one
    extending the stored prompt arrive together, the cold one first, with room for one running
    request at a time. Returns the admissions' (request id, cached tokens) in order, and the sim."""
    import json

    from kvatlas.cli import _parse
    from kvatlas.cli.common import plan_from_args
    from kvatlas.cli.drive import build
    trace = tmp_path / f"prefix_first{window}.jsonl"
    lines = [{"timestamp": 0, "input_length": 4 * 512, "output_length": 4, "hash_ids": [0, 1, 2, 3]},
             {"timestamp": 600_000, "input_length": 5 * 512, "output_length": 4, "hash_ids": [50, 51, 52, 53, 54]},
             {"timestamp": 600_000, "input_length": 5 * 512, "output_length": 4, "hash_ids": [0, 1, 2, 3, 9]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, args = _parse(["simulate", "deepseek-v4-flash", "--memory", "32GiB", "--backend", "none",
                      "--max-running-requests", "1", "--prefix-checkpoints", "200", "--workload", str(trace), "--no-plot", "--check-integrity",
                      "--admission-window", str(window), "--out", str(tmp_path / f"pf{window}")])
    cache, sim, _ = build(args, plan_from_args)
    order = []
    admit = cache.admit

    def recorded(rid, *a, **k):
        adm = admit(rid, *a, **k)
        order.append((rid, adm.cached_tokens))
        return adm

    cache.admit = recorded
    sim.run_offline()
    assert sim.stats.finished == 3
    return order, sim


def test_prefix_first_admission_starts_the_resident_prefix_first(tmp_path):
    """With admission_window 2 the request whose prefix is resident (the stored 2,048-token prompt:
    8 pages) is admitted before the cold one that arrived ahead of it; with 0, arrival order."""
    fifo, sim0 = run_prefix_first(tmp_path, 0)
    first, sim2 = run_prefix_first(tmp_path, 2)
    ids = [rid for rid, _ in fifo]
    assert [rid for rid, _ in first] == [ids[0], ids[2], ids[1]]
    assert dict(first)[ids[2]] == dict(fifo)[ids[2]] == 4 * 512   # the same hit either way here: only the order moved
    assert sim2.stats.reordered_passes >= 1 and sim0.stats.reordered_passes == 0


def test_admission_window_is_checked():
    from kvatlas.driving.sim import Simulator
    from kvatlas.errors import ConfigError
    cache = allocate(plan("tiny-v4", "48MiB", max_model_len=4096, max_running_requests=6, prefix_checkpoints=16,
                          pp=2), backend="none")
    with pytest.raises(ConfigError, match="admission_window"):
        Simulator(cache, [], admission_window=-1)


def run_with_a_too_long_prompt(tmp_path, *flags):
    """simulate (bookkeeping, one running request, max_model_len 4,096) of three requests arriving
    at once, the second longer than max_model_len; `flags` added to the command line. Returns the
    cache and the simulator after the run."""
    import json

    from kvatlas.cli import _parse
    from kvatlas.cli.common import plan_from_args
    from kvatlas.cli.drive import build
    trace = tmp_path / "too_long.jsonl"
    lines = [{"timestamp": 0, "input_length": 4 * 512, "output_length": 4, "hash_ids": [0, 1, 2, 3]},
             {"timestamp": 0, "input_length": 12 * 512, "output_length": 4, "hash_ids": list(range(10, 22))},
             {"timestamp": 0, "input_length": 5 * 512, "output_length": 4, "hash_ids": [0, 1, 2, 3, 9]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, args = _parse(["simulate", "deepseek-v4-flash", "--memory", "32GiB", "--backend", "none",
                      "--max-running-requests", "1", "--max-model-len", "4096", "--prefix-checkpoints", "200",
                      "--workload", str(trace), "--no-plot", "--out", str(tmp_path / "o"), *flags])
    cache, sim, _ = build(args, plan_from_args)
    return cache, sim


def test_prefix_first_keeps_no_keys_of_requests_it_rejects(tmp_path):
    """A prompt longer than max_model_len waiting in the window is hashed for the ordering, then
    rejected: its keys go with it (the simulator holds keys only of requests still waiting)."""
    _, sim = run_with_a_too_long_prompt(tmp_path, "--admission-window", "4")
    sim.run_offline()
    assert sim.stats.rejected_too_long == 1 and sim.stats.finished == 2
    assert sim._keys == {}
