"""The shared tier without servers (the in-process store): value headers and checksums, every
miss reason, the breaker and deadlines, a read that lands after its deadline, what /metrics and
/state show, and bad input refused with the field named."""

import time

import numpy as np
import pytest

from kvatlas.errors import ConfigError
from kvatlas.tiers.shared import Breaker, Entry, SharedTier, open_store, parse_url
from kvatlas.tiers.shared.memory_store import MemoryStore
from kvatlas.tiers.shared.values import HEADER_BYTES, Layout, check, checksum, checksums, header, parse, sealed

from shared_session import SharedSession, Writer, admit_only, prompts, write_through

LAYOUT = Layout(namespace="t", layout_hash=0x1234, payload_bytes={"page": 4096, "checkpoint": 1024})


def _tier(store=None, **kw):
    store = store if store is not None else MemoryStore()
    return SharedTier(store, LAYOUT, **kw), store


def _page(seed, n=4096):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_header_layout_is_64_bytes_and_round_trips():
    h = header(LAYOUT, "checkpoint", 77, 512, 1024, 0xABCDEF, writer=3)
    assert len(h) == HEADER_BYTES == 64 and h[:4] == b"KVAT"
    p = parse(h)
    assert (p.version, p.kind, p.layout_hash, p.page_key, p.boundary_tokens, p.payload_bytes, p.checksum, p.writer) \
        == (2, 2, 0x1234, 77, 512, 1024, 0xABCDEF, 3)
    assert LAYOUT.key("page", 255) == "kvatlas/t/0000000000001234/p/00000000000000ff"


def _want_checksum(head, parts) -> int:
    """The format's checksum written out: XXH3-64 of the header (checksum field zeroed), then
    each payload range's length and XXH3-64, little-endian u64s."""
    import struct

    import xxhash
    h = bytes(head[:40]) + bytes(8) + bytes(head[48:64])
    return xxhash.xxh3_64_intdigest(h + b"".join(struct.pack("<QQ", p.nbytes, xxhash.xxh3_64_intdigest(p.tobytes()))
                                                 for p in parts))


def test_checksum_is_xxh3_over_the_header_and_every_range():
    a, b = _page(1), _page(2, 1024)
    head = header(LAYOUT, "page", 5, 0, 5120, 0xFFFF)      # (a checksum field: not read)
    assert checksum(head, [a, b]) == _want_checksum(head, [a, b]) == checksum(header(LAYOUT, "page", 5, 0, 5120, 0),
                                                                              [a, b])
    assert parse(sealed(head, [a, b])).checksum == checksum(head, [a, b])
    assert checksum(head, [b, a]) != checksum(head, [a, b])                        # ranges swapped
    assert checksum(header(LAYOUT, "page", 5, 0, 5120, 0, writer=9), [a, b]) != checksum(head, [a, b])   # header


@pytest.mark.parametrize("shares", [1, 2, 3, 4, 7])
def test_checksums_cut_across_threads_are_each_values_checksum(shares):
    """A batch's checksums hashed in runs on threads: each value's, to the bit, however the runs
    cut the batch (sizes chosen so that runs end between a value's ranges and between values)."""
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(shares)
    values = [(header(LAYOUT, "page", k, 0, 1, 0), [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes])
              for k, sizes in enumerate(([1 << 20, 8, 2_000_001], [0, 777_777], [3_000_000], [1, 2, 3]))]
    want = [_want_checksum(h, parts) for h, parts in values]
    with ThreadPoolExecutor(max(1, shares - 1)) as pool:
        assert checksums(values, pool, shares) == want
    assert checksums(values) == want and checksums([]) == []


def _sealed_value(seed, sizes=(4096, 1152)):
    parts = [_page(seed + i, n) for i, n in enumerate(sizes)]
    head = header(LAYOUT, "page", 5, 0, sum(sizes), 0)
    return np.frombuffer(sealed(head, parts), np.uint8).copy(), parts


def _judged(head, parts) -> str | None:
    lay = Layout(namespace="t", layout_hash=0x1234, payload_bytes={"page": sum(p.nbytes for p in parts)})
    return check(lay, "page", 5, 0, HEADER_BYTES + lay.payload_bytes["page"], head, parts,
                 HEADER_BYTES + lay.payload_bytes["page"])


def test_every_single_bit_flip_of_a_value_and_a_sample_of_pairs_is_refused():
    """Each bit of the header and of a payload range flipped alone, then 3,000 random pairs of
    bits in one range (about 1 in 128 of them two flips of one bit position, one 0->1 and one
    1->0: what the version-1 word sum could not see): every one a miss, `corrupt` wherever the
    header still names the value."""
    head, (a, b) = _sealed_value(40)
    assert _judged(head, [a, b]) is None
    for i in range(a.nbytes * 8):
        a[i // 8] ^= 1 << (i % 8)
        assert _judged(head, [a, b]) == "corrupt", i
        a[i // 8] ^= 1 << (i % 8)
    reasons = set()
    for i in range(HEADER_BYTES * 8):
        head[i // 8] ^= 1 << (i % 8)
        why = _judged(head, [a, b])
        assert why is not None, i
        reasons.add(why)
        head[i // 8] ^= 1 << (i % 8)
    assert reasons == {"corrupt", "stale", "foreign", "size_mismatch"}
    rng = np.random.default_rng(41)
    compensating = 0
    for i, j in rng.integers(0, b.nbytes * 8, (3000, 2)):
        if i == j:
            continue
        compensating += i % 64 == j % 64 and (b[i // 8] >> (i % 8) & 1) != (b[j // 8] >> (j % 8) & 1)
        for x in (i, j):
            b[x // 8] ^= 1 << (x % 8)
        assert _judged(head, [a, b]) == "corrupt", (i, j)
        for x in (i, j):
            b[x // 8] ^= 1 << (x % 8)
    assert compensating >= 5 and _judged(head, [a, b]) is None


def test_put_then_get_is_exact_and_first_writer_wins():
    tier, store = _tier()
    src, other, dst = _page(1), _page(2), np.zeros(4096, np.uint8)
    tier.put([Entry("page", 5, 0, (src,))])
    tier.flush()
    tier.put([Entry("page", 5, 0, (other,))])     # a second writer: nothing written
    tier.flush()
    assert tier.get([Entry("page", 5, 0, (dst,))]).reasons == [None]
    assert np.array_equal(dst, src)
    snap = tier.snapshot()
    assert snap.puts["page"]["stored"] == 1 and snap.puts["page"]["exists"] == 1
    assert snap.moved_bytes == {"to_store": 64 + 4096, "from_store": 64 + 4096}
    assert snap.hits["page"] == 1 and snap.moved_entries["page"] == {"to_store": 1, "from_store": 1}


def _compensating_flips(blob: bytes, bit: int = 5) -> bytes:
    """Two flips of one bit position in two 8-byte words of the payload, one 0->1 and one 1->0:
    a weighted word sum does not move."""
    b = bytearray(blob)
    words = np.frombuffer(bytes(b[HEADER_BYTES:]), np.uint64)
    ones = np.flatnonzero(words >> np.uint64(bit) & np.uint64(1))
    zeros = np.flatnonzero(~words >> np.uint64(bit) & np.uint64(1))
    for w in (ones[0], zeros[0]):
        b[HEADER_BYTES + 8 * int(w) + bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def _swapped(blob: bytes, x: int, y: int, n: int) -> bytes:
    b = bytearray(blob)
    assert b[x:x + n] != b[y:y + n]
    b[x:x + n], b[y:y + n] = b[y:y + n], b[x:x + n]
    return bytes(b)


@pytest.mark.parametrize("damage,reason", [
    (lambda b: b[:4] + (9).to_bytes(2, "little") + b[6:], "stale"),
    (lambda b: b[:4] + (1).to_bytes(2, "little") + b[6:], "stale"),      # a value of format 1 (the word sum)
    (lambda b: b[:8] + (0x999).to_bytes(8, "little") + b[16:], "foreign"),
    (lambda b: b[:24] + (13).to_bytes(8, "little") + b[32:], "foreign"),          # another page's key
    (lambda b: b[:-1] + bytes([b[-1] ^ 0x80]), "corrupt"),
    (lambda b: b"XXXX" + b[4:], "corrupt"),
    (lambda b: b[:-8], "size_mismatch"),
    (lambda b: b + b"\0" * 8, "size_mismatch"),
    (lambda b: _compensating_flips(b), "corrupt"),
    (lambda b: _swapped(b, 64 + 8 * 3, 64 + 8 * 200, 8), "corrupt"),       # two 8-byte words of a range
    (lambda b: _swapped(b, 64 + 576, 64 + 576 * 5, 576), "corrupt"),       # two 576-byte rows of a range
])
def test_a_damaged_value_is_a_miss_with_its_reason(damage, reason):
    """Every damage here but the last three was seen by the version-1 word sum too; those three
    (two compensating flips of one bit position, two swapped words, two swapped rows) it missed.
    A value of format 1 (which that code wrote) now reads as stale."""
    tier, store = _tier()
    tier.put([Entry("page", 12, 0, (_page(3),))])
    tier.flush()
    key = LAYOUT.key("page", 12)
    store.raw_put(key, damage(store.raw_get(key)))
    dst = np.zeros(4096, np.uint8)
    assert tier.get([Entry("page", 12, 0, (dst,))]).reasons == [reason]
    snap = tier.snapshot()
    assert snap.misses["page"][reason] == 1 and snap.hits["page"] == 0


def test_absent_and_a_checkpoint_of_another_boundary():
    tier, _ = _tier()
    tier.put([Entry("checkpoint", 9, 512, (_page(4, 1024),))])
    tier.flush()
    got = tier.get([Entry("page", 1, 0, (np.zeros(4096, np.uint8),)),
                    Entry("checkpoint", 9, 768, (np.zeros(1024, np.uint8),))])
    assert got.reasons == ["absent", "foreign"]


def test_breaker_opens_serves_misses_and_closes_by_itself():
    now = [0.0]
    tier, store = _tier(breaker=Breaker(cooloff_s=1.0, clock=lambda: now[0]))
    tier.put([Entry("page", 1, 0, (_page(5),))])
    tier.flush()
    store.down = True
    dst = np.zeros(4096, np.uint8)
    assert tier.get([Entry("page", 1, 0, (dst,))]).reasons == ["tier_unavailable"]
    assert tier.snapshot().breaker_open and tier.snapshot().errors["get"] == 1
    store.down = False
    assert tier.get([Entry("page", 1, 0, (dst,))]).reasons == ["tier_unavailable"]   # open: not asked
    assert tier.snapshot().errors["get"] == 1
    now[0] = 1.5                                  # cool-off over: one trial call, which succeeds
    assert tier.get([Entry("page", 1, 0, (dst,))]).reasons == [None]
    snap = tier.snapshot()
    assert not snap.breaker_open and snap.breaker_opened == 1 and snap.misses["page"]["tier_unavailable"] == 2


def test_a_slow_store_costs_one_deadline_then_misses_at_once():
    tier, store = _tier(deadline_s=0.05, breaker=Breaker(cooloff_s=60))
    store.delay_s = 0.4
    dst = np.zeros(4096, np.uint8)
    t = time.monotonic()
    got = tier.get([Entry("page", 1, 0, (dst,))])
    assert got.reasons == ["deadline"] and got.landing is not None
    assert time.monotonic() - t < 0.3
    asked, enter = [], store._enter
    store._enter = lambda op: asked.append(op) or enter(op)
    assert tier.get([Entry("page", 1, 0, (dst,))]).reasons == ["tier_unavailable"]
    assert asked == []   # the breaker is open: the store is not asked at all (no wait on its delay)
    store._enter = enter
    assert tier.put([Entry("page", 2, 0, (dst,))]) is False      # skipped while open, never queued
    got.landing.result(timeout=5)
    snap = tier.snapshot()
    assert snap.misses["page"]["deadline"] == 1 and snap.puts["page"]["skipped"] == 1 and snap.errors["get"] == 1
    tier.close()


def test_a_read_past_its_deadline_keeps_its_host_slots_until_it_lands():
    store = MemoryStore()
    write_through(store, [prompts(1)[0]])
    b = SharedSession(store, deadline_s=0.05, breaker=Breaker(cooloff_s=0.2))
    store.delay_s, store.slow = 0.5, {"get"}
    seq = prompts(1)[0]
    assert b.link.prefetch(len(seq), token_ids=seq) is None
    host = b.link.tier
    assert host.slots["host_pages"].claimed == 2      # the late read still targets them
    time.sleep(0.8)
    b.link.shared.poll()
    store.delay_s = 0.0
    time.sleep(0.25)
    assert admit_only(b, seq) == 512                  # landed, released, the breaker closed again
    assert host.slots["host_pages"].claimed == 0
    b.hot.check_integrity()
    host.check_integrity()


def test_metrics_and_state_show_the_shared_tier_apart():
    from kvatlas.observing.metrics import KvatlasCollector, exposition
    from kvatlas.observing.server import state_document
    store = MemoryStore()
    write_through(store, [prompts(2)[0]])
    b = SharedSession(store)
    assert admit_only(b, prompts(2)[0]) == 512
    text = exposition(KvatlasCollector(b.hot)).decode()
    for reason in ("absent", "stale", "foreign", "corrupt", "size_mismatch", "deadline", "tier_unavailable"):
        assert f'kvatlas_shared_tier_misses_total{{kind="page",pp_rank="0",reason="{reason}"}}' in text
    assert 'kvatlas_prefix_tier_hit_tokens_total{pp_rank="0",tier="shared"} 512.0' in text   # (a pp=2 plan)
    assert 'kvatlas_prefix_tier_hit_tokens_total{pp_rank="0",tier="device"} 0.0' in text
    assert 'kvatlas_shared_tier_hits_total{kind="page",pp_rank="0"} 2.0' in text
    assert 'kvatlas_shared_tier_breaker_open{pp_rank="0"} 0.0' in text
    assert 'kvatlas_shared_tier_op_seconds_count{op="get",pp_rank="0"} 1.0' in text
    assert 'kvatlas_shared_tier_moved_bytes_total{direction="from_store",pp_rank="0"}' in text
    doc = state_document(KvatlasCollector(b.hot))["caches"][0]
    assert doc["shared_tier"]["hit_tokens"] == 512 and doc["shared_tier"]["schema"] == "kvatlas.shared_tier"
    assert doc["host_tier"]["host_totals"]["planned"] == b.link.tier.plan.total_bytes   # its own section


def test_bad_urls_name_the_field_and_the_fix():
    for url, words in (("mooncake", "not a store URL"), ("ftp://x:1", "not a shared store"),
                       ("redis://127.0.0.1", "names no host and port"), ("redis://h:99999", "bad port"),
                       ("mooncake://127.0.0.1:1", "metadata server"), ("redis://127.0.0.1:1?x=1", "no option")):
        with pytest.raises(ConfigError, match=words) as e:
            open_store(url, "--shared-tier")
        assert e.value.field == "--shared-tier"
    assert parse_url("memory://a?capacity=1MiB").scheme == "memory"
    with pytest.raises(ConfigError, match="deadline_s"):
        SharedTier(MemoryStore(), LAYOUT, deadline_s=0)


def test_cli_refuses_a_shared_tier_without_a_host_tier(capsys):
    from kvatlas.cli import main
    base = ["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "4", "--prefix-checkpoints", "4"]
    assert main(base + ["--shared-tier", "memory://x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvatlas simulate: error: --shared-tier:") and "--host-memory" in err[0]
    assert main(base + ["--host-memory", "8MiB", "--shared-tier", "gopher://x:1"]) == 2
    assert "--shared-tier: 'gopher' is not a shared store" in capsys.readouterr().err


def test_simulate_with_a_shared_tier_has_its_own_summary_line(tmp_path, capsys):
    from kvatlas.cli import main
    for _ in range(2):   # the second run finds the first run's prefixes in the (in-process) store
        main(["simulate", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--rate", "8", "--duration",
              "0.5", "--prompt-len", "600", "--output-len", "4", "--system-prompts", "1", "--system-prompt-len", "520",
              "--prefix-checkpoints", "4", "--host-memory", "8MiB", "--shared-tier", "memory://cli-test",
              "--out", str(tmp_path / "s"), "--no-plot", "--write-layers", "0"])
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("shared tier")][-1]
    import re
    assert re.search(r"hit tokens [1-9][\d,]* \(\d+ requests\)", line), line
    assert "misses: none" in line and "errors 0" in line and "breaker closed" in line


class _ZeroCopyMemory(MemoryStore):
    """The in-process store as a zero-copy store (Mooncake): with inbox=True, whole values into the inbox."""
    zero_copy = True


@pytest.mark.parametrize("chunk_bytes", [None, 3 * (64 + 4096)])
def test_zero_copy_reads_through_the_inbox_whole_or_in_chunks(chunk_bytes):
    """A batch that fits the inbox is one read call into it; a larger one (here: an inbox of
    3 pages a half) goes in chunks alternating halves. Either way every hit is the bytes written,
    a damaged value is a miss (corrupt) whose parts are left untouched, and the rest still hit."""
    store = _ZeroCopyMemory()
    tier, _ = _tier(store, inbox=True)
    assert tier._inbox is not None and _tier(_ZeroCopyMemory())[0]._inbox is None   # straight into the parts by default
    if chunk_bytes is not None:
        tier._inbox.chunk_bytes = chunk_bytes
        tier._inbox.buf = np.zeros((2, chunk_bytes), np.uint8)
    srcs = [_page(10 + i) for i in range(8)]
    tier.put([Entry("page", 100 + i, 0, (s,)) for i, s in enumerate(srcs)])
    tier.flush()
    key = LAYOUT.key("page", 103)
    damaged = bytearray(store.values[key])
    damaged[64 + 7] ^= 0x10
    store.values[key] = bytes(damaged)
    dsts = [np.full(4096, 0xAB, np.uint8) for _ in srcs]
    calls = []
    get_many = store.get_many
    store.get_many = lambda keys, dests: calls.append(len(keys)) or get_many(keys, dests)
    got = tier.get([Entry("page", 100 + i, 0, (d,)) for i, d in enumerate(dsts)])
    assert got.reasons == [None, None, None, "corrupt", None, None, None, None]
    assert calls == ([8] if chunk_bytes is None else [3, 3, 2])
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        assert np.array_equal(d, s) if i != 3 else (d == 0xAB).all()
    assert tier.snapshot().misses["page"]["corrupt"] == 1


@pytest.mark.parametrize("refusal", ["failed", "full"])
def test_a_put_the_store_refused_is_offered_again_and_lands_once_the_store_is_back(refusal):
    """A finish whose puts fail (the store down) or find it full leaves nothing known: when the
    same prompt finishes again once the store is back, its pages and resume point are put again,
    and another process restores them. (Before, the keys were remembered when queued: the second
    finish offered nothing and the other process restored 0 tokens.)"""
    store = MemoryStore(capacity_bytes=1 if refusal == "full" else None)
    # (a breaker that stays closed through the outage: the finish's puts are tried and refused, not
    # skipped because an earlier call of the run failed first)
    a = Writer(store, breaker=Breaker(failures=10**6, cooloff_s=0.05))
    seq = prompts(31, 1)[0]
    store.down = refusal == "failed"
    a.run(seq)
    a.link.shared.flush(5.0)
    snap = a.link.shared_snapshot()
    tried = {k: snap.puts[k][refusal] + snap.puts[k]["skipped"] for k in ("page", "checkpoint")}   # (skipped: the
    assert tried == {"page": 2, "checkpoint": 1} and snap.puts["page"][refusal] >= 1 and not store.values  # breaker)
    store.down, store.capacity_bytes = False, None
    time.sleep(0.1)                       # the breaker's cool-off (the store was down)
    assert a.run(seq) == 512              # from its own device this time; the finish offers them again
    a.link.shared.flush(5.0)
    before = a.link.shared_snapshot().puts
    assert before["page"]["stored"] == 2 and before["checkpoint"]["stored"] == 1
    assert a.run(seq) == 512              # known now: a third finish offers nothing
    a.link.shared.flush(5.0)
    assert a.link.shared_snapshot().puts == before
    a.close()
    b = SharedSession(store)
    assert admit_only(b, seq) == 512      # another process: both pages and the resume point from the store
    b.close()


def test_a_refused_entry_is_offered_at_most_OFFERS_times_and_an_outage_costs_no_tries():
    from kvatlas.tiers.shared.link import OFFERS
    store = MemoryStore(capacity_bytes=1)          # full for good: every put refused
    a = Writer(store, breaker=Breaker(cooloff_s=60))
    seq = prompts(32, 1)[0]
    store.down = True                              # an outage first: the breaker opens, puts are skipped
    for _ in range(2):
        a.run(seq)
        a.link.shared.flush(5.0)
    assert a.link.shared_snapshot().puts["page"]["skipped"] >= 2
    store.down = False
    a.link.shared.breaker.success()                # (the store is back)
    for _ in range(OFFERS + 1):
        a.run(seq)
        a.link.shared.flush(5.0)
    snap = a.link.shared_snapshot()
    tries = {k: snap.puts[k]["full"] + snap.puts[k]["failed"] for k in ("page", "checkpoint")}
    assert tries == {"page": 2 * OFFERS, "checkpoint": OFFERS} and snap.puts["page"]["full"] >= 2
    assert not store.values
    a.close()


def test_a_prefetch_waits_one_deadline_for_its_lookup_and_its_read_together():
    """The existence check and the read each take 0.3 s, the deadline is 0.4 s: the read gets
    only what the check left (a miss, `deadline`), and the prefetch returns within about one
    deadline. (Before, each call had a deadline of its own: 0.6 s, and a hit.)"""
    store, seq = MemoryStore(), prompts(33, 1)[0]
    write_through(store, [seq])
    b = SharedSession(store, deadline_s=0.4, breaker=Breaker(cooloff_s=60))
    store.delay_s, store.slow = 0.3, {"exists", "get"}
    t = time.monotonic()
    ready = b.link.prefetch(len(seq), token_ids=seq)
    took = time.monotonic() - t
    assert ready is None and took < 0.4 + 0.2, took
    snap = b.link.shared_snapshot()
    assert snap.misses["page"]["deadline"] == 2 and snap.op_count["exists"] == 1 and snap.hit_tokens == 0
    time.sleep(0.4)                      # the late read lands before the session closes
    b.close()


def test_a_restore_of_a_resume_point_alone_is_not_a_hit_request():
    """The shared tier counts a hit request only when it brought back tokens (pages): a resume
    point alone over pages the host tier had restores no token from the store."""
    s = SharedSession(MemoryStore())
    link, keys = s.link, [11, 12]
    link._fetched = {("checkpoint", 12)}
    link._count_hit(keys, 2)
    assert link.shared_hit_requests == 0
    link._fetched = {11, 12, ("checkpoint", 12)}
    link._count_hit(keys, 2)
    assert link.shared_hit_requests == 1   # (its tokens count at the admission: PrefixStats.shared_hit_tokens)
    s.close()
