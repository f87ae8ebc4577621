"""The subscriber against a publisher speaking vLLM's wire on loopback: in-order delivery, a gap
filled by the replay socket, a gap the buffer no longer reaches (the engine marked stale), a late
join, a malformed batch, a restarted publisher."""

import time

import pytest

from kvatlas.errors import ConfigError
from kvatlas.routing import BlockRemoved, EventBatch, Subscriber, rank_endpoint
from routing_wire import FakePublisher, free_port, wait_for


def batch(i: int) -> EventBatch:
    return EventBatch(seq=-1, ts=float(i), events=(BlockRemoved(block_hashes=(i,), group=0),), dp_rank=0)


@pytest.fixture
def wire():
    port, replay = free_port(), free_port()
    pub = FakePublisher(port, replay, buffer_steps=5)
    got, lost, resets = [], [], []
    sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                     on_batch=got.append, on_lost=lost.append, on_reset=lambda: resets.append(1),
                     replica="a", replay_timeout_s=3.0)
    sub.start()
    assert wait_for(lambda: sub.stats().connected)
    time.sleep(0.3)     # a SUB misses what is published before its subscription reaches the PUB
    yield pub, sub, got, lost, resets
    sub.stop()
    pub.close()


def test_in_order_then_gap_replayed(wire):
    pub, sub, got, lost, _ = wire
    pub.publish(batch(0))
    assert wait_for(lambda: len(got) == 1)
    pub.publish(batch(1), drop=True)
    pub.publish(batch(2), drop=True)
    pub.publish(batch(3))
    assert wait_for(lambda: len(got) == 4)
    assert [b.seq for b in got] == [0, 1, 2, 3] and [b.ts for b in got] == [0.0, 1.0, 2.0, 3.0]
    s = sub.stats()
    assert (s.last_seq, s.gaps, s.replays, s.replayed_batches, s.lost_batches, s.stale_reason) == (3, 1, 1, 2, 0, None)
    assert not lost and s.batches == 4 and s.events == 4


def test_gap_past_the_buffer_is_lost(wire):
    pub, sub, got, lost, _ = wire
    pub.publish(batch(0))
    assert wait_for(lambda: len(got) == 1)
    for i in range(1, 8):                 # the buffer keeps 5: seq 1 and 2 are gone
        pub.publish(batch(i), drop=True)
    pub.publish(batch(8))
    assert wait_for(lambda: sub.stats().last_seq == 8)
    s = sub.stats()
    assert [b.seq for b in got] == [0, 8] and s.lost_batches == 8 - 1 and s.gaps == 1
    assert lost and "1..7" in lost[0] and s.stale_reason == lost[0]


def test_malformed_batch_counted_and_marks_loss(wire):
    pub, sub, got, lost, _ = wire
    pub.publish(batch(0), payload=b"\xc1 not msgpack")
    pub.publish(batch(1))
    assert wait_for(lambda: len(got) == 1)
    s = sub.stats()
    assert s.malformed == 1 and got[0].seq == 1 and lost and "malformed" in lost[0]


def test_publisher_restart_resets(wire):
    pub, sub, got, lost, resets = wire
    for i in range(3):
        pub.publish(batch(i))
    assert wait_for(lambda: len(got) == 3)
    pub.seq = 0                               # a new engine process starts numbering again
    pub.buffer.clear()
    pub.publish(batch(10))
    assert wait_for(lambda: len(got) == 4)
    assert resets == [1] and sub.stats().resets == 1 and got[-1].seq == 0 and not lost


def test_publisher_restart_seen_when_its_first_batch_is_lost(wire):
    """A restarted engine's first batch published before the SUB reconnected: the next one goes
    back (seq 1 < 5) and is newer than anything applied, so it is a restart, not a duplicate; the
    new publisher's seq 0 comes from its replay socket."""
    pub, sub, got, lost, resets = wire
    for i in range(5):
        pub.publish(batch(i))
    assert wait_for(lambda: len(got) == 5)
    pub.seq = 0
    pub.buffer.clear()
    pub.publish(batch(20), drop=True)          # seq 0: never reaches the SUB, kept for replay
    pub.publish(batch(21))                     # seq 1
    assert wait_for(lambda: len(got) == 7)
    s = sub.stats()
    assert resets == [1] and s.resets == 1 and not lost
    assert [(b.seq, b.ts) for b in got[5:]] == [(0, 20.0), (1, 21.0)] and s.replayed_batches == 1


def test_a_restart_after_one_batch_is_seen(wire):
    """The old engine published only seq 0; the new one's seq 0 (newer) is a restart, not a copy."""
    pub, sub, got, lost, resets = wire
    pub.publish(batch(0))
    assert wait_for(lambda: len(got) == 1)
    pub.seq = 0
    pub.buffer.clear()
    pub.publish(batch(5))
    assert wait_for(lambda: len(got) == 2)
    assert resets == [1] and sub.stats().resets == 1 and [(b.seq, b.ts) for b in got] == [(0, 0.0), (0, 5.0)]


def restarted(pub, port, replay):
    """The publisher's process gone (its sockets closed: the SUB sees the disconnect) and a new one
    on the same ports, numbering from 0."""
    pub.close()
    time.sleep(0.2)
    return FakePublisher(port, replay, buffer_steps=5)


def restart_after_three(unseen: int, **options):
    """A subscriber that applied seq 0-2 of a publisher which then restarted and published
    `unseen` batches (ts 20, 21, ...) the SUB never got (kept for replay): (publisher, subscriber,
    batches applied, losses, resets)."""
    port, replay = free_port(), free_port()
    pub = FakePublisher(port, replay, buffer_steps=5)
    got, lost, resets = [], [], []
    sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}", on_batch=got.append,
                     on_lost=lost.append, on_reset=lambda: resets.append(1), replica="a", replay_timeout_s=3.0,
                     **options)
    sub.start()
    assert wait_for(lambda: sub.stats().connected)
    time.sleep(0.3)
    for i in range(3):
        pub.publish(batch(i))
    assert wait_for(lambda: len(got) == 3)
    pub = restarted(pub, port, replay)
    for i in range(unseen):
        pub.publish(batch(20 + i), drop=True)
    return pub, sub, got, lost, resets


def test_a_restart_whose_first_batches_all_went_unseen_is_seen():
    """The new engine's first batches are published before the SUB reconnected, so the first one
    seen carries exactly the seq the old stream expected next (3): by seq alone a continuation.
    After the disconnect the subscriber asks the replay socket for the last batch it applied; the
    new publisher's seq 2 is another batch (another timestamp): a restart, and the new batches
    from 0 come from its replay socket."""
    pub, sub, got, lost, resets = restart_after_three(3)
    try:
        assert wait_for(lambda: sub.stats().connected)
        time.sleep(0.3)
        pub.publish(batch(23))                      # seq 3
        assert wait_for(lambda: len(got) == 7)
        s = sub.stats()
        assert resets == [1] and s.resets == 1 and not lost
        assert [(b.seq, b.ts) for b in got[3:]] == [(0, 20.0), (1, 21.0), (2, 22.0), (3, 23.0)]
    finally:
        sub.stop()
        pub.close()


def test_a_restart_that_went_quiet_is_seen_by_the_idle_probe():
    """Every batch of the new engine unseen and nothing after: the idle probe checks the last
    batch applied first, finds another publisher, and takes the new batches from 0."""
    pub, sub, got, lost, resets = restart_after_three(2, idle_probe_s=0.3)
    try:
        assert wait_for(lambda: len(got) == 5)
        assert resets == [1] and not lost and [(b.seq, b.ts) for b in got[3:]] == [(0, 20.0), (1, 21.0)]
    finally:
        sub.stop()
        pub.close()


def test_a_reconnect_to_the_same_publisher_is_not_a_restart(wire):
    """A disconnect after which the replay socket still holds the last batch applied, with its
    timestamp: the same publisher; nothing reset, the next batch applied in order."""
    pub, sub, got, lost, resets = wire
    for i in range(3):
        pub.publish(batch(i))
    assert wait_for(lambda: len(got) == 3)
    with sub._lock:
        sub._rejoined = True                   # (as the monitor marks a disconnect)
    pub.publish(batch(3))
    assert wait_for(lambda: len(got) == 4)
    assert not resets and sub.stats().resets == 0 and [b.seq for b in got] == [0, 1, 2, 3]


def test_a_duplicate_is_not_a_restart(wire):
    """Copies of batches already applied (a replay overlapping live traffic) go back too, but are
    never newer than the last batch applied: dropped, nothing reset, the next new batch applied."""
    pub, sub, got, lost, resets = wire
    for i in range(4):
        pub.publish(batch(i))
    assert wait_for(lambda: len(got) == 4)
    pub.seq = 2
    pub.publish(batch(2))                      # seq 2 again, ts 2.0
    pub.publish(batch(3))                      # seq 3 again, ts 3.0 (the last applied)
    pub.publish(batch(4))                      # seq 4: new
    assert wait_for(lambda: len(got) == 5)
    time.sleep(0.2)
    s = sub.stats()
    assert [b.seq for b in got] == [0, 1, 2, 3, 4] and not resets and s.resets == 0 and s.gaps == 0 and not lost


def test_late_join_replays_from_zero():
    port, replay = free_port(), free_port()
    pub = FakePublisher(port, replay, buffer_steps=10)
    for i in range(3):
        pub.publish(batch(i))                 # nobody listening yet
    got = []
    sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}", on_batch=got.append)
    try:
        sub.start()
        assert wait_for(lambda: sub.stats().connected)
        time.sleep(0.3)
        pub.publish(batch(3))
        assert wait_for(lambda: len(got) == 4)
        assert [b.seq for b in got] == [0, 1, 2, 3] and sub.stats().replayed_batches == 3
    finally:
        sub.stop()
        pub.close()


def test_rank_endpoint_and_bad_input():
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert rank_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ConfigError, match="endpoint"):
        rank_endpoint("localhost:5557", 0)
    with pytest.raises(ConfigError, match="on_batch"):
        Subscriber("tcp://127.0.0.1:1", on_batch=None)
    with pytest.raises(ConfigError, match="dp_rank"):
        Subscriber("tcp://127.0.0.1:1", on_batch=print, dp_rank=-1)


def test_lost_last_batch_found_by_the_idle_probe(wire):
    """No later batch reveals the gap: after idle_probe_s of quiet the replay socket is asked."""
    pub, sub, got, lost, _ = wire
    pub.publish(batch(0))
    pub.publish(batch(1), drop=True)
    assert wait_for(lambda: len(got) == 2, 10.0)
    s = sub.stats()
    assert [b.seq for b in got] == [0, 1] and s.replayed_batches == 1 and s.gaps == 1 and not lost


def test_a_batch_is_in_the_stats_by_the_time_on_batch_sees_it():
    """What on_batch changes (the index another thread reads) never runs ahead of stats(): each
    batch, live or replayed, and the gap an idle probe found, are counted before on_batch runs.
    (A test read the stats right after its batch arrived and found the probe's gap not yet
    counted.) A batch on_batch refuses as malformed is taken back out."""
    from kvatlas.routing.events import MalformedEventError
    port, replay = free_port(), free_port()
    pub = FakePublisher(port, replay, buffer_steps=5)
    seen = []
    sub = None

    def on_batch(b):
        s = sub.stats()
        seen.append((b.ts, s.batches, s.replayed_batches, s.gaps))
        if b.ts == 2.0:
            raise MalformedEventError("token_ids", "not a list")
    sub = Subscriber(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}", on_batch=on_batch,
                     replica="a", replay_timeout_s=3.0, idle_probe_s=0.3)
    try:
        sub.start()
        assert wait_for(lambda: sub.stats().connected)
        time.sleep(0.3)
        pub.publish(batch(0))
        pub.publish(batch(1), drop=True)          # found by the idle probe: replayed
        assert wait_for(lambda: len(seen) == 2, 10.0)
        pub.publish(batch(2))                     # refused as malformed
        assert wait_for(lambda: sub.stats().malformed == 1, 10.0)
        s = sub.stats()
        assert seen == [(0.0, 1, 0, 0), (1.0, 2, 1, 1), (2.0, 3, 1, 1)]
        assert (s.batches, s.replayed_batches, s.gaps, s.last_batch_ts) == (2, 1, 1, 1.0)
    finally:
        sub.stop()
        pub.close()
