"""Per-request latency and the binding-limit verdict, on traces small enough to work out by hand.

Time model of the hand-worked runs: every pass 10 ms + 0.1 ms per prompt token computed, decode
free, no drafts, so each figure below is a sum of pass lengths."""

from __future__ import annotations

import csv

import numpy as np
import pytest

import kvatlas
from kvatlas.cli import main
from kvatlas.driving.latency import percentiles
from kvatlas.driving.limits import verdict
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import TimeModel
from kvatlas.driving.workload import Request
from kvatlas.planning.buffers import CHECKPOINTS, SWA_PAGES
from kvatlas.planning.capacity import resume_points

TM = TimeModel(pass_s=0.010, prefill_s_per_token=1e-4, decode_s_per_token=0.0)


def run(reqs, **plan_over):
    opts = {"max_running_requests": 2, "max_model_len": 2048, "chunked_prefill_tokens": 512, **plan_over}
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **opts), backend="none")
    sim = Simulator(cache, reqs, time_model=TM, record=False)
    sim.run_offline()
    return cache, sim, {t.id: t for t in sim.latency.timings()}


def test_latency_by_hand_slots_queue_and_one_token_outputs():
    # t=0     A (300) and B (100) admitted, both prefilled: 10 + 40 ms -> first tokens at 0.05;
    #         B's one token is its last
    # t=0.05  C (arrived 0.005) waits: both slots taken; decode A, B: 10 ms; B finishes
    # t=0.06  C admitted (queued 55 ms); A's 3rd token; C prefilled: 10 + 20 ms -> 0.09
    # t=0.09  A written out, C's 2nd (last) token -> 0.10
    reqs = [Request(id="A", arrival_s=0.0, prompt_tokens=300, output_tokens=3),
            Request(id="B", arrival_s=0.0, prompt_tokens=100, output_tokens=1),
            Request(id="C", arrival_s=0.005, prompt_tokens=200, output_tokens=2)]
    cache, sim, t = run(reqs)
    want = {"A": (0.0, 0.0, 0.05, 0.09), "B": (0.0, 0.0, 0.05, 0.05), "C": (0.005, 0.06, 0.09, 0.10)}
    for rid, (arr, adm, first, last) in want.items():
        got = t[rid]
        assert got.status == "finished" and got.cached_tokens == 0
        assert (got.arrival_s, got.admitted_s, got.first_token_s, got.last_token_s) == pytest.approx((arr, adm, first, last))
    assert t["A"].tpot_s == pytest.approx(0.02) and t["C"].tpot_s == pytest.approx(0.01) and t["B"].tpot_s is None
    assert t["C"].queue_s == pytest.approx(0.055) and t["C"].ttft_s == pytest.approx(0.085)
    s = sim.latency.summary()["all"]
    # numpy's linear percentiles of (0.05, 0.05, 0.085): p90 = 0.05 + 0.8 * 0.035
    assert s["ttft_s"] == pytest.approx({"count": 3, "mean": 0.185 / 3, "p50": 0.05, "p90": 0.078, "p99": 0.0843})
    assert s["tpot_s"]["count"] == 2 and s["tpot_s"]["p50"] == pytest.approx(0.015)
    assert s["queue_s"]["p50"] == 0.0 and s["queue_s"]["mean"] == pytest.approx(0.055 / 3)
    # the verdict: one of five passes waited, for a slot
    lim = sim.limits
    assert (lim.passes, lim.slot_waits, lim.memory_waits) == (5, 1, 0)
    v = verdict(lim, cache.plan)
    assert v.limit == "slots" and v.flag == "--max-running-requests" and "1 of 5 passes waited for a slot" in v.text


def test_latency_by_hand_with_a_prefix_hit():
    # A (300 tokens of block 0, 2 out): prefilled by 0.04, tokens at 0.04 and 0.05, written out by 0.06.
    # D, the same prompt at t=1: 256 tokens hit, 44 computed: first token at 1 + 0.0144, last 0.01 later
    reqs = [Request(id="A", arrival_s=0.0, prompt_tokens=300, output_tokens=2, blocks=(0,)),
            Request(id="D", arrival_s=1.0, prompt_tokens=300, output_tokens=2, blocks=(0,))]
    cache, sim, t = run(reqs, prefix_checkpoints=8)
    assert (t["A"].cached_tokens, t["D"].cached_tokens) == (0, 256)
    assert (t["A"].ttft_s, t["A"].e2e_s) == pytest.approx((0.04, 0.05))
    assert (t["D"].queue_s, t["D"].ttft_s, t["D"].tpot_s) == pytest.approx((0.0, 0.0144, 0.01))
    s = sim.latency.summary()
    assert s["hit"]["ttft_s"]["count"] == 1 and s["hit"]["ttft_s"]["p50"] == pytest.approx(0.0144)
    assert s["miss"]["ttft_s"]["count"] == 1 and s["miss"]["ttft_s"]["p99"] == pytest.approx(0.04)
    assert verdict(sim.limits, cache.plan).limit == "none"   # nobody waited; 3 of 5 passes are tiny


def test_session_turn_arrives_when_released_and_drafts_count_as_emitted():
    # b follows a by 1 s of thinking: released at the start of a's last pass (a's sequence is
    # written out then), so its arrival is that time + 1; with 3 drafts all accepted a pass emits 4
    reqs = [Request(id="a", arrival_s=0.0, prompt_tokens=100, output_tokens=9),
            Request(id="b", arrival_s=0.0, prompt_tokens=100, output_tokens=1, after="a", think_s=1.0)]
    opts = dict(max_running_requests=2, max_model_len=2048, chunked_prefill_tokens=512, draft_tokens=3)
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **opts), backend="none")
    sim = Simulator(cache, reqs, time_model=TM, record=False, accept_rate=1.0)
    sim.run_offline()
    t = {x.id: x for x in sim.latency.timings()}
    # a: prefill 0..0.02 (token 1); passes of 10 ms emit 4 each: tokens 5 at 0.03, 9 at 0.04; written out
    # by 0.05 after one more pass (9 rows written: 4 + 4 + 1); b released at 0.04 + 1.0
    assert (t["a"].first_token_s, t["a"].last_token_s) == pytest.approx((0.02, 0.04))
    assert t["a"].tpot_s == pytest.approx(0.02 / 8)
    assert t["b"].arrival_s == pytest.approx(1.04) and t["b"].queue_s == 0.0


def test_percentiles_skip_missing_and_empty():
    assert percentiles([None, 2.0, 1.0, 4.0, 3.0]) == {"count": 4, "mean": 2.5, "p50": 2.5, "p90": 3.7,
                                                        "p99": pytest.approx(3.97)}
    assert percentiles([None]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_memory_bound_verdict_and_the_named_flag_moves_it():
    # 24 MiB buys 54 full pages beside 8 slots; a request of 2,000 + 40 tokens reserves 8: six run at once
    reqs = [Request(id=f"r{i}", arrival_s=0.0, prompt_tokens=2000, output_tokens=40) for i in range(12)]
    small = dict(max_running_requests=8, max_model_len=2048, chunked_prefill_tokens=512)
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "24MiB", **small), backend="none")
    sim = Simulator(cache, reqs, time_model=TM, record=False)
    sim.run_offline()
    v = verdict(sim.limits, cache.plan)
    assert v.limit == "memory" and v.flag == "--memory" and sim.limits.slot_waits == 0
    assert "lower --max-running-requests" in v.text   # most of the 8 slots never ran
    cache2 = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **small), backend="none")
    sim2 = Simulator(cache2, reqs, time_model=TM, record=False)
    sim2.run_offline()
    assert sim2.limits.memory_waits == 0 and sim2.limits.memory_waits < sim.limits.memory_waits


def test_slot_bound_verdict_and_raising_slots_removes_the_waits():
    reqs = [Request(id=f"r{i}", arrival_s=0.0, prompt_tokens=64, output_tokens=20) for i in range(12)]
    _, sim, t = run(reqs)
    assert verdict(sim.limits, sim.cache.plan).limit == "slots" and sim.limits.slot_waits > 0
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", max_running_requests=12, max_model_len=2048,
                                          chunked_prefill_tokens=2048), backend="none")
    sim3 = Simulator(cache, reqs, time_model=TM, record=False)
    sim3.run_offline()
    assert sim3.limits.slot_waits == 0
    assert max(x.queue_s for x in sim3.latency.timings()) == 0.0 < max(x.queue_s for x in t.values())


def test_chunk_bound_verdict():
    # one long prompt, nothing waiting: every prefill pass fills the 256-token budget
    reqs = [Request(id="long", arrival_s=0.0, prompt_tokens=1800, output_tokens=2)]
    cache, sim, _ = run(reqs, chunked_prefill_tokens=256)
    assert (sim.limits.chunk_full, sim.limits.passes) == (7, 10)   # 7 full of 256, then 8 tokens, 2 decodes
    v = verdict(sim.limits, cache.plan)
    assert v.limit == "chunk" and v.flag == "--chunked-prefill-tokens"


def test_resume_points_cost_the_capacity_a_plan_without_them_holds():
    """The plan's resume-point figures (what the run report prints) against a second plan made
    without them: the tokens given up are measured, not estimated."""
    p = kvatlas.plan("deepseek-v4-flash", "8GiB", max_running_requests=64, max_model_len=65536, prefix_checkpoints=200)
    bare = kvatlas.plan("deepseek-v4-flash", "8GiB", max_running_requests=64, max_model_len=65536)
    c = resume_points(p)
    assert c.count == 200 + 64 + 8192 // 256 + 1 and c.kept == 200
    unit = sum(b.unit_bytes for b in p.buffers if b.group == CHECKPOINTS)
    swa_page = sum(b.unit_bytes for b in p.buffers if b.group == SWA_PAGES)
    assert c.bytes_each == unit + 2 * swa_page                    # 127 tokens of window: 2 SWA pages of 64
    assert c.tokens_without == bare.max_total_tokens and c.token_capacity_cost == bare.max_total_tokens - p.max_total_tokens > 0
    # the pages lost are what the resume points' bytes (plus alignment) would have bought
    assert abs(c.token_capacity_cost / p.page_tokens - c.total_bytes / (p.bytes_per_token * p.page_tokens)) < 2
    assert resume_points(bare) is None


def test_simulate_writes_the_requests_csv_and_prints_the_figures(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "4", "--max-model-len",
                 "2048", "--rate", "40", "--duration", "0.4", "--prompt-len", "uniform:16:400", "--output-len",
                 "uniform:1:30", "--backend", "none", "--out", str(out), "--no-plot"]) == 0
    text = capsys.readouterr().out
    rows = list(csv.DictReader(open(f"{out}.requests.csv")))
    assert rows and all(r["status"] == "finished" for r in rows)
    ttft = np.array([float(r["ttft_s"]) for r in rows])
    p = np.percentile(ttft, [50, 90, 99])
    line = next(x for x in text.splitlines() if x.startswith("TTFT "))
    assert f"p50 {p[0] * 1e3:.1f} ms" in line and f"p99 {p[2] * 1e3:.1f} ms" in line and f"({len(rows)} requests)" in line
    for r in rows:   # the columns agree with each other
        assert float(r["ttft_s"]) == pytest.approx(float(r["first_token_s"]) - float(r["arrival_s"]), abs=2e-6)
        assert r["tpot_s"] == "" if r["output_tokens"] == "1" else float(r["tpot_s"]) >= 0
    assert "binding limit" in text and "resume points" not in text


def test_the_verdict_reads_the_modelled_gpus_busy_time_first():
    """Long prompts arriving together under the default time model: the passes run back to back
    and the fixed per-pass cost is a few percent of them, so no slot, memory or chunk flag finishes
    the run sooner, whatever waits there were (issue 38: it said raise --max-running-requests)."""
    from kvatlas.driving.timemodel import TimeModel
    reqs = [Request(id=f"r{i}", arrival_s=0.001 * i, prompt_tokens=1800, output_tokens=2) for i in range(40)]
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", max_running_requests=6, max_model_len=2048,
                                          chunked_prefill_tokens=8192), backend="none")
    sim = Simulator(cache, reqs, time_model=TimeModel(pass_s=0.02, prefill_s_per_token=40e-6, decode_s_per_token=100e-6),
                    record=False)
    sim.run_offline()
    lim = sim.limits
    assert lim.slot_waits > 0 and lim.busy_s == pytest.approx(lim.span_s)
    assert lim.fixed_s == pytest.approx(0.02 * lim.passes) and lim.fixed_s < 0.2 * lim.busy_s
    v = verdict(lim, cache.plan)
    assert v.limit == "compute" and v.flag is None and "raise" not in v.text and "100% busy" in v.text
    with pytest.raises(kvatlas.KvatlasError, match="log"):
        verdict(None, cache.plan)
    with pytest.raises(kvatlas.KvatlasError, match="plan"):
        verdict(lim, "tiny-v4")
