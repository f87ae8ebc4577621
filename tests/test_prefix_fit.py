"""How many resume points: the count fitted to a budget and a workload by replay
(kvatlas.driving.fit, `kvatlas simulate --prefix-checkpoints fit`)."""

from __future__ import annotations

import pytest

import kvatlas
from kvatlas.cli import main
from kvatlas.driving.fit import SHARES, checkpoints_for_share, fit_checkpoints
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.sessions import sessions
from kvatlas.errors import ConfigError
from kvatlas.planning.capacity import resume_points

MODEL = "tiny-v4"
OPTS = {"memory_bytes": 96 << 20, "max_running_requests": 8}


def workload():
    """The workload of SIM below (the CLI's defaults for the rest)."""
    return sessions(rate_per_s=20, duration_s=2, turns="3", first_len="uniform:64:1024", followup_len="uniform:16:256",
                    output="uniform:16:256", think="exp:5", system_prompts=3, system_len="600", seed=3)


def hit_of(checkpoints: int, requests) -> tuple[int, int]:
    """A replay of its own, the way a user would run it: the hit tokens and the queried ones."""
    cache = kvatlas.allocate(kvatlas.plan(MODEL, **OPTS, prefix_checkpoints=checkpoints), backend="none")
    Simulator(cache, requests, record=False).run_offline()
    cache.check_integrity()
    return cache.prefix.stats.hit_tokens, cache.prefix.stats.queried_tokens


def test_a_share_buys_the_resume_points_it_can_pay_for():
    for share in (0.05, 0.15, 0.3):
        n = checkpoints_for_share(MODEL, share, **OPTS)
        each = resume_points(kvatlas.plan(MODEL, **OPTS, prefix_checkpoints=n)).bytes_each
        assert n * each <= share * OPTS["memory_bytes"] < (n + 1) * each, (share, n, each)


def test_the_fit_is_the_best_of_replays_each_run_on_its_own():
    reqs = workload()
    fit = fit_checkpoints(MODEL, reqs, **OPTS)
    shares = [t.share for t in fit.trials]
    assert shares == sorted(shares) and set(SHARES) <= set(shares)
    fitting = [t for t in fit.trials if not t.refused]
    assert len(fitting) >= 5 and len({t.hit_tokens for t in fitting}) > 2   # the count matters on this workload
    for t in fitting:
        assert (t.hit_tokens, t.queried_tokens) == hit_of(t.checkpoints, reqs), t
        assert t.checkpoints == checkpoints_for_share(MODEL, t.share, **OPTS)
    assert fit.best.hit_tokens == max(t.hit_tokens for t in fitting)
    tied = [t for t in fitting if t.hit_tokens == fit.best.hit_tokens]
    assert fit.best == max(tied, key=lambda t: (t.full_pages, t.checkpoints))
    # refined: the midpoints between the best grid share and its fitting neighbours were tried
    grid = [s for s in SHARES if not next(t for t in fit.trials if t.share == s).refused]
    best_grid = max((t for t in fitting if t.share in SHARES), key=lambda t: (t.hit_tokens, t.full_pages, t.checkpoints)).share
    i = grid.index(best_grid)
    for j in (i - 1, i + 1):
        if 0 <= j < len(grid):
            assert round((grid[i] + grid[j]) / 2, 4) in shares
    assert "<- fitted" in fit.table() and fit.to_dict()["checkpoints"] == fit.best.checkpoints


def test_replays_run_at_once_in_processes_give_the_same_fit():
    reqs = workload()
    one, two = (fit_checkpoints(MODEL, reqs, shares=(0.05, 0.15, 0.25), jobs=j, **OPTS) for j in (1, 2))
    assert one == two and len(one.trials) == 5


def test_a_share_the_budget_cannot_hold_is_refused_not_fitted():
    fit = fit_checkpoints(MODEL, workload(), shares=(0.1, 0.45), refine=False, **OPTS)
    big = fit.trials[-1]
    assert big.share == 0.45 and big.refused and "prefix_checkpoints" in big.refused
    assert fit.best.share == 0.1 and "does not fit the budget" in fit.table()
    assert big.running == 8 and not fit.running_fitted and fit.table().split()[0] == "share"   # one count: no column


@pytest.mark.parametrize("kwargs,field", [({"shares": (0.0, 0.2)}, "shares"), ({"shares": (1.5,)}, "shares"),
                                          ({"shares": ()}, "shares"), ({"shares": "ab"}, "shares"), ({"jobs": 0}, "jobs"),
                                          ({"prefix_checkpoints": 4}, "prefix_checkpoints")])
def test_bad_fit_arguments_are_named(kwargs, field):
    with pytest.raises(ConfigError) as e:
        fit_checkpoints(MODEL, workload(), **{**OPTS, **kwargs})
    assert e.value.field == field


def test_no_requests_is_refused():
    with pytest.raises(ConfigError) as e:
        fit_checkpoints(MODEL, [], **OPTS)
    assert e.value.field == "requests"


SIM = ["simulate", MODEL, "--memory", "96MiB", "--max-running-requests", "8", "--rate", "20", "--duration", "2",
       "--seed", "3", "--system-prompts", "3", "--system-prompt-len", "600", "--turns", "3", "--backend", "none",
       "--no-plot"]


def test_simulate_fits_then_runs_with_the_fitted_count(tmp_path, capsys):
    assert main([*SIM, "--prefix-checkpoints", "fit", "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    fitted = int(out.split("fitted: --prefix-checkpoints ")[1].split()[0])
    fit = fit_checkpoints(MODEL, workload(), simulator={"time_model": default_time_model(), "seed": 3}, **OPTS)
    assert fitted == fit.best.checkpoints and fit.table() in out
    assert main([*SIM, "--prefix-checkpoints", str(fitted), "--out", str(tmp_path / "n")]) == 0
    plain = capsys.readouterr().out
    line = lambda text: next(ln for ln in text.splitlines() if ln.startswith("prefix cache"))
    assert line(out) == line(plain)   # the run after the fit is the run with the count given


@pytest.mark.parametrize("command", [["plan", MODEL, "--memory", "96MiB"], ["compare", MODEL, "--memory", "96MiB"]])
def test_fit_is_refused_where_no_workload_is_replayed(command, capsys):
    assert main([*command, "--prefix-checkpoints", "fit"]) == 2
    err = capsys.readouterr().err
    assert "--prefix-checkpoints" in err and "kvatlas simulate" in err


def test_fit_with_ranks_is_refused(tmp_path, capsys):
    assert main([*SIM, "--prefix-checkpoints", "fit", "--ranks", "2", "--out", str(tmp_path / "r")]) == 2
    assert "fit on one rank first" in capsys.readouterr().err


def test_a_count_that_is_neither_a_number_nor_fit_is_refused(capsys):
    assert main(["plan", MODEL, "--memory", "96MiB", "--prefix-checkpoints", "fitted"]) == 2
    err = capsys.readouterr().err
    assert "'fitted' is not a whole number" in err and "or 'fit'" in err


TUNE = ["tune", MODEL, "--memory", "1GiB", "--engines", "kvatlas", "--rate", "20", "--duration", "2", "--seed", "3",
        "--system-prompts", "3", "--system-prompt-len", "600", "--turns", "3"]


def test_tune_advises_the_fitted_count_and_measures_it_beside_the_tuned_one(capsys):
    import json

    assert main([*TUNE, "--fit-checkpoints", "--simulate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    got = doc["fitted_checkpoints"]
    kv = doc["engines"][0]["tuned"]["flags"]
    # the same fit by hand, with tune's other flags for kvatlas
    fit = fit_checkpoints(MODEL, workload(), simulator={"time_model": default_time_model()}, memory_bytes=1 << 30,
                          max_running_requests=kv["--max-running-requests"],
                          chunked_prefill_tokens=kv["--chunked-prefill-tokens"], max_model_len=kv["--max-model-len"])
    assert got == fit.to_dict()
    tuned, fitted = doc["simulated"]["tuned"], doc["simulated"]["fitted"]
    assert fitted["hit_tokens"] == fit.best.hit_tokens and fitted["hit_tokens"] >= tuned["hit_tokens"]
    assert main([*TUNE, "--fit-checkpoints"]) == 0
    out = capsys.readouterr().out
    assert fit.table() in out and f"start kvatlas with --prefix-checkpoints {fit.best.checkpoints} " in out


def test_tune_fit_needs_kvatlas(capsys):
    assert main([*TUNE[:5], "sglang", *TUNE[6:], "--fit-checkpoints"]) == 2
    assert "--fit-checkpoints" in capsys.readouterr().err


def test_a_tie_goes_to_more_pages_then_to_more_resume_points():
    from kvatlas.driving.fit import Trial, _best
    t = lambda share, n, pages, hit: Trial(share=share, checkpoints=n, full_pages=pages, hit_tokens=hit, queried_tokens=1000)
    assert _best([t(0.1, 10, 90, 500), t(0.2, 20, 80, 500), t(0.3, 30, 70, 499)]).share == 0.1
    # pages capped by what requests address: more points cost nothing the pages could use
    assert _best([t(0.1, 10, 90, 500), t(0.2, 20, 90, 500), t(0.3, 30, 90, 500)]).share == 0.3
    assert _best([t(0.1, 10, 90, 500), t(0.2, 20, 80, 501)]).share == 0.2


# ---------------------------------------------------------------- running requests fitted beside the share
def replay_of(running: int, checkpoints: int, requests) -> tuple[int, float]:
    """A replay of its own at that running count: hit tokens and mean TTFT."""
    opts = {**OPTS, "max_running_requests": running}
    cache = kvatlas.allocate(kvatlas.plan(MODEL, **opts, prefix_checkpoints=checkpoints), backend="none")
    sim = Simulator(cache, requests, record=False)
    sim.run_offline()
    return cache.prefix.stats.hit_tokens, sim.latency.summary()["all"]["ttft_s"]["mean"]


def test_running_counts_are_fitted_each_with_its_share_then_the_count_by_hits_within_the_ttft_slack():
    reqs = workload()
    opts = {k: v for k, v in OPTS.items() if k != "max_running_requests"}
    fit = fit_checkpoints(MODEL, reqs, shares=(0.05, 0.15), running=(4, 8, 2), **opts)
    assert [(t.running, t.share) for t in fit.trials] == [(2, 0.05), (2, 0.1), (2, 0.15), (4, 0.05), (4, 0.1),
                                                          (4, 0.15), (8, 0.05), (8, 0.1), (8, 0.15)]
    for t in (fit.trials[0], fit.trials[5], fit.trials[7]):   # each trial is the replay at its own count
        assert (t.hit_tokens, t.ttft_mean_s) == replay_of(t.running, t.checkpoints, reqs), t
    per = {n: max((t for t in fit.trials if t.running == n), key=lambda t: (t.hit_tokens, t.full_pages, t.checkpoints))
           for n in (2, 4, 8)}
    low = min(t.ttft_mean_s for t in per.values())
    assert fit.best == max((t for t in per.values() if t.ttft_mean_s <= 1.1 * low), key=lambda t: t.hit_tokens)
    assert fit.best.running == 8 and fit.to_dict()["max_running_requests"] == 8
    table = fit.table()
    assert table.splitlines()[0].split()[0] == "running" and "TTFT mean" in table and "<- fitted" in table


def test_a_count_that_hits_more_but_waits_beyond_the_slack_is_passed_over():
    from kvatlas.driving.fit import _best_running, Trial
    few = Trial(share=0.1, checkpoints=10, full_pages=900, hit_tokens=600, queried_tokens=1000, running=32,
                ttft_mean_s=130.0)
    mid = Trial(share=0.1, checkpoints=10, full_pages=800, hit_tokens=560, queried_tokens=1000, running=64,
                ttft_mean_s=109.0)
    many = Trial(share=0.1, checkpoints=10, full_pages=500, hit_tokens=520, queried_tokens=1000, running=256,
                 ttft_mean_s=100.0)
    assert _best_running([few, mid, many], 0.1) is mid      # 130 s is past 110 s; 109 s is within
    assert _best_running([few, mid, many], 0.3) is few      # a wider slack takes the most hits
    assert _best_running([few, mid, many], 0.0) is many     # no slack: the lowest TTFT
    assert _best_running([few], 0.0) is few


@pytest.mark.parametrize("kwargs,field", [({"running": ()}, "running"), ({"running": (0, 8)}, "running"),
                                          ({"running": "8"}, "running"), ({"running": 8}, "running"),
                                          ({"running": (4.0,)}, "running"), ({"running": (4, True)}, "running"),
                                          ({"running": (4, 8), "max_running_requests": 8}, "max_running_requests"),
                                          ({"running": (4, 8), "ttft_slack": -0.1}, "ttft_slack")])
def test_bad_running_counts_are_named(kwargs, field):
    opts = {k: v for k, v in OPTS.items() if k != "max_running_requests"}
    with pytest.raises(ConfigError) as e:
        fit_checkpoints(MODEL, workload(), **{**opts, **kwargs})
    assert e.value.field == field


def test_simulate_fits_the_running_count_then_runs_with_it(tmp_path, capsys):
    sim = [a for a in SIM if a not in ("--max-running-requests", "8")]
    assert main([*sim, "--prefix-checkpoints", "fit", "--fit-running", "8,4", "--fit-ttft-slack", "0.5", "--out",
                 str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    opts = {k: v for k, v in OPTS.items() if k != "max_running_requests"}
    fit = fit_checkpoints(MODEL, workload(), simulator={"time_model": default_time_model(), "seed": 3},
                          running=(4, 8), ttft_slack=0.5, **opts)
    assert fit.table() in out and f"fitted: --max-running-requests {fit.best.running} " in out
    assert "at 4, 8 running requests each (the count: the most hits within 50% of the lowest mean TTFT)" in out
    assert f"fitted: --prefix-checkpoints {fit.best.checkpoints} " in out
    assert main([*sim, "--max-running-requests", str(fit.best.running), "--prefix-checkpoints",
                 str(fit.best.checkpoints), "--out", str(tmp_path / "n")]) == 0
    plain = capsys.readouterr().out
    line = lambda text: next(ln for ln in text.splitlines() if ln.startswith("prefix cache"))
    assert line(out) == line(plain)   # the run after the fit is the run with both counts given


@pytest.mark.parametrize("extra,needle", [(["--fit-running", "4,8", "--prefix-checkpoints", "16"], "--fit-running"),
                                          (["--prefix-checkpoints", "fit", "--fit-running", "4,x"], "not a whole number"),
                                          (["--prefix-checkpoints", "fit", "--fit-running", "0"], "out of range"),
                                          (["--prefix-checkpoints", "fit", "--fit-running", ","], "no count given"),
                                          (["--prefix-checkpoints", "fit", "--fit-ttft-slack", "0.2"], "--fit-ttft-slack"),
                                          (["--prefix-checkpoints", "fit", "--fit-running", "4,8", "--fit-ttft-slack",
                                            "-1"], "--fit-ttft-slack"),
                                          (["--prefix-checkpoints", "fit", "--fit-running", "4,8"],
                                           "--max-running-requests: 8 is the count --fit-running chooses among 4,8")])
def test_bad_fit_running_flags_are_named(extra, needle, tmp_path, capsys):
    assert "--max-running-requests" in SIM   # (given: the fit would override it without a word)
    assert main([*SIM, *extra, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "b").exists()


def test_the_running_count_given_is_told_apart_from_its_default():
    import argparse
    from kvatlas.cli.common import given
    from kvatlas.cli.simulate import add_parser
    p = argparse.ArgumentParser()
    add_parser(p)
    assert not given(p.parse_args(["--workload", "w.jsonl"]), "max_running_requests")
    args = p.parse_args(["--workload", "w.jsonl", "--max-running-requests", "256"])
    assert given(args, "max_running_requests") and args.max_running_requests == 256


def test_tune_fits_the_running_count_too_and_measures_the_fitted_flags(capsys):
    import json

    assert main([*TUNE, "--fit-checkpoints", "--fit-running", "16,4,8", "--simulate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    got = doc["fitted_checkpoints"]
    kv = doc["engines"][0]["tuned"]["flags"]
    # by hand: tune's other flags for kvatlas, each count replayed with the model's context as max_model_len
    fit = fit_checkpoints(MODEL, workload(), simulator={"time_model": default_time_model()}, memory_bytes=1 << 30,
                          chunked_prefill_tokens=kv["--chunked-prefill-tokens"], max_model_len=4096, running=(4, 8, 16))
    assert got == fit.to_dict() and got["max_running_requests"] in (4, 8, 16)
    assert {t["max_running_requests"] for t in got["trials"]} == {4, 8, 16}
    fitted = doc["simulated"]["fitted"]
    assert fitted["hit_tokens"] == fit.best.hit_tokens and fitted["peak_running"] <= fit.best.running
    assert main([*TUNE, "--fit-checkpoints", "--fit-running", "4,8,16"]) == 0
    out = capsys.readouterr().out
    assert fit.table() in out
    assert (f"start kvatlas with --max-running-requests {fit.best.running} --max-model-len 4096 --prefix-checkpoints "
            f"{fit.best.checkpoints} ") in out


def test_tune_fitting_one_running_count_advises_it(capsys):
    """One count given is still a count fitted: the advice names it and the context it was replayed with."""
    assert main([*TUNE, "--fit-checkpoints", "--fit-running", "8"]) == 0
    out = capsys.readouterr().out
    assert "start kvatlas with --max-running-requests 8 --max-model-len 4096 --prefix-checkpoints " in out
    assert out.split("fitted to this workload")[1].split("\n")[1].split()[:2] == ["running", "share"]


@pytest.mark.parametrize("extra", [["--fit-running", "4,8"], ["--fit-checkpoints", "--fit-ttft-slack", "0.3"]])
def test_tune_fit_running_flags_need_what_they_weigh(extra, capsys):
    assert main([*TUNE, *extra]) == 2
    assert extra[-2] in capsys.readouterr().err
