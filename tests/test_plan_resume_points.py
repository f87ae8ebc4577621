"""The plan shows the prefix cache's resume points on a line of their own: how many, bytes each,
in all, and the token capacity they cost; they are no longer part of "shared"."""

import json

import pytest

import kvatlas
from kvatlas.cli import main
from kvatlas.planning.buffers import CHECKPOINTS, SWA_PAGES
from kvatlas.planning.capacity import capacity, plan_to_dict


def test_v4_flash_at_120_gib_with_20000_resume_points():
    p = kvatlas.plan("deepseek-v4-flash", "120GiB", prefix_checkpoints=20000)
    rp = capacity(p).resume_points
    # one point: 2 SWA pages of 64 tokens on 43 layers (37,440 B each) + 4 rows of C4 attention
    # (2,048 fp32) and indexer (512 fp32) state on the 21 C4 layers
    assert rp.bytes_each == 2 * 43 * 37_440 + 21 * 4 * (2_048 + 512) * 4 == 4_080_000
    assert rp.count == 20_000 + 256 + 8192 // 256 + 1 == 20_289 and rp.kept == 20_000
    assert rp.total_bytes == p.checkpoint_bytes == rp.count * rp.bytes_each == 82_779_120_000
    bare = kvatlas.plan("deepseek-v4-flash", "120GiB")
    assert rp.tokens_without == bare.max_total_tokens == 31_767_552
    assert rp.token_capacity_cost == bare.max_total_tokens - p.max_total_tokens == 21_229_824
    assert capacity(bare).resume_points is None and bare.checkpoint_bytes == 0


@pytest.mark.parametrize("model,kw", [("tiny-v4", {}), ("tiny-v4", {"draft_tokens": 2}),
                                      ("tiny-v4.1", {}), ("deepseek-v4-pro", {"memory_bytes": "40GiB"})])
def test_every_byte_is_in_one_part(model, kw):
    opts = {"memory_bytes": "128MiB", "max_running_requests": 4, "prefix_checkpoints": 8, **kw}
    p = kvatlas.plan(model, opts.pop("memory_bytes"), **opts)
    each = sum(b.unit_bytes for b in p.buffers if b.group == CHECKPOINTS) + \
        p.sizing.checkpoint_swa_pages * sum(b.unit_bytes for b in p.buffers if b.group == SWA_PAGES)
    assert capacity(p).resume_points.bytes_each == each
    parts = (p.bytes_per_request * p.max_running_requests + (p.num_full_pages - 1) * p.bytes_per_token * p.page_tokens
             + p.checkpoint_bytes + p.shared_bytes)
    assert parts == p.total_bytes


def test_the_table_and_the_json_show_them(capsys):
    assert main(["plan", "--memory", "120GiB", "--prefix-checkpoints", "20000"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("resume points"))
    assert "20,289 (20,000 to keep" in line and "× 4,080,000 B = 82,779,120,000 B" in line
    assert "cost 21,229,824 tokens of capacity (31,767,552 without them)" in line
    assert main(["plan", "--memory", "120GiB", "--prefix-checkpoints", "20000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["capacity"]
    assert doc["resume_points"] == {"kept": 20_000, "count": 20_289, "bytes_each": 4_080_000,
                                    "total_bytes": 82_779_120_000, "max_total_tokens_without": 31_767_552,
                                    "token_capacity_cost": 21_229_824}
    assert main(["plan", "--memory", "120GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity"]["resume_points"] is None
