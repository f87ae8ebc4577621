"""kvatlas route's parts without a network: --replica parsing, the prompt's token ids (ids, text,
chat through a real tokenizer and its chat template), vLLM's load gauges, the metrics."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvatlas.errors import ConfigError
from kvatlas.routing.replicas import ReplicaState, parse_replica, parse_replicas, parse_vllm_load
from kvatlas.routing.tokenize import NO_TOKENIZER, ClientError, PromptTokenizer

from route_fleet import metric, tiny_tokenizer


def test_replica_flag_gives_url_ranks_and_replay_ports():
    s = parse_replica("http://10.0.0.5:8000/=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5600,dp=3,name=east-1", 0)
    assert s.name == "east-1" and s.url == "http://10.0.0.5:8000" and s.dp_size == 3
    assert [(r.dp_rank, r.events_endpoint, r.replay_endpoint) for r in s.ranks] == [
        (0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600"), (1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601"),
        (2, "tcp://10.0.0.5:5559", "tcp://10.0.0.5:5602")]
    plain = parse_replica("http://h:8000", 4)
    assert plain.name == "r4" and plain.ranks[0].events_endpoint is None and plain.dp_size == 1
    assert not s.bind and parse_replica("http://h:8000=tcp://127.0.0.1:5557,bind,dp=2", 0).bind


@pytest.mark.parametrize("text, field_words", [
    ("h:8000=tcp://h:1", "base URL"), ("http://h:8000/v1=tcp://h:1", "base URL"),
    ("http://h:8000=udp://h:1", "ZMQ tcp endpoint"), ("http://h:8000=tcp://h", "ZMQ tcp endpoint"),
    ("http://h:8000=tcp://h:1,dp=0", "rank count"), ("http://h:8000=tcp://h:1,dp=x", "rank count"),
    ("http://h:8000=tcp://h:1,foo=1", "not an option"), ("http://h:8000=tcp://h:65535,dp=2", "port 65536"),
    ("http://h:8000=tcp://h:1,name=a b", "name="), ("http://h:99999=tcp://h:1", "base URL"),
    ("http://h:8000,bind", "bind without an events endpoint"), ("http://h:8000=tcp://h:1,bind=1", "not an option"),
    ("http://h:8000=tcp://h:1,bind,bind", "not an option")])
def test_bad_replica_flags_name_the_flag_and_the_fix(text, field_words):
    with pytest.raises(ConfigError) as e:
        parse_replica(text, 0)
    assert field_words in str(e.value) and "--replica" in str(e.value)


def test_replicas_must_be_distinct_and_present():
    with pytest.raises(ConfigError, match="no replica"):
        parse_replicas([])
    with pytest.raises(ConfigError, match="URL 'http://h:1' is given twice"):
        parse_replicas(["http://h:1=tcp://h:5", "http://h:1=tcp://h:6,name=b"])
    with pytest.raises(ConfigError, match="name 'x' is given twice"):
        parse_replicas(["http://h:1,name=x", "http://h:2=tcp://h:6,name=x"][1:] * 2)


def test_vllm_load_gauges_are_summed_over_engines():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\nvllm:num_requests_waiting{engine="0"} 7.0\n'
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 9\n')
    assert parse_vllm_load(text) == (5, 7)
    assert parse_vllm_load("other_metric 1\n") == (None, None)
    s = ReplicaState(spec=parse_replica("http://h:1", 0), in_flight=4, running=3, waiting=2)
    assert s.load() == 5
    s.take_out("refused")
    assert not s.up and s.down_reason == "refused" and s.failures == 1
    s.bring_back()
    assert s.up and s.recoveries == 1 and s.down_reason == ""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return PromptTokenizer(tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def test_token_ids_pass_through_and_are_checked():
    t = PromptTokenizer(None)
    ids = t.completion_ids({"prompt": [1, 2, 3]})
    assert ids.dtype == np.uint32 and ids.tolist() == [1, 2, 3]         # the array the check built, digested as is
    assert t.completion_ids({"prompt": [[4, 5], [6]]}).tolist() == [4, 5]   # a batch routes by its first prompt
    for bad in ([], [1, True], [-1], [2**31], "x", None, 7, [[]]):
        with pytest.raises(ClientError) as e:
            t.completion_ids({"prompt": bad})
        assert e.value.status == 400 and e.value.param in ("prompt",)
    with pytest.raises(ClientError) as e:
        t.completion_ids({"prompt": "hello world"})
    assert NO_TOKENIZER in e.value.message and "--tokenizer" in e.value.message
    with pytest.raises(ClientError, match="--tokenizer"):
        t.chat_ids({"messages": [{"role": "user", "content": "hi"}]})


def test_text_and_chat_are_tokenized_as_the_engine_does(tok):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(tok.path)
    assert tok.completion_ids({"prompt": "hello world the cache"}) == ref("hello world the cache")["input_ids"]
    assert tok.completion_ids({"prompt": "hello", "add_special_tokens": False}) == [ref.convert_tokens_to_ids("hello")]
    msgs = [{"role": "system", "content": "the cache is warm"}, {"role": "user", "content": "hello world"}]
    ids = tok.chat_ids({"messages": msgs})
    words = "<|system|> the cache is warm <|user|> hello world <|assistant|>".split()
    assert ids == ref.convert_tokens_to_ids(words)
    cont = tok.chat_ids({"messages": msgs + [{"role": "assistant", "content": "hello"}], "continue_final_message": True})
    assert cont == ref.convert_tokens_to_ids(words[:-1] + ["<|assistant|>", "hello"])
    with pytest.raises(ClientError, match="messages"):
        tok.chat_ids({"messages": "hi"})
    with pytest.raises(ClientError, match="chat template refused"):
        tok.chat_ids({"messages": [{"role": "user"}], "chat_template": "{{ messages[0]['content'] + 1 }}"})


def test_bad_tokenizer_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer"):
        PromptTokenizer(str(tmp_path))


def test_metrics_count_usage_against_predictions():
    from kvatlas.routing.metrics import RouteMetrics
    s = ReplicaState(spec=parse_replica("http://h:1,name=a", 0))
    s.take_out("timeout")
    ranks = [{"replica": "a", "dp_rank": 0, "lag_s": 0.5, "batches": 9, "gaps": 2, "replays": 1, "malformed": 3,
              "stale": True}]
    m = RouteMetrics(lambda: ([s], ranks))
    m.observe_usage("a", 512, 768, 1000, 768)  # resident 512 at routing time, 768 once the prefix in flight is done
    m.observe_usage("a", None, 256, 300)       # no prediction made (stale events): counted, no error sample
    text = generate_latest(m.registry).decode()
    assert metric(text, "kvatlas_route_expected_cached_tokens_total", replica="a") == 768
    assert metric(text, "kvatlas_route_expected_error_tokens_count", replica="a") == 1
    assert metric(text, "kvatlas_route_expected_error_tokens_bucket", replica="a", le="-1.0") == 0
    assert metric(text, "kvatlas_route_expected_error_tokens_bucket", replica="a", le="0.0") == 1
    assert metric(text, "kvatlas_route_engine_cached_tokens_total", replica="a") == 1024
    assert metric(text, "kvatlas_route_predicted_cached_tokens_total", replica="a") == 512
    assert metric(text, "kvatlas_route_prompt_tokens_total", replica="a") == 1300
    assert metric(text, "kvatlas_route_prediction_error_tokens_count", replica="a") == 1
    assert metric(text, "kvatlas_route_prediction_error_tokens_bucket", replica="a", le="256.0") == 1
    assert metric(text, "kvatlas_route_prediction_error_tokens_bucket", replica="a", le="0.0") == 0
    assert metric(text, "kvatlas_route_replica_up", replica="a", reason="timeout") == 0
    assert metric(text, "kvatlas_route_event_malformed_total", replica="a", dp_rank="0") == 3
    assert metric(text, "kvatlas_route_event_stale", replica="a", dp_rank="0") == 1
    assert metric(text, "kvatlas_route_stale_replicas") == 1


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kvatlas", "main_group_prefix"])
def test_requests_nobody_holds_go_round_every_replica_and_score_takes_no_turn(policy):
    from kvatlas.routing.choose import Chooser
    specs = [parse_replica(f"http://127.0.0.1:{4000 + i},name=r{i}", i) for i in range(4)]
    chooser = Chooser("deepseek-v4-flash", specs, policy)
    states = [ReplicaState(spec=s) for s in specs]
    sent = []
    for _ in range(8):
        scored = chooser.score([7] * 300, states)["choice"]["replica"]
        chosen = chooser.rank([7] * 300, states)[0].replica
        assert scored == chosen                      # /score answers what the next request gets
        sent.append(chosen)
    assert sent == ["r0", "r1", "r2", "r3"] * 2


def test_score_shows_resident_and_in_flight_and_the_router_forgets_what_ended():
    from kvatlas.routing.choose import Chooser
    specs = [parse_replica(f"http://127.0.0.1:{4000 + i},name=r{i}", i) for i in range(2)]
    chooser = Chooser("deepseek-v4-flash", specs, "kvatlas")
    states = [ReplicaState(spec=s) for s in specs]
    writer = list(range(100, 9100))                            # 9,000 tokens: its aligned end 8,960
    prompt = chooser.prompt(writer)
    first = chooser.rank(prompt, states)[0].replica
    handle = chooser.sent(first, prompt)
    doc = chooser.score(writer + [5] * 500, states)
    rows = {r["replica"]: r for r in doc["candidates"]}
    assert doc["choice"] == {"replica": first, "dp_rank": None, "reason": "prefix"}
    assert (rows[first]["device_tokens"], rows[first]["in_flight_tokens"], rows[first]["expected_tokens"]) == (0, 8960, 8960)
    other = ({"r0", "r1"} - {first}).pop()
    assert (rows[other]["in_flight_tokens"], rows[other]["expected_tokens"]) == (0, 0)
    chooser.done(handle)
    rows = {r["replica"]: r for r in chooser.score(writer + [5] * 500, states)["candidates"]}
    assert rows[first]["in_flight_tokens"] == 0 and len(chooser.policy.in_flight) == 0


def test_weights_flag_sets_the_named_weights_and_refuses_others():
    from kvatlas.cli.route import parse_weights
    from kvatlas.routing import Weights
    assert parse_weights(None) is None
    assert parse_weights("waiting=2048, fork_prefix=0") == Weights(waiting=2048.0, fork_prefix=0.0)
    for text, words in (("bogus=1", "NAME one of"), ("waiting", "NAME=VALUE"), ("waiting=x", "not a number"),
                        ("waiting=-1", "weights.waiting")):
        with pytest.raises(ConfigError, match=words):
            parse_weights(text)


def _two_replicas_kvatlas():
    from kvatlas.routing import groups_from_metadata
    from kvatlas.routing.choose import Chooser
    from test_routing_inflight import METADATA
    specs = [parse_replica(f"http://127.0.0.1:{4000 + i},name=r{i}", i) for i in range(2)]
    chooser = Chooser("deepseek-v4-flash", specs, "kvatlas")
    for s in specs:
        chooser.index.add_engine(s.name, 0, groups_from_metadata(chooser.index.rule, METADATA))
    return chooser, [ReplicaState(spec=s) for s in specs]


def test_a_follower_waits_for_its_writer_until_the_events_show_the_prefix_or_the_writer_ends():
    from test_routing_inflight import computed
    chooser, states = _two_replicas_kvatlas()
    writer = list(range(100, 9100))                             # aligned end 8,960
    w = chooser.prompt(writer)
    first = chooser.rank(w, states)[0].replica
    wh = chooser.sent(first, w)
    follower = chooser.prompt(writer[:6000] + [5] * 500)        # shares 5,888 tokens of it: a fork
    cand = chooser.rank(follower, states)[0]
    assert (cand.replica, cand.predicted_tokens, cand.in_flight_tokens) == (first, 0, 5888)
    fh = chooser.sent(first, follower)
    assert chooser.waits(first, follower, fh)
    # another request held meanwhile is no writer: a follower of the follower waits for the writer only
    chooser.held.add(fh)
    third = chooser.prompt(writer[:6000] + [5] * 600)
    assert chooser.waits(first, third, -1)
    assert chooser.policy.in_flight.expected(third, [first], exclude=chooser.held | {-1})[first][0] == 5888
    chooser.held.discard(fh)
    # the writer computed and published: nothing to wait for, and the prediction is the index's
    chooser.index.apply(first, 0, computed(writer[:5888]))      # the engine holds the shared 5,888 (and its tails)
    assert not chooser.waits(first, follower, fh)
    assert chooser.refreshed(cand, follower, fh).predicted_tokens == 5888
    # or the writer ended (its events lost): nothing to wait for either
    chooser2, states2 = _two_replicas_kvatlas()
    h = chooser2.sent("r1", chooser2.prompt(writer))
    f2 = chooser2.prompt(writer + [3] * 100)
    assert chooser2.waits("r1", f2, -1)
    chooser2.done(h)
    assert not chooser2.waits("r1", f2, -1)
    # a stale replica is never waited on
    h = chooser2.sent("r1", chooser2.prompt(writer))
    chooser2.index.mark_stale("r1", 0, "events lost")
    assert not chooser2.waits("r1", f2, -1)


def test_hold_ends_when_the_events_arrive_and_is_bounded():
    import asyncio
    from test_routing_inflight import computed
    chooser, _ = _two_replicas_kvatlas()
    writer = list(range(100, 9100))
    chooser.sent("r0", chooser.prompt(writer))
    follower = chooser.prompt(writer + [5] * 500)

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, chooser.index.apply, "r0", 0, computed(writer))
        waited = await chooser.hold("r0", follower, 10_001, 5.0)
        assert 0.04 <= waited < 1.0 and not chooser.held
        # nothing to wait for: sent at once
        assert await chooser.hold("r0", follower, 10_002, 5.0) == 0.0
        # a writer that never publishes: the bound
        chooser.sent("r1", chooser.prompt(writer))
        waited = await chooser.hold("r1", follower, 10_003, 0.2)
        assert 0.2 <= waited < 1.0 and chooser.held_total == 2 and not chooser.held
    asyncio.run(scenario())


def test_hold_flag_is_checked(capsys):
    from kvatlas.cli import main
    for bad in ("-1", "nan", "x", "4000"):
        assert main(["route", "deepseek-v4-flash", "--replica", "http://127.0.0.1:1", "--hold-s", bad]) == 2
        err = capsys.readouterr().err
        assert "--hold-s" in err and "[0, 3600]" in err, err


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


from hypothesis import settings as _settings, strategies as _st                      # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant as _inv, rule as _rule  # noqa: E402


class HoldMachine(RuleBasedStateMachine):
    """Writers sent, followers held, prompts computed (their events applied), requests ending, on
    two replicas, interleaved at random; after every step each held request waits exactly while a
    request sent there and not held shares more of its prompt than the index shows resident, and
    held requests are never writers (so two held requests never wait on each other)."""

    DOC = list(range(5000, 9000))

    def __init__(self) -> None:
        super().__init__()
        self.chooser, _ = _two_replicas_kvatlas()
        self.sent: dict[int, tuple[str, list]] = {}       # handle → (replica, prompt tokens)
        self.held: dict[int, tuple[str, list]] = {}
        self.seq = 0

    def _prompt(self, length: int, fork: int) -> list[int]:
        return self.DOC[:fork] + [7 + length] * (length - fork) if fork < length else self.DOC[:length]

    @_rule(replica=_st.sampled_from(["r0", "r1"]), length=_st.integers(300, 4000), fork=_st.integers(0, 4000),
           held=_st.booleans())
    def send(self, replica, length, fork, held) -> None:
        tokens = self._prompt(length, fork)
        h = self.chooser.sent(replica, self.chooser.prompt(tokens))
        if held:
            self.chooser.held.add(h)
            self.held[h] = (replica, tokens)
        else:
            self.sent[h] = (replica, tokens)

    @_rule(data=_st.data())
    def release(self, data) -> None:
        if self.held:
            h = data.draw(_st.sampled_from(sorted(self.held)))
            self.chooser.held.discard(h)
            self.sent[h] = self.held.pop(h)

    @_rule(data=_st.data())
    def compute(self, data) -> None:
        from test_routing_inflight import computed
        if self.sent:
            h = data.draw(_st.sampled_from(sorted(self.sent)))
            replica, tokens = self.sent[h]
            self.seq += 1
            self.chooser.index.apply(replica, 0, computed(tokens, self.seq))

    @_rule(data=_st.data())
    def finish(self, data) -> None:
        live = sorted(set(self.sent) | set(self.held))
        if live:
            h = data.draw(_st.sampled_from(live))
            self.chooser.held.discard(h)
            self.sent.pop(h, None)
            self.held.pop(h, None)
            self.chooser.done(h)

    @_inv()
    def waits_as_the_model_says(self) -> None:
        self.chooser.policy.in_flight.check()
        assert self.chooser.held == set(self.held)
        for h, (replica, tokens) in self.held.items():
            keys = self.chooser.prompt(tokens)
            resident = self.chooser.index.predict(keys, [replica])[replica].device_tokens
            cap = (len(tokens) - 1) // 256 * 256
            deepest = max([min(_lcp(tokens, w), len(w) // 256 * 256, cap) // 256 * 256
                           for other, (rep, w) in self.sent.items() if rep == replica and other != h] or [0])
            assert self.chooser.waits(replica, keys, h) == (deepest >= 256 and deepest > resident), (h, deepest, resident)


TestHoldMachine = HoldMachine.TestCase
TestHoldMachine.settings = _settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True)
