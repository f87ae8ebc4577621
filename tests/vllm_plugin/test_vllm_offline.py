"""The offline builder: vLLM's own planner (0.34 or 0.33, whichever is installed) and engine core, stood
up on the CPU from a kvatlas preset. Its figures are vLLM's; they must agree with kvatlas's pure- Python
model of that planner."""

import pytest

from kvatlas import load_model
from kvatlas.engines import run_engine
from kvatlas.errors import ConfigError

GIB = 2**30


@pytest.fixture(scope="module")
def kv():
    from kvatlas.integrations.vllm import offline as vllm
    return vllm


@pytest.mark.parametrize("model,blocks", [("deepseek-v4-flash", 128_561), ("deepseek-v4-pro", 89_729)])
def test_planner_figures_match_the_model_of_it(kv, model, blocks):
    cfg, config = kv.kv_cache_config(model, 120 * GIB, max_model_len=1_048_576)
    ours = run_engine("vllm", model, 120 * GIB, max_model_len=1_048_576)
    assert cfg.num_blocks == blocks == ours.figures["num_blocks"]
    assert config.cache_config.kv_cache_size_tokens == ours.reported.capacity_tokens
    assert len(cfg.kv_cache_groups) == 5 and config.cache_config.block_size == 4   # the smallest group's
    assert {t.block_stride for t in cfg.kv_cache_tensors} == {ours.figures["bytes_per_block"]}
    # a group's page: the pages of its layers' caches, as the layer views lay them out in a block
    pages = sorted((len(t.layers), t.layer_stride) for t in cfg.kv_cache_tensors)
    group_pages = sorted(sum(n * s for n, s in pages_of) for pages_of in _group_tensors(cfg))
    assert group_pages == sorted(g["page_bytes"] for g in ours.figures["groups"])


def _group_tensors(cfg):
    for group in cfg.kv_cache_groups:
        names = set(group.layer_names)
        yield [(len(t.layers), t.layer_stride) for t in cfg.kv_cache_tensors if names & set(t.layers)]


def test_flash_log_line_is_the_issue_figure(kv):
    _, config = kv.kv_cache_config("deepseek-v4-flash", 120 * GIB, max_model_len=1_048_576)
    assert config.cache_config.kv_cache_size_tokens == 12_507_513


def test_engine_runs_admission_prefill_decode_and_prefix_hits(kv):
    eng = kv.build_engine("deepseek-v4-flash", 8 * GIB, max_model_len=65_536, max_num_seqs=8,
                          max_num_batched_tokens=2048)
    assert type(eng.scheduler).__name__ == "AsyncScheduler"
    prompt = [7] * 5000
    eng.set_sampler(lambda rid, i: 100 + i)
    eng.add_request("a", prompt, max_tokens=4)
    eng.run()
    eng.add_request("b", prompt, max_tokens=4)
    eng.run()
    hits = sum(o.scheduler_stats.prefix_cache_stats.hits for o in eng.outputs if o.scheduler_stats)
    assert hits >= 4096                       # b found a's full 256-token blocks
    tokens = {}
    for out in eng.outputs:
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert tokens == {"a": [100, 101, 102, 103], "b": [100, 101, 102, 103]}
    assert not eng.has_requests()
    assert eng.block_pool.get_num_free_blocks() == eng.kv_cache_config.num_blocks - 1   # all but the null block


def test_unknown_option_is_named(kv):
    with pytest.raises(ConfigError, match="max_num_seq"):
        kv.EngineOptions.of(None, {"max_num_seq": 4})


def test_v3_model_refused(kv, tmp_path):
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ConfigError):
        kv.vllm_config(str(cfg))
    assert load_model("deepseek-v4-flash").family == "v4"


def test_kv_events_published_by_vllms_own_publisher(kv, tmp_path):
    """The scheduler's ZMQ publisher (bound on an ipc endpoint: no network), on the wire vLLM documents:
    (topic, 8-byte big-endian seq, msgpack EventBatch); a stored block per full block of each group."""
    import time

    import msgspec
    import zmq
    endpoint = f"ipc://{tmp_path}/kv-events"
    eng = kv.build_engine("deepseek-v4-flash", 2 * GIB, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024,
                          kv_events={"endpoint": endpoint, "topic": "kv"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    stored, seqs = [], []
    try:
        time.sleep(0.3)                       # the slow joiner: let the subscription reach the publisher
        eng.add_request("a", [5] * 1000, max_tokens=2)
        eng.run()
        while sum(len(e["block_hashes"]) for e in stored if e["block_size"] == 256) < 3:
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                break
            assert topic == b"kv" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            ts, events, *_ = msgspec.msgpack.decode(payload)
            stored += [e for e in events if e.get("type") == "BlockStored"]
    finally:
        sub.close(0)
        ctx.term()
        eng.shutdown()
    assert seqs == sorted(seqs) and stored
    # 1000 prompt tokens fill three 256-token blocks of the compressed-KV group
    assert sum(len(e["block_hashes"]) for e in stored if e["block_size"] == 256) == 3


def test_kv_events_option_names_a_wrong_field(kv):
    with pytest.raises(ConfigError, match="kv_events.endpoitn"):
        kv.vllm_config("deepseek-v4-flash", kv_events={"endpoitn": "ipc:///x"})
