"""`kvatlas tune`'s vLLM flags checked against vLLM 0.33's own planner on the CPU: with the tuned
flags and with its defaults, its KVCacheConfig has exactly the predicted blocks and its start-up
log line ("GPU KV cache size") exactly the predicted figure; its engine core starts with the
tuned flags (the retention interval is one it accepts)."""

import pytest

from kvatlas.advice import profile, tune
from kvatlas.driving.traces import read_trace

HEAD = "tests/data/mooncake_head.jsonl"
GIB = 2**30


@pytest.fixture(scope="module")
def kv():
    from kvatlas.integrations.vllm import offline as vllm
    return vllm


def _options(flags: dict) -> dict:
    return {"max_num_seqs": flags["--max-num-seqs"], "max_num_batched_tokens": flags["--max-num-batched-tokens"],
            "max_model_len": flags["--max-model-len"],
            "prefix_cache_retention_interval": flags["--prefix-cache-retention-interval"]}


@pytest.fixture(scope="module")
def advice():
    reqs, _ = read_trace(HEAD)
    return tune("deepseek-v4-flash", profile(reqs), engines=("vllm",), tp=4)


@pytest.mark.parametrize("which", ["tuned", "default"])
def test_planner_gives_the_predicted_blocks_and_logged_figure(kv, advice, which):
    setting = getattr(advice.engine("vllm"), which)
    cfg, config = kv.kv_cache_config("deepseek-v4-flash", advice.budget_bytes, **_options(setting.flags))
    assert cfg.num_blocks == setting.reported["num_gpu_blocks"]
    assert config.cache_config.kv_cache_size_tokens == setting.reported["gpu_kv_cache_size_tokens"]


def test_engine_core_starts_with_the_tuned_flags(kv, advice):
    e = advice.engine("vllm")
    eng = kv.build_engine("deepseek-v4-flash", advice.budget_bytes, **_options(e.tuned.flags))
    assert eng.kv_cache_config.num_blocks == e.tuned.reported["num_gpu_blocks"]
    assert eng.core.scheduler.max_num_running_reqs == e.tuned.flags["--max-num-seqs"]
