"""The host tier's buffer map (pure Python): sizes from the device plan, exact bytes, clear errors."""

import pytest

import kvatlas
from kvatlas.errors import BudgetError, ConfigError
from kvatlas.planning.buffers import FULL_PAGES
from kvatlas.planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES, plan_host

GIB = 2**30


def test_v4_flash_page_and_checkpoint_bytes():
    p = kvatlas.plan("deepseek-v4-flash", "32GiB")
    h = plan_host(p, "128GiB")
    # one full-token page of every compressed pool: C4 KV 21 × 37,440 + indexer 21 × 64 × 132
    # + C128 KV 20 × 1,728 (FlashMLA's 576-aligned 2-entry page)
    assert h.unit_bytes(HOST_PAGES) == 21 * 37_440 + 21 * 64 * 132 + 20 * 1_728 == 998_208
    assert h.unit_bytes(HOST_PAGES) == sum(b.unit_bytes for b in p.buffers if b.group == FULL_PAGES)
    # SPEC §8: two 64-token SWA pages of 43 layers, and 4 rows of C4 attention (8,192 B) and
    # indexer (2,048 B) state on 21 layers = 860,160 B
    assert h.unit_bytes(HOST_CHECKPOINTS) == 2 * 43 * 37_440 + 860_160 == 4_080_000
    assert h.total_bytes <= h.budget_bytes == 128 * GIB
    assert h.num_checkpoints == int(128 * GIB / 3) // 4_080_000
    assert h.total_bytes + h.unit_bytes(HOST_PAGES) > h.budget_bytes   # no whole page left unused
    assert {b.name: h.sources[b.name].buffer for b in h.buffers}["checkpoint.c4_state"] == "c4_state"


def test_share_zero_keeps_pages_only_and_share_is_checked():
    p = kvatlas.plan("deepseek-v4-flash", "32GiB")
    assert plan_host(p, "1GiB", checkpoint_share=0).num_checkpoints == 0
    for bad in (1, 1.5, -0.1, "half", True):
        with pytest.raises(ConfigError, match="checkpoint_share"):
            plan_host(p, "1GiB", checkpoint_share=bad)


def test_budget_errors_name_the_field():
    p = kvatlas.plan("deepseek-v4-flash", "32GiB")
    with pytest.raises(BudgetError, match="host_memory_bytes"):
        plan_host(p, "3MiB")
    with pytest.raises(ConfigError, match="host_memory_bytes"):
        plan_host(p, "many")


@pytest.mark.parametrize("model,opts", [
    ("deepseek-v4-pro", {}), ("deepseek-v4.1-flash", {}), ("deepseek-v4-flash", {"kv_layout": "unified-fp8"}),
    ("deepseek-v4-flash", {"draft_tokens": 3}), ("deepseek-v4-flash", {"online_c128": True, "state_dtype": "fp32"}),
])
def test_every_layout_plans(model, opts):
    p = kvatlas.plan(model, "32GiB", **opts)
    h = plan_host(p, "8GiB")
    assert h.num_pages > 0 and h.num_checkpoints > 0 and h.total_bytes <= 8 * GIB
    d = h.to_dict()
    assert d["page_bytes"] * d["pages"] + d["checkpoint_bytes"] * d["checkpoints"] <= d["total_bytes"]
