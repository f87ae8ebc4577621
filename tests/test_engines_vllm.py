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
    # 255 decoding requests keep 3+3+3+17 sliding blocks each, one prefilling request peaks at 6,678
    assert r.pool_tokens == (128_561 - 1 - 255 * 26 - 6_678) * 256 == 29_504_512
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


# ---- issue 17: the five corrections found by running the engines' own sizing code ----------

@pytest.mark.parametrize("model, block_bytes, refused_at", [
    ("deepseek-v4-flash", 1_002_240, 10_802_142_720),
    ("deepseek-v4-pro", 1_435_968, 15_476_863_104),
])
def test_null_block_is_set_aside_before_the_start_up_check(model, block_bytes, refused_at):
    # one 1M request needs 4,096 + 259 + 259 + 4,099 + 2,065 = 10,778 blocks; a pool of exactly
    # that many is refused because block 0 (the null block) is not lent
    assert refused_at == 10_778 * block_bytes
    with pytest.raises(BudgetError, match="needs 10,778 blocks besides the null block"):
        vl(model, memory=refused_at)
    with pytest.raises(BudgetError):
        vl(model, memory=refused_at + block_bytes - 1)
    r = vl(model, memory=refused_at + block_bytes)  # one block more: it starts
    assert r.figures["num_blocks"] == 10_779
    assert r.reported.capacity_tokens == int(10_779 / 10_778 * 1_048_576) == 1_048_673


def test_chunk_aligned_prefill_peaks_one_block_under_the_reserve():
    r = vl()
    groups = {g["name"]: g for g in r.figures["groups"]}
    assert {n: g["max_blocks_per_request"] for n, g in groups.items() if n != "mla"} == \
        {"swa.0": 259, "swa.1": 259, "c4_state": 4_099, "c128_state": 2_065}
    assert {n: g["prefill_peak_blocks"] for n, g in groups.items() if n != "mla"} == \
        {"swa.0": 258, "swa.1": 258, "c4_state": 4_098, "c128_state": 2_064}
    assert groups["mla"]["prefill_peak_blocks"] is None
    # 1,024 tokens (4 blocks of 256) more than charging the full reserve gave (29,503,488 / 7,562,240)
    assert r.token_capacity == 29_503_488 + 1_024 == 29_504_512
    small = vl(memory=40 * GIB)
    assert small.figures["num_blocks"] == 42_853
    assert small.token_capacity == (42_853 - 1 - 255 * 26 - 6_678) * 256 == 7_562_240 + 1_024


def test_prefill_peak_follows_the_span_not_a_rule_of_thumb():
    def per_group(r, key):
        return {g["name"]: g[key] for g in r.figures["groups"] if g["name"] != "mla"}
    # 8,193 tokens in flight (sync): one token spills into a new block, so the peak is the reserve
    odd = vl(async_scheduling=False, max_num_batched_tokens=8_193)
    assert per_group(odd, "prefill_peak_blocks") == per_group(odd, "max_blocks_per_request") == \
        {"swa.0": 131, "swa.1": 131, "c4_state": 2_051, "c128_state": 1_041}
    # capped by max_model_len: a request prefilled from position 0 spans cdiv(8,192, block) blocks
    short = vl(max_model_len=8_192)
    assert per_group(short, "max_blocks_per_request") == {"swa.0": 129, "swa.1": 129, "c4_state": 2_049,
                                                          "c128_state": 1_025}
    assert per_group(short, "prefill_peak_blocks") == {"swa.0": 128, "swa.1": 128, "c4_state": 2_048,
                                                       "c128_state": 1_024}


def test_requests_held_at_128k_settled_and_while_filling():
    big, small = vl(), vl(memory=40 * GIB)
    # every request exactly 128K long and settled: 1 + (blocks - 1 - 512 - 6,682) // (512 + 26)
    assert (small.concurrency[131_072], big.concurrency[131_072]) == (67, 226)
    assert big.concurrency[131_072] == 1 + (128_560 - 512 - 6_682) // 538
    # what vLLM's scheduler held when fed 128K prompts: the same rule at the requests' real
    # lengths, earlier requests having decoded while later ones prefilled 8,192 tokens a step
    assert (small.figures["concurrency_filling"][131_072], big.figures["concurrency_filling"][131_072]) == (66, 223)


def test_fp4_indexer_is_refused_on_hopper_and_marked():
    r = vl(indexer="fp4")
    assert r.refused == "the fp4 indexer needs a Blackwell GPU; h200 is hopper"
    assert r.to_dict()["refused"] == r.refused
    assert (r.figures["bytes_per_block"], r.figures["num_blocks"]) == (917_568, 140_424)  # sized all the same
    assert vl(indexer="fp4", gpu="h100", memory=70 * 2**30).refused.endswith("h100 is hopper")   # fits an h100
    assert vl(indexer="fp4", gpu="b200").refused == ""
    assert vl().refused == "" and vl().to_dict()["refused"] is None


@pytest.mark.parametrize("gpu, entrypoint, batched, seqs", [
    ("h200", "serve", 8_192, 1_024), ("h200", "offline", 16_384, 1_024),
    ("h100", "serve", 8_192, 1_024), ("b200", "serve", 16_384, 1_024), ("b200", "offline", 16_384, 1_024),
])
def test_defaults_follow_entry_point_and_gpu(gpu, entrypoint, batched, seqs):
    assert vllm.batch_defaults(gpu, entrypoint) == (batched, seqs)
    r = vl(gpu=gpu, entrypoint=entrypoint, memory=min(BUDGET, 70 * 2**30))   # a budget the GPU holds
    assert r.figures["max_num_batched_tokens"] == batched and r.figures["default_max_num_seqs"] == seqs
    assert r.figures["max_num_seqs"] == 256  # the comparison's request limit, said beside its default
    assert r.assumes.startswith({"serve": "vllm serve", "offline": "the offline LLM class"}[entrypoint] + f" on {gpu}")
    assert f"max_num_batched_tokens {batched:,} (its default there)" in r.assumes


def test_offline_entry_point_moves_the_reserve():
    off = vl(entrypoint="offline")
    # two 16,384-token batches in flight: cdiv(127 + 32,768, 64) + 1 = 515 SWA blocks
    per_request = {g["name"]: g["max_blocks_per_request"] for g in off.figures["groups"]}
    assert per_request == {"swa.0": 515, "swa.1": 515, "mla": 4_096, "c4_state": 8_195, "c128_state": 4_113}
    given = vl(entrypoint="offline", max_num_batched_tokens=8_192)
    assert given.token_capacity == vl().token_capacity and "(given)" in given.assumes
    with pytest.raises(ConfigError) as err:
        vl(entrypoint="api")
    assert err.value.field == "entrypoint" and "serve" in err.value.fix


def test_releases_in_a_lineup():
    from kvatlas.engines import compare, parse_entry
    assert parse_entry("vllm") == ("vllm", {})
    assert parse_entry("vllm@0.33:sync") == ("vllm", {"async_scheduling": False, "release": "0.33"})
    with pytest.raises(ConfigError, match="use vllm@0.34 or vllm@0.33"):
        parse_entry("vllm@0.32")
    with pytest.raises(ConfigError, match="models one release"):
        parse_entry("sglang@0.5.23")
    new, old = compare("deepseek-v4-flash", 120 * GIB, lineup=["vllm", "vllm@0.33"])
    assert (new.engine, old.engine) == ("vllm 0.34", "vllm 0.33") and new.pool_tokens == old.pool_tokens


GRANULE = 2 << 20


def test_sizing_after_warm_up_on_a_gpu_budget():
    """0.34 on an H200, V4-Flash at tp 4: the extensible rule (utilization 1.0, 1 GiB margin floor, the
    activation peak kept free) and the fixed one (0.92), from the same device and weights."""
    total = 143771 * 2**20
    for peak in (0, 6 * GIB):
        r = run_engine("vllm", "deepseek-v4-flash", tp=4, weights_bytes="auto", activation_peak_bytes=peak)
        m, bpb = r.figures["sizing"], r.figures["bytes_per_block"]
        w = m["weights_bytes"]
        margin = max(GIB, int(0.75 * peak))
        e = m["extensible"]
        assert e["kv_bytes"] == total - w - margin - peak and e["margin_bytes"] == margin
        assert e["reserved_bytes"] == total - w - peak                       # what the profiler reports at 1.0
        n = e["num_blocks"]
        assert -(-n * bpb // GRANULE) * GRANULE <= e["kv_bytes"] < -(-(n + 1) * bpb // GRANULE) * GRANULE
        assert m["fixed"]["kv_bytes"] == -(-total * 92 // 100) - w - peak
        assert m["fixed"]["num_blocks"] == m["fixed"]["kv_bytes"] // bpb < n
        assert any("sizes its cache after warm-up" in note for note in r.notes)
    given = run_engine("vllm", "deepseek-v4-flash", 64 * GIB)             # --kv-cache-memory-bytes: fixed
    assert "sizing" not in given.figures and any("extensible cache is off" in n for n in given.notes)
    old = run_engine("vllm", "deepseek-v4-flash", tp=4, weights_bytes="auto", release="0.33")
    assert "sizing" not in old.figures and old.engine == "vllm 0.33"


def test_utilization_default_and_margin_rule():
    assert vllm.resolved_gpu_memory_utilization(None, True) == 1.0
    assert vllm.resolved_gpu_memory_utilization(None, False) == 0.92
    assert vllm.resolved_gpu_memory_utilization(0.8, True) == 0.8
    # the margin grows with the transient peak past 4/3 GiB; an explicit utilization caps the budget
    kw = {"init_free_bytes": 100 * GIB, "non_kv_bytes": 10 * GIB}
    assert vllm.extensible_kv_bytes(requested_bytes=100 * GIB, transient_peak_bytes=4 * GIB, **kw) == 100 * GIB - 10 * GIB - 3 * GIB - 4 * GIB
    assert vllm.extensible_kv_bytes(requested_bytes=80 * GIB, **kw) == 70 * GIB
    assert vllm.extensible_kv_bytes(requested_bytes=100 * GIB, torch_reserve_growth_bytes=2 * GIB, **kw) == 87 * GIB
    assert vllm.extensible_blocks(5 * GRANULE, GRANULE + 1, 100) == 4 and vllm.extensible_blocks(10 * GIB, 1, 7) == 7
