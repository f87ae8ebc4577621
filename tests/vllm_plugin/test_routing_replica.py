"""kvatlas.routing over the real wire: one vLLM engine core (`ReplicaServer`, the routing harness's
replica) publishing through vLLM's own ZMQ publisher and replay socket on loopback, a `Fleet`
subscribed to it; after each request the index, fed only by what came over the socket, predicts what
vLLM's own `find_longest_cache_hit` answers, and a cache reset empties both."""

from __future__ import annotations

import random
import socket
import time

import pytest

from kvatlas.integrations.vllm.replica import ReplicaServer
from kvatlas.routing import Fleet, PrefixIndex, groups_from_metadata

MODEL = "deepseek-v4-flash"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def caught_up(fleet: Fleet, published: int, timeout_s: float = 30.0) -> bool:
    sub = fleet.subscribers()[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = sub.stats().last_seq
        if last is not None and last >= published - 1:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def replica():
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = ReplicaServer(MODEL, "0.5GiB", endpoint, replay,
                           {"max_model_len": 4096, "max_num_seqs": 4, "max_num_batched_tokens": 1000,
                            "async_scheduling": False})
    index = PrefixIndex(MODEL)
    fleet = Fleet(index)
    fleet.add("a", endpoint, replay_endpoint=replay, bind=True, idle_probe_s=0.05,
              groups=groups_from_metadata(index.rule, server.metadata))
    fleet.start()
    time.sleep(0.3)
    yield server, fleet, index
    fleet.stop()
    server.handle("stop")


def test_index_over_vllm_zmq_matches_the_engine(replica):
    server, fleet, index = replica
    ok, published = server.handle("reset")
    assert ok and caught_up(fleet, published)
    rng = random.Random(7)
    doc = [rng.randrange(1000, 60000) for _ in range(1500)]
    prompts = [doc[:1200], doc[:1500], doc[:700] + [5] * 600, doc[:1500] + [9] * 300]
    for i, tokens in enumerate(prompts):
        server.handle("add", f"q{i}", tokens, 2)
        out = {"running": 1}
        while out["running"] or out.get("waiting"):
            out = server.handle("step")
        assert caught_up(fleet, out["published"]), fleet.state()["subscribers"]
        for probe in prompts:
            want = server.handle("hit", probe)
            got = index.predict(probe)["a"]
            assert got.device_tokens == want, (i, len(probe), got, want)
            assert not got.stale
    assert index.predict(doc[:1500] + [9] * 300)["a"].device_tokens > 0     # the last request's own prefix
    ok, published = server.handle("reset")
    assert ok and caught_up(fleet, published)
    assert index.predict(doc[:1500])["a"].device_tokens == 0 == server.handle("hit", doc[:1500])
    stats = fleet.state()["subscribers"][0]
    assert stats["malformed"] == 0 and stats["lost_batches"] == 0


def test_a_follower_goes_where_its_prefix_is_being_prefilled(replica):
    """The writer is mid-prefill on replica a (1,000-token steps): nothing of it is resumable yet and
    the index says so; the policy, told what it sent, sends the next turn after it (to a, not to the
    idle b), and the engine then resumes that turn from the writer's aligned end, as expected."""
    from kvatlas.routing import ReplicaLoad, Weights, make_policy
    server, fleet, index = replica
    ok, published = server.handle("reset")
    assert ok and caught_up(fleet, published)
    rng = random.Random(11)
    writer = [rng.randrange(1000, 60000) for _ in range(3000)]
    follower = writer + [rng.randrange(1000, 60000) for _ in range(500)]
    policy = make_policy("kvatlas", index=index)
    # the greedy choice of before: what is resumable now, nothing for prompts in flight or forks (the
    # writer's first chunk is already in the full group there: a fork term would count it)
    greedy = make_policy("kvatlas", index=index, weights=Weights(in_flight_prefix=0.0, fork_prefix=0.0))
    server.handle("add", "writer", writer, 2)
    policy.routed("a", "writer", writer)
    greedy.routed("a", "writer", writer)
    out = server.handle("step")                        # the first 1,000 of its 3,000 tokens
    assert out["running"] == 1 and caught_up(fleet, out["published"])
    loads = {"b": ReplicaLoad(), "a": ReplicaLoad()}   # b listed first: it wins ties
    now = server.handle("hit", follower)
    best = policy.choose(follower, loads)[0]
    assert (best.replica, best.predicted_tokens, best.in_flight_tokens) == ("a", now, 2816 - now)
    assert greedy.choose(follower, loads)[0].replica == "b"
    server.handle("add", "follower", follower, 2)
    cached = {}
    while out["running"] or out["waiting"]:
        out = server.handle("step")
        cached.update(out["cached"])
    assert cached["follower"] == best.predicted_tokens + best.in_flight_tokens == 2816
    assert caught_up(fleet, out["published"])
    policy.finished("writer")
    assert len(policy.in_flight) == 0
    for probe in (writer + [5] * 100, follower):       # both prompts' ends are resident now: the index says it exactly
        assert index.predict(probe)["a"].device_tokens == server.handle("hit", probe) > 0


def test_a_fork_point_becomes_resumable_once_a_second_prompt_through_it_is_computed(replica):
    """What `Weights.fork_prefix` rests on, on the real engine: after one prompt, a sibling sharing
    its first 2,048 tokens resumes from nothing (the tails are kept at the prompt's end only); after
    a second prompt through the same prefix, the fork point is resumable — and the index says so."""
    server, fleet, index = replica
    ok, published = server.handle("reset")
    assert ok and caught_up(fleet, published)
    rng = random.Random(5)
    shared = [rng.randrange(1000, 60000) for _ in range(2048)]
    siblings = [shared + [rng.randrange(1000, 60000) for _ in range(700)] for _ in range(3)]
    for i, prompt in enumerate(siblings[:2]):
        server.handle("add", f"s{i}", prompt, 2)
        out = {"running": 1}
        while out["running"] or out.get("waiting"):
            out = server.handle("step")
        assert caught_up(fleet, out["published"])
        want = 0 if i == 0 else 2048
        assert server.handle("hit", siblings[2]) == index.predict(siblings[2])["a"].device_tokens == want
        assert index.predict(siblings[2])["a"].main_group_tokens == 2048
