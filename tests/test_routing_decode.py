"""vLLM's event wire decoded by msgspec with token ids left in their bytes, and the index's compact
full-group table: what a decoded event holds, each malformed field named, a full group's bad token
ids failing the whole batch before any change (and counted by the subscriber), copies of one block
counted. The model is V4.1 (bounded replay): a hit needs the full group alone, so these events
need no sliding groups. tests/vllm_plugin/test_routing_oracle.py checks the same code against
vLLM's own manager."""

import time

import msgpack
import numpy as np
import pytest

from kvatlas.routing import BlockRemoved, BlockStored, EventBatch, MalformedEventError, PrefixIndex, Subscriber
from kvatlas.routing.vllm_events import WireTokens, decode_payload, encode_batch
from routing_wire import FakePublisher, free_port, wait_for

MODEL = "deepseek-v4.1-flash"
TOKENS = list(range(1000, 1000 + 3 * 256))          # three full blocks
HASHES = (0xA1, 0xA2, 0xA3)


def stored(tokens=TOKENS, hashes=HASHES, parent=None, group=0, block=256) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_hash=parent, token_ids=tokens, block_tokens=block, group=group)


def wire(*events, ts: float = 1.0) -> bytes:
    return encode_batch(EventBatch(seq=-1, ts=ts, events=events, dp_rank=0))


def raw_event(**fields) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5] * 256,
             "block_size": 256, "lora_id": None, "medium": "GPU", "lora_name": None, **fields}
    return msgpack.packb([1.0, [event], 0])


def test_a_stored_event_round_trips_with_its_token_ids_left_in_bytes():
    batch = decode_payload(wire(stored(), BlockRemoved(block_hashes=(0xA3,), group=0, medium="CPU")), seq=7)
    e, r = batch.events
    assert (batch.seq, batch.ts, batch.dp_rank) == (7, 1.0, 0)
    assert isinstance(e.token_ids, WireTokens) and len(e.token_ids) == 768
    assert bytes(e.token_ids.raw)[:3] == b"\xdc\x03\x00"                # msgpack array16 of 768, not yet parsed
    assert e.block_hashes == HASHES and e.parent_hash is None and e.group == 0 and e.block_tokens == 256
    assert list(e.token_ids) == TOKENS and e.token_ids.tokens_array().dtype == np.uint32
    assert (r.block_hashes, r.group, r.medium) == ((0xA3,), 0, "CPU")
    bytes_hash = decode_payload(raw_event(block_hashes=[b"\x00" * 24 + (0xBEEF).to_bytes(8, "big")])).events[0]
    assert bytes_hash.block_hashes == (0xBEEF,)                     # vLLM's bytes hash: its low 64 bits


@pytest.mark.parametrize("payload, field", [
    (raw_event(colour="red"), "events[0]"),
    (raw_event(block_size="256"), "events[0].block_size"),
    (raw_event(block_size=0), "events[0].block_size"),
    (raw_event(token_ids=[5] * 255), "events[0].token_ids"),
    (raw_event(token_ids="abc"), "events[0].token_ids"),
    (raw_event(medium="DISK"), "events[0].medium"),
    (raw_event(block_hashes=[-1]), "events[0].block_hashes"),
    (raw_event(group_idx=-2), "events[0].group_idx"),
    (raw_event(type="BlockMoved"), "events[0].type"),
    (msgpack.packb(["now", [], 0]), "ts"),
    (msgpack.packb([1.0, [], -1]), "data_parallel_rank"),
    (b"\xc1 not msgpack", "payload"),
])
def test_each_malformed_field_is_named(payload, field):
    with pytest.raises(MalformedEventError) as err:
        decode_payload(payload)
    assert err.value.field == field, str(err.value)


def test_bad_full_group_token_ids_fail_the_batch_before_any_change():
    index = PrefixIndex(MODEL)
    index.apply("a", 0, decode_payload(wire(stored())))
    before = index.state()
    assert index.predict(TOKENS + [1])["a"].device_tokens == 768
    bad = raw_event(block_hashes=[0xB1], parent_block_hash=0xA3, token_ids=[5] * 255 + ["x"])
    batch = decode_payload(msgpack.packb([2.0, [msgpack.unpackb(raw_event(block_hashes=[0xC1]))[1][0],
                                                msgpack.unpackb(bad)[1][0]], 0]))
    with pytest.raises(MalformedEventError) as err:
        index.apply("a", 0, batch)
    assert err.value.field == "events[1].token_ids"
    assert index.state() == before                                  # the good event before it not applied either
    assert index.predict(TOKENS + [1])["a"].device_tokens == 768


def test_copies_of_one_block_are_counted():
    index = PrefixIndex(MODEL)
    prompt = TOKENS + [1]
    for _ in range(2):
        index.apply("a", 0, decode_payload(wire(stored())))
    assert index.predict(prompt)["a"].device_tokens == 768
    index.apply("a", 0, decode_payload(wire(BlockRemoved(block_hashes=(0xA2,), group=0))))
    assert index.predict(prompt)["a"].device_tokens == 768           # one copy of [256, 512) left
    index.apply("a", 0, decode_payload(wire(BlockRemoved(block_hashes=(0xA2,), group=0))))
    assert index.predict(prompt)["a"].device_tokens == 256
    st = index.state()["engines"]["a"]["0"]
    assert st["blocks"] == {"GPU": {"0": 2}} and st["removed_blocks"] == 2 and st["unknown_removals"] == 0
    # a chain continued through its parent's key: the next block, from another event
    index.apply("a", 0, decode_payload(wire(BlockRemoved(block_hashes=(0xA3,), group=0))))
    index.apply("a", 0, decode_payload(wire(stored())))
    nxt = list(range(5000, 5256))
    index.apply("a", 0, decode_payload(wire(stored(nxt, (0xA4,), parent=0xA3))))
    assert index.predict(TOKENS + nxt + [1])["a"].device_tokens == 1024
    assert index.predict(TOKENS + nxt[:-1] + [7, 1])["a"].device_tokens == 768   # its last token differs


def test_the_subscriber_counts_a_batch_the_index_cannot_read_and_goes_on():
    port = free_port()
    pub = FakePublisher(port, None)
    index = PrefixIndex(MODEL)
    lost = []
    sub = Subscriber(f"tcp://127.0.0.1:{port}", on_batch=lambda b: index.apply("a", 0, b), on_lost=lost.append,
                     replica="a", idle_probe_s=None)
    sub.start()
    try:
        assert wait_for(lambda: sub.stats().connected)
        time.sleep(0.3)
        pub.publish(EventBatch(seq=-1, ts=1.0, events=()), payload=raw_event(token_ids=[5] * 255 + [None]))
        pub.publish(EventBatch(seq=-1, ts=2.0, events=(stored(),)))
        assert wait_for(lambda: sub.stats().last_seq == 1)
        s = sub.stats()
        assert s.malformed == 1 and s.batches == 1 and lost and "events[0].token_ids" in lost[0]
        assert index.predict(TOKENS + [1])["a"].device_tokens == 768
    finally:
        sub.stop()
        pub.close()
