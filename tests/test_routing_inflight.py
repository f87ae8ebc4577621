"""Prefixes in flight (routing.inflight) and the kvatlas policy's term for them: a follower goes to
the replica computing a prompt it shares whole blocks with, and the entry goes when the request finishes, when the
events show the prefix stored, or when it times out. A stateful property test checks the tracker
against a plain model after every step of random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvatlas.errors import ConfigError
from kvatlas.routing import (BlockStored, EventBatch, InFlightPrefixes, PrefixIndex, ReplicaLoad, Weights,
                             groups_from_metadata, make_policy)

MODEL = "deepseek-v4-flash"
METADATA = [
    {"group_idx": 0, "kind": "sliding_window", "block_size": 64, "sliding_window": 128},
    {"group_idx": 1, "kind": "sliding_window", "block_size": 64, "sliding_window": 128},
    {"group_idx": 2, "kind": "mla_attention", "block_size": 256, "sliding_window": None},
    {"group_idx": 3, "kind": "sliding_window", "block_size": 4, "sliding_window": 8},
    {"group_idx": 4, "kind": "sliding_window", "block_size": 8, "sliding_window": 128},
]
WRITER = list(range(1000, 13000))           # 12,000 tokens: its aligned end is 11,776
FOLLOWER = WRITER + [7] * 1000              # the next turn: extends the writer


def make_index(*replicas: str) -> PrefixIndex:
    index = PrefixIndex(MODEL)
    for r in replicas:
        index.add_engine(r, 0, groups_from_metadata(index.rule, METADATA))
    return index


def computed(prompt: list[int], seq: int = 0) -> EventBatch:
    """The events vLLM publishes once it computed `prompt`: the full group's blocks to its aligned
    end and every sliding group's tail ending there (hash of the prefix ending at `end`: 7,000,000 + end)."""
    end = len(prompt) // 256 * 256
    h = lambda e: 7_000_000 + e

    def stored(group, block, start):
        return BlockStored(block_hashes=tuple(h(e) for e in range(start + block, end + 1, block)),
                           parent_hash=h(start) if start else None, token_ids=tuple(prompt[start:end]),
                           block_tokens=block, group=group)
    return EventBatch(seq=seq, ts=0.0, events=(stored(2, 256, 0), stored(0, 64, end - 128), stored(1, 64, end - 128),
                                                stored(3, 4, end - 8), stored(4, 8, end - 128)))


def test_follower_goes_to_the_writers_replica_while_it_prefills():
    index = make_index("a", "b")
    policy = make_policy("kvatlas", index=index)
    policy.routed("a", "writer", WRITER)
    loads = {"b": ReplicaLoad(), "a": ReplicaLoad(in_flight=1)}      # b listed first: it wins ties
    best, other = policy.choose(FOLLOWER, loads)
    assert best.replica == "a" and (best.predicted_tokens, best.in_flight_tokens) == (0, 11_776)
    assert best.cost == 13_000 - 11_776 + 256 and other.cost == 13_000 and other.in_flight_tokens == 0
    # the same without the term (weight 0): the idle replica, the old greedy choice
    greedy = make_policy("kvatlas", index=index, weights=Weights(in_flight_prefix=0.0))
    greedy.routed("a", "writer", WRITER)
    assert greedy.choose(FOLLOWER, loads)[0].replica == "b"
    # half weight: half the tokens counted
    half = make_policy("kvatlas", index=index, weights=Weights(in_flight_prefix=0.5))
    half.routed("a", "writer", WRITER)
    assert {c.replica: c.cost for c in half.choose(FOLLOWER, loads)}["a"] == 13_000 - 5_888 + 256


def test_the_entry_goes_when_the_events_show_the_prefix_stored():
    index = make_index("a", "b")
    policy = make_policy("kvatlas", index=index)
    policy.routed("a", "writer", WRITER)
    index.apply("a", 0, computed(WRITER))
    best = policy.choose(FOLLOWER, {"a": ReplicaLoad(in_flight=1), "b": ReplicaLoad()})[0]
    assert (best.replica, best.predicted_tokens, best.in_flight_tokens) == ("a", 11_776, 0)
    assert len(policy.in_flight) == 0 and policy.in_flight.counters["stored"] == 1


def test_the_entry_goes_when_the_request_finishes():
    index = make_index("a", "b")
    policy = make_policy("kvatlas", index=index)
    policy.routed("a", "writer", WRITER)
    policy.routed("b", "other", [5] * 3000)
    policy.finished("writer")
    policy.finished("never-sent")                       # unknown ids are ignored
    assert policy.in_flight.expected(index.keys(FOLLOWER)) == {}
    assert policy.in_flight.state() == {"entries": 1, "by_replica": {"b": 1}, "ttl_s": 600.0, "added": 2,
                                        "finished": 1, "stored": 0, "expired": 0, "evicted": 0}


def test_the_entry_expires():
    index = make_index("a")
    now = [100.0]
    tracker = InFlightPrefixes(256, ttl_s=30.0, clock=lambda: now[0])
    policy = make_policy("kvatlas", index=index, in_flight=tracker)
    policy.routed("a", "writer", WRITER)
    now[0] = 129.0
    assert policy.choose(FOLLOWER, {"a": ReplicaLoad()})[0].in_flight_tokens == 11_776
    now[0] = 130.5
    assert policy.choose(FOLLOWER, {"a": ReplicaLoad()})[0].in_flight_tokens == 0
    assert len(tracker) == 0 and tracker.counters["expired"] == 1


def test_what_counts_is_the_deepest_boundary_shared_with_a_writer_at_most_n_minus_1():
    index = make_index("a")
    policy = make_policy("kvatlas", index=index)
    policy.routed("a", "writer", WRITER)
    keys = index.keys
    # a fork before the writer's end: the boundary before the fork (vLLM keeps the tails the window
    # has passed cached until their blocks are taken), 8,000 rounded down to 256
    assert policy.in_flight.expected(keys(WRITER[:8000] + [3] * 5000))["a"][0] == 7_936
    # a fork inside the first block: nothing
    assert policy.in_flight.expected(keys(WRITER[:200] + [3] * 5000)) == {}
    # the writer itself again (12,000 tokens): its end 11,776 ≤ n − 1
    assert policy.in_flight.expected(keys(WRITER))["a"][0] == 11_776
    # a prompt of 256·k tokens is capped at n − 1: one block short of its end
    assert policy.in_flight.expected(keys(WRITER[:11_776]))["a"][0] == 11_520
    assert policy.in_flight.expected(keys(WRITER[:11_777]))["a"][0] == 11_776
    # the deepest shared boundary wins, whichever writer it is in
    policy.routed("a", "short", WRITER[:3000])
    assert policy.in_flight.expected(keys(FOLLOWER))["a"][0] == 11_776
    assert policy.in_flight.expected(keys(WRITER[:5000]))["a"][0] == 4_864
    # requests excluded (held by a router: they compute nothing yet) are no writers
    assert policy.in_flight.expected(keys(WRITER[:5000]), exclude={"writer"})["a"][0] == 2_816
    assert policy.in_flight.expected(keys(WRITER[:5000]), exclude={"writer", "short"}) == {}


def test_other_policies_keep_no_prefixes_in_flight_and_bad_settings_are_named():
    index = make_index("a")
    for name in ("main_group_prefix", "round_robin", "least_loaded"):
        policy = make_policy(name, index=index)
        policy.routed("a", "writer", WRITER)
        assert policy.in_flight is None and policy.keys(WRITER) is None
    with pytest.raises(ConfigError, match="weights.in_flight_prefix"):
        Weights(in_flight_prefix=-1.0)
    with pytest.raises(ConfigError, match="ttl_s"):
        InFlightPrefixes(256, ttl_s=0)
    with pytest.raises(ConfigError, match="align_tokens"):
        InFlightPrefixes(0)
    with pytest.raises(ConfigError, match="max_keys"):
        InFlightPrefixes(256, max_keys=0)


def test_memory_is_bounded_in_boundaries_oldest_first():
    index = make_index("a")
    tracker = InFlightPrefixes(256, max_keys=100)
    for i in range(5):                                      # 46 boundaries each (12,000 tokens)
        tracker.add("a", i, index.keys([i] + WRITER[1:]))
    tracker.check()
    assert len(tracker) == 2 and tracker.counters["evicted"] == 3
    # a single prompt longer than the bound is kept (the newest always is)
    tracker.add("a", "long", index.keys(list(range(40_000))))
    tracker.check()
    assert len(tracker) == 1 and tracker.expected(index.keys(list(range(40_001))))["a"][0] == 39_936


def test_a_stale_replica_is_scored_from_its_prefixes_in_flight_and_load():
    index = make_index("a", "b")
    index.mark_stale("a", 0, "events lost")
    policy = make_policy("kvatlas", index=index)
    policy.routed("a", "writer", WRITER)
    best = policy.choose(FOLLOWER, {"b": ReplicaLoad(), "a": ReplicaLoad(in_flight=1)})[0]
    assert (best.replica, best.predicted_tokens, best.in_flight_tokens) == ("a", 0, 11_776)


DOCS = [[d * 100_000 + i for i in range(4096)] for d in range(3)]


class InFlightMachine(RuleBasedStateMachine):
    """Random sends, finishes, clock steps, 'stored' drops, an entry cap and requests held (a router
    holding followers: they count for nobody's `expected` while held); after every step the
    tracker's structure is checked and its answer for every probe, with and without the held
    requests excluded, equals a plain model's."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.index = PrefixIndex(MODEL)
        self.t = InFlightPrefixes(256, ttl_s=50.0, max_entries=12, max_keys=60, clock=lambda: self.now)
        self.model: dict[int, tuple[str, tuple, float]] = {}     # request → (replica, prompt, sent)
        self.held: set[int] = set()
        self.next_id = 0

    @staticmethod
    def prompt(doc: int, length: int, fork: int) -> list[int]:
        base = DOCS[doc][:length]
        return base[:fork] + [9] * (length - fork) if fork < length else base

    def _model_expire(self) -> None:
        for r in [r for r, (_, _, t) in self.model.items() if t <= self.now - 50.0]:
            del self.model[r]

    @rule(replica=st.sampled_from("abc"), doc=st.integers(0, 2), length=st.integers(1, 4096),
          fork=st.integers(0, 4096))
    def send(self, replica, doc, length, fork) -> None:
        tokens = self.prompt(doc, length, fork)
        self._model_expire()
        rid = self.next_id
        self.next_id += 1
        added = self.t.add(replica, rid, self.index.keys(tokens))
        assert added == (length >= 256)
        if added:
            self.model[rid] = (replica, tuple(tokens), self.now)
            keys = lambda: sum(len(t) // 256 for _, t, _ in self.model.values())
            while len(self.model) > 12 or (keys() > 60 and len(self.model) > 1):     # oldest first
                del self.model[min(self.model, key=lambda r: (self.model[r][2], r))]

    @rule(data=st.data())
    def finish(self, data) -> None:
        if self.model:
            rid = data.draw(st.sampled_from(sorted(self.model)))
            assert self.t.finish(rid)
            del self.model[rid]
        assert not self.t.finish(-1)

    @rule(step=st.floats(0.0, 30.0))
    def tick(self, step) -> None:
        self.now += step

    @rule(data=st.data())
    def hold_or_release(self, data) -> None:
        ids = sorted(set(self.model) | self.held)
        if ids:
            rid = data.draw(st.sampled_from(ids))
            self.held ^= {rid}      # a request id no longer in flight may stay held: it must count for nothing

    @rule(data=st.data())
    def stored(self, data) -> None:
        if self.model:
            rid = data.draw(st.sampled_from(sorted(self.model)))
            replica, tokens, _ = self.model[rid]
            end = len(tokens) // 256 * 256
            key = self.index.keys(tokens[:end]).keys[-1]
            self._model_expire()
            gone = [r for r, (rep, tok, _) in self.model.items() if rep == replica and len(tok) // 256 * 256 == end
                    and tok[:end] == tokens[:end]]
            assert self.t.stored(replica, key) == len(gone)
            for r in gone:
                del self.model[r]

    @invariant()
    def agrees(self) -> None:
        self.t.check()
        self._model_expire()
        self.t.expire()
        assert len(self.t) == len(self.model)
        for doc in range(3):
            for length, fork in ((4096, 4096), (3000, 3000), (2000, 1000), (700, 700)):
                probe = self.prompt(doc, length, fork)
                cap = (len(probe) - 1) // 256 * 256
                want, unheld = {}, {}
                for rid, (replica, tokens, _) in self.model.items():
                    shared = 0      # the longest common prefix, within the writer's whole blocks and the cap
                    for x, y in zip(probe[:min(cap, len(tokens) // 256 * 256)], tokens):
                        if x != y:
                            break
                        shared += 1
                    if shared >= 256:
                        want[replica] = max(want.get(replica, 0), shared // 256 * 256)
                        if rid not in self.held:
                            unheld[replica] = max(unheld.get(replica, 0), shared // 256 * 256)
                keys = self.index.keys(probe)
                got = {r: tokens for r, (tokens, _) in self.t.expected(keys).items()}
                assert got == want, (doc, length, fork)
                got = {r: tokens for r, (tokens, _) in self.t.expected(keys, exclude=self.held).items()}
                assert got == unheld, (doc, length, fork, sorted(self.held))


TestInFlightMachine = InFlightMachine.TestCase
TestInFlightMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_fork_prefix_counts_the_full_groups_prefix_beyond_the_resumable_one():
    index = make_index("a", "b")
    index.apply("a", 0, computed(WRITER))                   # a holds the writer: resumable at 11,776
    sibling = WRITER[:8192] + [3] * 4000                    # shares 8,192 tokens, forks before its end
    plain = make_policy("kvatlas", index=index, weights=Weights(fork_prefix=0.0))
    fork = make_policy("kvatlas", index=index)             # the default: half of it
    loads = {"b": ReplicaLoad(), "a": ReplicaLoad()}
    assert [(c.replica, c.cost, c.predicted_tokens) for c in plain.choose(sibling, loads)] == [("b", 12_192, 0),
                                                                                            ("a", 12_192, 0)]
    best = fork.choose(sibling, loads)[0]
    assert (best.replica, best.cost, best.predicted_tokens) == ("a", 12_192 - 4_096, 0)
    # nothing beyond the resumable prefix: the term adds nothing (the follower resumes 11,776 either way)
    assert fork.choose(FOLLOWER, loads)[0].cost == plain.choose(FOLLOWER, loads)[0].cost == 13_000 - 11_776
    with pytest.raises(ConfigError, match="weights.fork_prefix"):
        Weights(fork_prefix=float("nan"))
