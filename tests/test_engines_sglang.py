"""SGLang 0.5.23's DeepSeek-V4 sizing, pinned to figures derivable from SPEC §2/§6 and its public behaviour."""

import pytest

from kvatlas import formats
from kvatlas.engines import run_engine
from kvatlas.errors import BudgetError, ConfigError

GIB = 2**30
BUDGET = 120 * GIB


def sg(model="deepseek-v4-flash", memory=BUDGET, **kw):
    return run_engine("sglang", model, memory, **kw)


def test_cap_price_is_page_padded_row_price():
    r = sg(swa_mode="cap")
    kv, idx = formats.FP8_DS_MLA, formats.indexer_format("fp8")
    # 21 C4 layers: a 64-entry page per 4 tokens plus an indexer row; 20 C128 layers: a 2-entry page per 256 tokens
    derived = 21 * (kv.page_bytes(64) / 64 + idx.entry_bytes) / 4 + 20 * kv.page_bytes(2) / 256
    assert r.figures["coeff"] == derived == 3899.25
    assert sg("deepseek-v4-pro", swa_mode="cap").figures["coeff"] == 5586.75


def test_default_is_ratio_mode_because_the_override_sets_the_ratio():
    r = sg()
    assert r.figures["mode"] == "ratio" and r.figures["swa_ratio"] == 0.1
    assert "default" in r.variant
    # an SWA slot: 585 B page-padded on 43 layers + 8 C4 state rows per 256 slots (10,240 B fp32 each)
    assert r.figures["bytes_per_swa_token"] == 585 * 43 + 8 / 256 * 10240 * 21 == 31875
    assert r.figures["coeff"] == 3899.25 + 0.1 * 31875 == 7086.75
    assert sg("deepseek-v4-pro").figures["coeff"] == 10115.25
    assert sg(swa_mode="ratio").figures["coeff"] == 7086.75


def test_worked_sizes_at_120_gib():
    ratio, cap = sg(), sg(swa_mode="cap")
    assert (ratio.figures["full_tokens"], ratio.figures["swa_tokens"]) == (17_798_400, 1_779_712)
    assert (cap.figures["full_tokens"], cap.figures["swa_tokens"]) == (27_390_208, 606_464)
    # c128 state is fixed: ceil128(257 slots × 128 + 129) rows × 4,096 B × 20 layers
    assert ratio.figures["c128_state_fixed_bytes"] == 33_152 * 4096 * 20 == 2_715_811_840
    pro = sg("deepseek-v4-pro")
    assert (pro.figures["full_tokens"], pro.figures["swa_tokens"]) == (12_321_792, 1_232_128)
    assert sg("deepseek-v4-pro", swa_mode="cap").figures["full_tokens"] == 17_393_920


def test_cap_tokens():
    # (window 128 + eviction 128 + page 256 + decode page 256) × 256 requests + 2 chunks + a page,
    # plus 4 prefix tails per request of window + page each
    assert sg(swa_mode="cap").figures["swa_cap_tokens"] == 768 * 256 + 2 * 8192 + 256 + 1024 * 384 == 606_464
    assert sg(swa_mode="cap", radix_cache=False).figures["swa_cap_tokens"] == 213_248
    assert sg(swa_mode="cap", draft_tokens=4).figures["swa_cap_tokens"] == 641_280


def test_tensors_exceed_the_budget_they_were_sized_from():
    assert sg().allocated_bytes == 128_861_841_472 and sg().over_budget_bytes == 12_822_592
    assert sg(swa_mode="cap").over_budget_bytes == 16_399_936
    assert sg("deepseek-v4-pro").over_budget_bytes == 21_362_432
    assert sg("deepseek-v4-pro", swa_mode="cap").over_budget_bytes == 24_879_296


def test_unreachable_rows():
    r = sg()
    units = {b.name: b.unreachable_units for b in r.buffers}
    # compressed pools carry 256 reserve slots that full_loc // ratio never reaches
    assert units["c4_kv"] == units["c4_indexer"] == 3 and units["c128_kv"] == 127
    # state rows past the last ring, before the sentinel
    assert units["c4_state"] == units["c4_indexer_state"] == 3 and units["c128_state"] == 255
    assert units["swa_kv"] == 0
    assert r.unreachable_bytes == (21 * 3 * (37_440 + 8_448) + 20 * 127 * 1_728
                                   + 21 * 3 * (8_192 + 2_048) + 20 * 255 * 4_096)
    for b in r.buffers:
        assert 0 <= b.reachable_bytes <= b.bytes and b.padding_bytes >= 0


def test_what_it_reports():
    r = sg()
    assert r.reported.memory_gauge_bytes == 0
    assert r.reported.capacity_tokens == r.pool_tokens == 17_798_400
    outside = {b.name: b.bytes for b in r.buffers if not b.in_budget}
    assert outside["req_to_token"] == 257 * (1_048_576 + 4) * 4 == 1_077_940_240
    assert outside["full_to_swa_index"] == (17_798_400 + 257) * 8


def test_variants():
    fp4 = sg(swa_mode="cap", indexer="fp4")
    # priced at the fp8 row on CUDA, allocated at the fp4 row: the budget is left partly unspent
    assert fp4.figures["coeff"] == 3899.25 and fp4.over_budget_bytes == -9_187_054_016
    assert sg(swa_mode="cap", indexer="fp4", platform="hip").figures["coeff"] == 3899.25 - 21 * (132 - 68) / 4
    bf16 = sg(swa_mode="cap", state_dtype="bf16")
    assert bf16.figures["full_tokens"] == 28_261_120 and bf16.over_budget_bytes == 15_388_352
    spec = sg(swa_mode="cap", draft_tokens=4)
    assert spec.figures["coeff"] == pytest.approx(3899.25 * 44 / 43)
    assert spec.figures["full_tokens"] == 24_587_264
    assert "draft_swa_kv" in {b.name for b in spec.buffers}
    assert sg(draft_tokens=4).figures["full_tokens"] == 15_546_624


def test_concurrency():
    r = sg()
    assert r.concurrency[8192] == 256
    assert r.concurrency[1_048_576] == 17_798_400 // 1_048_576 == 16


@pytest.mark.parametrize("kw, field", [
    (dict(draft_tokens=11), "draft_tokens"),
    (dict(swa_mode="fixed"), "swa_mode"),
    (dict(swa_mode="cap", swa_ratio=0.2), "swa_ratio"),
    (dict(swa_ratio=2.0), "swa_ratio"),
    (dict(indexer="bf16"), "indexer"),
    (dict(online_c128=True), "online_c128"),
    (dict(page_tokens=128), "page_tokens"),
    (dict(async_scheduling=False), "async_scheduling"),
])
def test_bad_options(kw, field):
    with pytest.raises(ConfigError) as err:
        sg(**kw)
    assert err.value.field == field and err.value.fix


def test_v41_is_not_modelled():
    with pytest.raises(ConfigError, match="model"):
        sg("deepseek-v4.1-flash")


def test_tiny_budget():
    with pytest.raises(BudgetError, match="sglang"):
        sg(memory=2 * GIB)


@pytest.mark.parametrize("model, mode, full_tokens, swa_tokens, extra, truth_before", [
    ("deepseek-v4-pro", "auto", 12_321_792, 1_232_128, 425_616, 130_046_897_944),
    ("deepseek-v4-pro", "cap", 17_393_920, 606_464, 564_568, 130_090_991_832),
    ("deepseek-v4-flash", "auto", 17_798_400, 1_779_712, 613_872, 130_082_170_968),
    ("deepseek-v4-flash", "cap", 27_390_208, 606_464, 876_952, 130_162_482_776),
])
def test_truth_counts_free_lists_and_request_counter(model, mode, full_tokens, swa_tokens, extra, truth_before):
    r = sg(model, swa_mode=mode)
    outside = {b.name: b for b in r.buffers if not b.in_budget}
    # each paged allocator lists every page id but page 0; the request table counts reuses per slot
    assert outside["free_full_pages"].bytes == full_tokens // 256 * 8
    assert outside["free_swa_pages"].bytes == swa_tokens // 256 * 8
    assert outside["req_generation"].bytes == 257 * 8
    added = sum(outside[n].bytes for n in ("free_full_pages", "free_swa_pages", "req_generation"))
    assert added == extra  # 425,616–876,952 B at 120 GiB
    assert r.outside_bytes == added + outside["req_to_token"].bytes + outside["full_to_swa_index"].bytes
    # "truth (all tensors)": what the column showed before, plus these lists and the counter
    assert r.allocated_bytes + r.outside_bytes == truth_before + extra
