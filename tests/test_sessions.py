"""Synthetic workloads with prefix structure (multi-turn sessions, shared system prompts), the
simulator's handling of session turns, and its time model."""

from __future__ import annotations

import numpy as np
import pytest

import kvatlas
from kvatlas.cli import main
from kvatlas.driving.content import BLOCK_TOKENS
from kvatlas.driving.sessions import sessions
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import TimeModel
from kvatlas.driving.workload import Request
from kvatlas.errors import ConfigError

TINY = dict(max_running_requests=8, max_model_len=2048, chunked_prefill_tokens=512)


def test_each_turn_extends_the_previous_prompt_and_output():
    reqs = sessions(rate_per_s=3, duration_s=2, turns="4", first_len="uniform:100:700", followup_len="uniform:5:90",
                    output="uniform:3:40", think="exp:2", seed=7)
    by_id = {r.id: r for r in reqs}
    assert reqs == sessions(rate_per_s=3, duration_s=2, turns="4", first_len="uniform:100:700",
                            followup_len="uniform:5:90", output="uniform:3:40", think="exp:2", seed=7)
    follows = [r for r in reqs if r.after is not None]
    assert len(follows) == 3 * len(reqs) // 4 > 0
    for r in follows:
        prev = by_id[r.after]
        whole_prev = np.concatenate([prev.token_ids(), prev.output_token_ids()])
        toks = r.token_ids()
        assert r.prompt_tokens > prev.prompt_tokens + prev.output_tokens >= 4
        assert np.array_equal(toks[:len(whole_prev)], whole_prev)        # the whole previous turn, exactly
        assert r.think_s >= 0 and r.arrival_s == prev.arrival_s
    firsts = [r for r in reqs if r.after is None]
    a, b = firsts[0].token_ids(), firsts[1].token_ids()
    n = min(len(a), len(b))
    assert (a[:n] != b[:n]).mean() > 0.99                                # different sessions share nothing


def test_shared_system_prompts():
    reqs = sessions(rate_per_s=40, duration_s=1, system_prompts=3, system_len="600", first_len="uniform:10:50",
                    seed=2)
    assert all(r.after is None for r in reqs) and len(reqs) > 20
    heads = {r.token_ids()[:600].tobytes() for r in reqs}
    assert len(heads) == 3                                               # three distinct prompts, each shared
    assert all(610 <= r.prompt_tokens <= 650 for r in reqs)
    counts = {}
    for r in reqs:
        counts[r.blocks[:2]] = counts.get(r.blocks[:2], 0) + 1
    assert sorted(counts.values())[0] >= 3 and all(k[1] - k[0] == 1 for k in counts)
    # the system prompt's pieces are one whole block and a partial one
    assert reqs[0].block_lens[:2] == (BLOCK_TOKENS, 600 - BLOCK_TOKENS)


@pytest.mark.parametrize("kw, field", [({"system_prompts": -1}, "system_prompts"), ({"turns": "0"}, "turns"),
                                       ({"think": "exp:-1"}, "think_s"), ({"rate_per_s": float("inf")}, "rate"),
                                       ({"duration_s": 0}, "duration"), ({"seed": -1}, "seed"),
                                       ({"system_len": "abc"}, "system_prompt_len")])
def test_bad_session_options_name_the_field(kw, field):
    args = dict(rate_per_s=1, duration_s=1) | kw
    with pytest.raises(ConfigError) as exc:
        sessions(**args)
    assert exc.value.field == field


def test_the_next_turn_arrives_think_s_after_the_previous_one_finishes():
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **TINY))
    reqs = [Request(id="a", arrival_s=0.0, prompt_tokens=300, output_tokens=5),
            Request(id="b", arrival_s=0.0, prompt_tokens=400, output_tokens=3, after="a", think_s=1.0),
            Request(id="c", arrival_s=9.0, prompt_tokens=500, output_tokens=2, after="b", think_s=0.5)]
    sim = Simulator(cache, reqs, step_s=0.01)
    admitted_at = {}
    real_admit = cache.admit

    def admit(rid, *a, **kw):
        admitted_at[rid] = t
        return real_admit(rid, *a, **kw)
    cache.admit = admit
    t, finished_at = 0.0, {}
    while not sim.done:
        before = set(sim.running)
        sim.step(t)
        for rid in before - set(sim.running):
            finished_at[rid] = t
        t = round(t + 0.01, 6)
    assert admitted_at["b"] == pytest.approx(finished_at["a"] + 1.0)     # think time after the end
    assert admitted_at["c"] == pytest.approx(9.0)                        # not before its own arrival_s
    assert sim.stats.finished == 3 and sim.stats.arrived == 3


def test_sessions_refuse_links_that_would_hold_a_turn_forever():
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **TINY))
    with pytest.raises(ConfigError, match="not an earlier request"):
        Simulator(cache, [Request(id="b", arrival_s=0, prompt_tokens=5, output_tokens=1, after="a")])
    with pytest.raises(ConfigError, match="appears twice"):
        Simulator(cache, [Request(id="a", arrival_s=0, prompt_tokens=5, output_tokens=1)] * 2)


def test_a_rejected_turn_releases_the_next():
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **TINY))
    reqs = [Request(id="a", arrival_s=0, prompt_tokens=3000, output_tokens=5),          # > max_model_len
            Request(id="b", arrival_s=0, prompt_tokens=100, output_tokens=2, after="a")]
    sim = Simulator(cache, reqs)
    sim.run_offline()
    assert sim.done and sim.stats.rejected_ids == ["a"] and sim.stats.finished == 1


def test_time_model_charges_tokens_computed():
    tm = TimeModel(pass_s=0.02, prefill_s_per_token=40e-6, decode_s_per_token=100e-6)
    assert tm.pass_time_s(0, 0) == 0.02
    assert tm.pass_time_s(8192, 10) == pytest.approx(0.02 + 8192 * 40e-6 + 10 * 100e-6)
    assert "20 ms + 40 µs × prefill tokens + 100 µs × decode tokens" in tm.describe()
    with pytest.raises(ConfigError) as exc:
        TimeModel(pass_s=0)
    assert exc.value.field == "pass_s"
    with pytest.raises(ConfigError):
        TimeModel(prefill_s_per_token=float("nan"))


def test_virtual_clock_follows_the_time_model():
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", **TINY))
    reqs = [Request(id="a", arrival_s=0.0, prompt_tokens=1000, output_tokens=3)]
    tm = TimeModel(pass_s=0.01, prefill_s_per_token=1e-3, decode_s_per_token=0.5)
    sim = Simulator(cache, reqs, time_model=tm)
    sim.run_offline()
    # 1000 prompt tokens in chunks of 512: 2 passes with 1000 tokens; then 3 decode passes of 1 token
    assert sim.stats.steps == 5
    assert sim.clock_s == pytest.approx(5 * 0.01 + 1000 * 1e-3 + 3 * 0.5)


def test_simulate_cli_runs_sessions_and_states_the_time_model(tmp_path, capsys):
    args = ["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "8", "--max-model-len", "2048",
            "--chunked-prefill-tokens", "512", "--rate", "4", "--duration", "1", "--turns", "3",
            "--prompt-len", "uniform:50:300", "--followup-len", "20", "--output-len", "10", "--think", "0.5",
            "--system-prompts", "2", "--system-prompt-len", "300", "--no-plot", "--out", str(tmp_path / "run"),
            "--write-layers", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    n = len(sessions(rate_per_s=4, duration_s=1, turns="3", first_len="uniform:50:300", followup_len="20",
                     output="10", think="0.5", system_prompts=2, system_len="300", seed=0))
    assert n % 3 == 0 and f"{n} arrived, {n} admitted, {n} finished" in out
    assert "time model" in out and "pass = 20 ms + 40 µs × prefill tokens + 100 µs × decode tokens" in out
    assert main(args[:-2] + ["--step-ms", "-1"]) == 2
    assert "--step-ms" in capsys.readouterr().err
    assert main(args[:-2] + ["--think", "soon"]) == 2
    assert "think_s" in capsys.readouterr().err
    assert main(args[:-2] + ["--sample-ms", "nan"]) == 2
    assert "--sample-ms" in capsys.readouterr().err
    assert main(args[:-2] + ["--prefill-us-per-token", "-3"]) == 2
    assert "--prefill-us-per-token" in capsys.readouterr().err
