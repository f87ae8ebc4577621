import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvatlas
from kvatlas.planning.model import model_from_config
from kvatlas import BudgetError, ConfigError
from kvatlas.planning.buffers import BUFFER_ALIGN, SLAB_ALIGN
from kvatlas.planning.planner import chunk_extra_swa_pages, swa_pages_per_step

GiB = 2**30


@pytest.mark.parametrize("model,indexer,row_price", [
    ("deepseek-v4-flash", "fp8", 3850.25),
    ("deepseek-v4-flash", "fp4", 3514.25),
    ("deepseek-v4-pro", "fp8", 5511.4375),
    ("deepseek-v4-pro", "fp4", 5031.4375),
    ("deepseek-v4.1-flash", "fp4", 890.0),
])
def test_spec_per_token_figures(model, indexer, row_price):
    p = kvatlas.plan(model, "120GiB", indexer=indexer)
    assert p.row_bytes_per_token == row_price


def test_pro_all_bf16_per_token():
    p = kvatlas.plan("deepseek-v4-pro", "120GiB", kv_layout="bf16", indexer="bf16")
    assert p.row_bytes_per_token == 9848
    assert p.bytes_per_token == 9848  # bf16 pages have no rounding
    assert 2**20 * p.row_bytes_per_token / GiB == pytest.approx(9.62, abs=0.005)


def test_flash_padded_price():
    # C4: 37,440 KV + 64 × 132 indexer per 256 tokens; C128: 1,728 per 256 tokens
    p = kvatlas.plan("deepseek-v4-flash", "120GiB")
    assert p.bytes_per_token == (21 * (37_440 + 64 * 132) + 20 * 1_728) / 256 == 3899.25


def test_flash_intercept_is_exact():
    p = kvatlas.plan("deepseek-v4-flash", "120GiB")
    swa = 3 * 43 * 37_440                      # 3 SWA pages of 64 tokens cover 127 + 1 tokens
    state = 21 * 8 * (8192 + 2048) + 20 * 128 * 4096
    table = 4 * (4096 + 256)                   # full block table + SWA page ring (131 → 256)
    assert p.bytes_per_request == swa + state + table


def test_buffer_map_sums_to_plan_and_fits_budget():
    for name in kvatlas.preset_names():
        if name == "tiny-v4":
            continue
        p = kvatlas.plan(name, "120GiB")
        assert sum(b.bytes for b in p.buffers) == p.total_bytes <= p.budget_bytes
        assert all(b.offset_bytes % BUFFER_ALIGN == 0 and b.bytes % BUFFER_ALIGN == 0 for b in p.buffers)
        assert p.total_bytes % SLAB_ALIGN == 0
        ends = [b.offset_bytes + b.bytes for b in p.buffers]
        assert [b.offset_bytes for b in p.buffers[1:]] == ends[:-1]
        for b in p.buffers:
            assert b.addressable_bytes + b.null_bytes + b.padding_bytes == b.bytes
            assert b.padding_bytes >= 0


def test_plan_fills_budget_to_within_one_page():
    p = kvatlas.plan("deepseek-v4-flash", "120GiB")
    assert 0 <= p.unused_bytes < 256 * p.bytes_per_token + SLAB_ALIGN


def test_no_unreachable_pages():
    # 2 requests of at most 8K tokens can address 64 full pages; a huge budget buys no more
    p = kvatlas.plan("deepseek-v4-flash", "120GiB", max_running_requests=2, max_model_len=8192)
    assert p.num_full_pages == 2 * 32 + 1
    assert p.unused_bytes > 100 * GiB


def test_refuses_budget_below_one_request():
    with pytest.raises(BudgetError, match="max_model_len"):
        kvatlas.plan("deepseek-v4-flash", "2GiB", max_running_requests=1)
    with pytest.raises(BudgetError, match="max_running_requests"):
        kvatlas.plan("deepseek-v4-flash", "1GiB")


def test_inverse_round_trip():
    inv = kvatlas.budget_for("deepseek-v4-flash", 8, 131072)
    p = kvatlas.plan("deepseek-v4-flash", inv.total_bytes, max_running_requests=8, max_model_len=131072)
    assert p.total_bytes == inv.total_bytes
    assert p.concurrency_in_plan(131072) == 8
    short = kvatlas.plan("deepseek-v4-flash", inv.total_bytes - 1, max_running_requests=8, max_model_len=131072)
    assert short.concurrency_in_plan(131072) == 7  # one byte less: one request's pages no longer fit


def test_deterministic():
    a = kvatlas.plan("deepseek-v4-pro", "100GiB", draft_tokens=3)
    b = kvatlas.plan("deepseek-v4-pro", "100GiB", draft_tokens=3)
    assert a.buffers == b.buffers


def test_swa_paging_bounds():
    assert swa_pages_per_step(128, 1, 64) == 3
    assert swa_pages_per_step(128, 1, 256) == 2
    assert swa_pages_per_step(128, 2, 64) == 3 and swa_pages_per_step(128, 3, 64) == 4
    # spreading a chunk in 3-token pieces over 256 requests costs one page each, the rest by the page
    assert chunk_extra_swa_pages(128, 1, 64, 8192, 256) == 256 + (8192 - 256 * 3) // 64
    assert chunk_extra_swa_pages(128, 1, 64, 8192, 1) == 1 + (8192 - 3) // 64


def test_options_change_the_right_buffers():
    base = kvatlas.plan("deepseek-v4-flash", "120GiB")
    spec = kvatlas.plan("deepseek-v4-flash", "120GiB", draft_tokens=3)
    assert spec.buffer("c4_state").shape[2] == 16 and spec.buffer("c128_state").shape[2] == 256
    assert len(spec.buffer("swa_kv").layers) == 44  # the MTP layer is cached with drafts
    online = kvatlas.plan("deepseek-v4-flash", "120GiB", online_c128=True)
    assert online.buffer("c128_online_state").shape[1:] == (20, 1, 1536)
    bf16 = kvatlas.plan("deepseek-v4-flash", "120GiB", state_dtype="bf16")
    assert bf16.buffer("c4_state").dtype == "bfloat16"
    assert bf16.bytes_per_request < base.bytes_per_request
    uf = kvatlas.plan("deepseek-v4-flash", "120GiB", kv_layout="unified-fp8")
    assert uf.buffer("c4_kv.rope").shape[2] == 64 * 128
    v41 = kvatlas.plan("deepseek-v4.1-flash", "120GiB")
    assert v41.buffer("swa_window").shape[1:] == (40, 128 * 528)
    assert v41.buffer("swa_workspace").shape == (1, 8192 * 528)


def test_parallelism():
    one = kvatlas.plan("deepseek-v4-pro", "100GiB")
    tp = kvatlas.plan("deepseek-v4-pro", "100GiB", tp=8)
    assert tp.total_bytes == one.total_bytes  # TP replicates the latent KV
    pp0 = kvatlas.plan("deepseek-v4-pro", "100GiB", pp=2, pp_rank=0)
    pp1 = kvatlas.plan("deepseek-v4-pro", "100GiB", pp=2, pp_rank=1)
    assert len(pp0.layers) + len(pp1.layers) == 61
    dp = kvatlas.plan("deepseek-v4-pro", "100GiB", dp=4)
    assert dp.max_running_requests == 64


@pytest.mark.parametrize("kwargs,field", [
    ({"kv_layout": "fp16"}, "kv_layout"),
    ({"kv_layout": "v4.1"}, "kv_layout"),
    ({"indexer": "int4"}, "indexer"),
    ({"state_dtype": "fp16"}, "state_dtype"),
    ({"online_c128": True, "state_dtype": "bf16"}, "online_c128"),
    ({"max_running_requests": 0}, "max_running_requests"),
    ({"draft_tokens": -1}, "draft_tokens"),
    ({"page_tokens": 100}, "page_tokens"),
    ({"pp": 2, "pp_rank": 2}, "pp_rank"),
    ({"memory_bytes": "lots"}, "memory"),
    ({"memory_bytes": "-5GiB"}, "memory"),
    ({"warp_speed": 9}, "warp_speed"),
])
def test_bad_options_name_the_field(kwargs, field):
    kwargs.setdefault("memory_bytes", "120GiB")
    with pytest.raises(ConfigError) as err:
        kvatlas.plan("deepseek-v4-flash", **kwargs)
    assert field in str(err.value)


layouts = st.sampled_from(["v4", "bf16", "uniform-fp8", "unified-bf16", "unified-fp8"])


@settings(max_examples=60, deadline=None)
@given(
    ratios=st.lists(st.sampled_from([0, 4, 128]), min_size=1, max_size=12),
    layout=layouts, indexer=st.sampled_from(["fp8", "fp4", "bf16"]),
    state=st.sampled_from(["fp32", "bf16"]), draft=st.integers(0, 4),
    requests=st.integers(1, 64), chunk=st.integers(1, 20000), max_len=st.integers(1, 300_000),
    budget=st.integers(2**20, 64 * 2**30),
)
def test_property_map_sums_and_never_exceeds(ratios, layout, indexer, state, draft, requests, chunk, max_len, budget):
    cfg = {"num_hidden_layers": len(ratios), "compress_ratios": ratios + [0], "hidden_size": 64,
           "num_attention_heads": 4, "head_dim": 512, "qk_rope_head_dim": 64, "sliding_window": 128,
           "max_position_embeddings": 1 << 20, "num_nextn_predict_layers": 1}
    model = model_from_config(cfg)
    try:
        p = kvatlas.plan(model, budget, kv_layout=layout, indexer=indexer, state_dtype=state,
                         draft_tokens=draft, max_running_requests=requests, chunked_prefill_tokens=chunk,
                         max_model_len=max_len)
    except BudgetError:
        inv = kvatlas.budget_for(model, 1, max_len, kv_layout=layout, indexer=indexer, state_dtype=state,
                                 draft_tokens=draft, chunked_prefill_tokens=chunk)
        assert requests > 1 or inv.total_bytes > budget
        return
    assert sum(b.bytes for b in p.buffers) == p.total_bytes <= budget
    assert p.concurrency_in_plan(max_len) >= 1
    per_req = -(-max_len // 256)
    if p.has_compressed:
        assert p.num_full_pages - 1 <= requests * per_req  # nothing unreachable
