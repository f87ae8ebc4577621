"""vLLM's hybrid KV cache manager for DeepSeek-V4, pinned to figures derivable from its public behaviour."""

import pytest

from kvatlas import load_model
from kvatlas.engines import run_engine
from kvatlas.engines import vllm
from kvatlas.errors import BudgetError, ConfigError
from kvatlas.planning.options import ServeOptions

GIB = 2**30
BUDGET = 120 * GIB


def vl(model="deepseek-v4-flash", memory=BUDGET, **kw):
    return run_engine("vllm", model, memory, **kw)


def _groups(model="deepseek-v4-flash", **kw):
    m = load_model(model)
    opts = ServeOptions.from_kwargs(**kw).resolve(m)
    return vllm.groups(vllm.layer_caches(m, opts))


def test_per_cache_page_sizes():
    pages = {c.name: c.page_bytes for c in vllm.layer_caches(load_model("deepseek-v4-flash"),
                                                             ServeOptions().resolve(load_model("deepseek-v4-flash")))}
    assert pages == {"swa": 37_440, "c4_kv": 37_440, "c4_indexer": 8_640, "c4_state": 32_832,
                     "c4_indexer_state": 8_640, "c128_kv": 1_728, "c128_state": 32_832}


def test_five_groups_and_their_pages():
    g = {x.name: (len({c.layer for c in x.caches}), x.page_bytes) for x in _groups()}
    assert g == {"swa.0": (22, 823_680), "swa.1": (21, 786_240), "mla": (41, 1_002_240),
                 "c4_state": (21, 870_912), "c128_state": (20, 656_640)}
    assert vllm.approximate_gcd([43, 21, 20], 21) == 22 and vllm.approximate_gcd([61, 30, 31], 30) == 31
    pro = {x.name: x.page_bytes for x in _groups("deepseek-v4-pro")}
    assert pro == {"swa.0": 1_160_640, "swa.1": 1_123_200, "mla": 1_435_968, "c4_state": 1_244_160,
                   "c128_state": 1_017_792}


def test_mtp_layer_adds_swa_only():
    g = {x.name: (len(x.caches), x.page_bytes) for x in _groups(draft_tokens=1)}
    assert g["swa.0"][0] == g["swa.1"][0] == 22 and g["mla"][1] == 1_002_240


def test_shared_block_pool():
    r = vl()
    assert r.figures["bytes_per_block"] == 1_002_240 and r.figures["num_blocks"] == 128_561
    assert r.allocated_bytes == 128_561 * 1_002_240 <= BUDGET
    assert r.figures["slope_bytes_per_token"] == 1_002_240 / 256 == 3915.0
    assert vl("deepseek-v4-pro").figures["num_blocks"] == 89_729
    fp4 = vl(indexer="fp4")
    assert (fp4.figures["bytes_per_block"], fp4.figures["num_blocks"]) == (917_568, 140_424)


def test_logged_kv_cache_size_is_a_concurrency():
    r = vl()
    per_request = {g["name"]: g["max_blocks_per_request"] for g in r.figures["groups"]}
    assert per_request == {"swa.0": 259, "swa.1": 259, "mla": 4_096, "c4_state": 4_099, "c128_state": 2_065}
    assert r.reported.capacity_tokens == int(128_561 / 10_778 * 1_048_576) == 12_507_513
    assert "GPU KV cache size: 12,507,513 tokens" in r.reported.lines
    assert vl("deepseek-v4-pro").reported.capacity_tokens == 8_729_604
    assert vl(max_model_len=131_072).reported.capacity_tokens == 2_342_333  # moves with max_model_len
    assert r.reported.memory_gauge_bytes is None


def test_truth_beside_the_log():
    r = vl()
    # 255 decoding requests keep 3+3+3+17 sliding blocks each, one prefilling request its 6,682-block reserve
    assert r.pool_tokens == (128_561 - 1 - 255 * 26 - 6_682) * 256 == 29_503_488
    assert r.token_capacity == r.pool_tokens > r.reported.capacity_tokens
    assert sum(b.bytes for b in r.buffers) == r.allocated_bytes
    assert r.dead_bytes == r.allocated_bytes - r.reachable_bytes > 0
    # at 1M: 28 settled requests of 4,096 + 26 blocks and the last one admitted with its reserve
    assert r.concurrency[1_048_576] == 1 + (128_560 - 4_096 - 6_682) // 4_122 == 29


@pytest.mark.parametrize("kw, field", [
    (dict(state_dtype="bf16"), "state_dtype"),
    (dict(online_c128=True), "online_c128"),
    (dict(indexer="bf16"), "indexer"),
    (dict(swa_mode="cap"), "swa_mode"),
    (dict(pp=2), "pp"),
])
def test_bad_options(kw, field):
    with pytest.raises(ConfigError) as err:
        vl(**kw)
    assert err.value.field == field and err.value.fix


def test_refuses_to_start_without_one_request():
    with pytest.raises(BudgetError, match="vllm"):
        vl(memory=8 * GIB)
