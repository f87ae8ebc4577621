"""The simulator drives a real cache: memory rises and falls with the workload and returns to 0,
the chunk budget bounds every forward pass, drafts roll back, and the data path really stores."""

from __future__ import annotations

import csv

import pytest
import torch

import kvatlas
from kvatlas.cli import main
from kvatlas.datapath import PageGeometry, gather
from kvatlas.driving.sim import Simulator
from kvatlas.driving.simwrite import KVWriter
from kvatlas.driving.workload import Request, synthetic

TINY = dict(max_running_requests=8, max_model_len=2048, chunked_prefill_tokens=512)


def tiny_cache(memory="96MiB", **over):
    return kvatlas.allocate(kvatlas.plan("tiny-v4", memory, **{**TINY, **over}))


def small_workload(seed=0, n_s=0.5):
    return synthetic(rate_per_s=30, duration_s=n_s, prompt="uniform:16:900", output="uniform:2:60", seed=seed)


def test_occupied_rises_falls_and_returns_to_zero():
    cache = tiny_cache()
    reqs = small_workload()
    sim = Simulator(cache, reqs)
    t = 0.0
    while not sim.done:
        sim.step(t)
        cache.check_integrity()          # every pass leaves the ledger and allocator consistent
        t += 0.02
    occ = [p.snapshot.occupied_bytes for p in sim.timeline]
    assert max(occ) > 0 and occ[-1] == 0
    assert any(b < a for a, b in zip(occ, occ[1:])), "occupied never fell"
    assert sim.stats.finished == len(reqs) and cache.ledger.snapshot().running_requests == 0


def _count_tokens_per_pass(cache, sim):
    per_pass, cur = [], [0]
    real_step, real_extend, real_sim_step = cache.step, cache.extend, sim.step

    def step(rids, each):
        cur[0] += int(sum(each)) if hasattr(each, "__len__") else each * len(rids)
        return real_step(rids, each)

    def extend(rid, n):
        cur[0] += n
        return real_extend(rid, n)

    def sim_step(t):
        cur[0] = 0
        real_sim_step(t)
        per_pass.append(cur[0])

    cache.step, cache.extend, sim.step = step, extend, sim_step
    return per_pass


@pytest.mark.parametrize("accept", [0.0, 0.6, 1.0])
def test_chunk_budget_and_draft_rollback(accept):
    cache = tiny_cache(draft_tokens=3, chunked_prefill_tokens=256)
    reqs = small_workload(seed=2)
    sim = Simulator(cache, reqs, accept_rate=accept, seed=1)
    per_pass = _count_tokens_per_pass(cache, sim)
    sim.run_offline()
    s = sim.stats
    assert max(per_pass) <= 256 and s.finished == len(reqs)
    assert s.prefill_tokens == sum(r.prompt_tokens for r in reqs)
    # every request generated exactly its output: written decode tokens minus the rolled-back drafts
    assert s.decode_tokens - s.drafts_rejected == sum(r.output_tokens for r in reqs)
    if accept == 0.0:
        assert s.drafts_accepted == 0 and s.drafts_rejected > 0
    if accept == 1.0:
        assert s.drafts_rejected == 0
    assert cache.check_integrity().occupied_bytes == 0


def test_too_long_requests_are_rejected_and_memory_pressure_queues():
    cache = tiny_cache(memory="40MiB", max_running_requests=4)
    reqs = [Request(id=f"q{i}", arrival_s=0.0, prompt_tokens=1500, output_tokens=40) for i in range(10)]
    reqs.append(Request(id="huge", arrival_s=0.0, prompt_tokens=2000, output_tokens=100))
    sim = Simulator(cache, reqs)
    sim.run_offline()
    assert sim.stats.rejected_ids == ["huge"] and sim.stats.finished == 10
    assert sim.stats.blocked_steps > 0 and sim.stats.peak_running <= 4
    assert cache.ledger.snapshot().occupied_bytes == 0


@pytest.mark.parametrize("layout, tol", [("bf16", 0.0), ("v4", 0.07)])
def test_writes_really_land_in_the_pools(layout, tol):
    cache = tiny_cache(kv_layout=layout, chunked_prefill_tokens=1024)
    writer = KVWriter(cache, layers=None)
    cache.admit("a", 600, 4)
    idx = cache.extend("a", 600)
    writer.write(idx)
    for name, ratio in (("swa_kv", 0), ("c4_kv", 4), ("c128_kv", 128)):
        pool, t = cache.pools[name], next(t for t in writer.targets if t.pool == name)
        if ratio:
            mask, entry = idx.compressed[ratio]
            slots, rs, pos = entry[mask], idx.request_slots[mask], idx.positions[mask] // ratio
        else:    # the SWA window keeps the last 128 tokens
            keep = idx.positions >= 600 - 128
            slots, rs, pos = idx.swa_slots[keep], idx.request_slots[keep], idx.positions[keep]
        want = writer.values(512, rs, pos).float()
        last = len(pool.layers) - 1   # every layer was written
        got = gather(t.geom, pool.tensor, last, torch.as_tensor(slots)).float()
        err = (got - want).abs().max() / want.abs().max()
        assert err <= tol, (name, float(err))
    assert writer.layers_written["c4_indexer"] == len(cache.pools["c4_indexer"].layers)


def test_writer_layer_subset():
    cache = tiny_cache()
    writer = KVWriter(cache, layers=1)
    assert set(writer.layers_written.values()) == {1} and writer.skipped == {}
    assert {t.pool for t in writer.targets} == {"swa_kv", "c4_kv", "c4_indexer", "c128_kv"}
    assert isinstance(writer.targets[0].geom, PageGeometry)


def test_simulate_cli_writes_png_and_csv(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "8", "--max-model-len", "2048",
               "--chunked-prefill-tokens", "512", "--draft-tokens", "2", "--rate", "20", "--duration", "0.5",
               "--prompt-len", "uniform:16:400", "--output-len", "uniform:2:30", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "finished" in text and "written:" in text
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    assert len(rows) > 5 and int(rows[-1]["total_occupied_bytes"]) == 0
    assert max(int(r["swa_kv_occupied_bytes"]) for r in rows) > 0


def test_simulate_cli_errors_name_the_field(tmp_path, capsys):
    assert main(["simulate", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests",
                 "4", "--out", str(tmp_path / "no" / "x")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["simulate", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests",
                 "4", "--out", str(tmp_path / "x"), "--write-layers", "some"]) == 2
    assert "--write-layers" in capsys.readouterr().err


def test_trace_workload_reports_bad_lines_or_stops(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 100, "output_tokens": 5}\n'
                     '{"arrival_s": 0.1, "prompt_tokens": 50}\n'
                     '{"arrival_s": 0.2, "prompt_tokens": 70, "output_tokens": 3}\n')
    args = ["simulate", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests", "4",
            "--workload", str(trace), "--out", str(tmp_path / "x"), "--no-plot", "--write-layers", "0"]
    assert main(args) == 0
    cap = capsys.readouterr()
    assert f"{trace}:2: skipped: 'output_tokens'" in cap.err and "2 arrived, 2 admitted, 2 finished" in cap.out
    assert main(args + ["--strict-trace"]) == 2
    assert f"{trace}:2" in capsys.readouterr().err
