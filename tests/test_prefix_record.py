"""What the prefix cache served, recorded for a refit (kvatlas.prefix.record): the trace made of it
shares exactly what the served requests shared, so replaying it hits the same tokens, request by
request; bounded; bad arguments named."""

from itertools import count
from pathlib import Path

import pytest

import kvatlas
from kvatlas.driving.traces import read_trace, served_requests, write_trace
from kvatlas.errors import ConfigError, RequestStateError

SLICE = str(Path(__file__).parent / "data" / "mooncake_shared3.jsonl")


def plan(page_tokens=256):
    return kvatlas.plan("deepseek-v4-flash", "16GiB", max_running_requests=4, prefix_checkpoints=200,
                        max_model_len=131072, page_tokens=page_tokens)


def replay(p, requests, record=None):
    """One request at a time: admit with its token ids, write the rest of it, finish."""
    cache = kvatlas.allocate(p, backend="none")
    if record is not None:
        cache.prefix.record(**record)
    chunk, hits = p.options.chunked_prefill_tokens, []
    for r in requests:
        adm = cache.admit(r.id, r.prompt_tokens, r.output_tokens, token_ids=r.token_ids())
        hits.append(adm.cached_tokens)
        done, total = adm.cached_tokens, r.prompt_tokens + r.output_tokens
        while done < total:
            n = min(chunk, total - done)
            cache.extend(r.id, n)
            done += n
        cache.finish(r.id)
    cache.check_integrity()
    return cache, hits


@pytest.mark.parametrize("page_tokens,ticking", [(256, True), (1024, True), (256, False)])
def test_the_served_trace_hits_what_the_served_requests_hit(tmp_path, page_tokens, ticking):
    """ticking False: every request arrives at once (a clock that stands still), so only the
    arrival order the rows keep puts the replay in the served order."""
    p = plan(page_tokens)
    requests, problems = read_trace(SLICE)
    assert not problems
    tick = count()
    cache, hits = replay(p, requests, {"clock": (lambda: float(next(tick))) if ticking else (lambda: 7.0)})
    rows = cache.prefix.served()
    assert len(rows) == len(requests) == 69
    assert [r.prompt_tokens for r in rows] == [r.prompt_tokens for r in requests]
    assert [r.output_tokens for r in rows] == [r.output_tokens for r in requests]
    assert [r.order for r in rows] == list(range(69))
    assert [r.arrival_s for r in rows] == ([float(i) for i in range(1, 70)] if ticking else [0.0] * 69)
    assert all(len(r.page_keys) == r.prompt_tokens // page_tokens for r in rows)
    path = tmp_path / "served.jsonl"
    write_trace(str(path), served_requests(rows[::-1]))   # (any order: arrival, then the order of arriving, puts it right)
    back, problems = read_trace(str(path))
    assert not problems and [r.prompt_tokens for r in back] == [r.prompt_tokens for r in requests]
    _, again = replay(p, back)
    assert sum(hits) > 0.5 * sum(r.prompt_tokens for r in requests)   # (the slice shares most of itself)
    assert again == hits   # request by request, to the token


def test_no_more_than_asked_is_kept_and_the_latest_stay():
    p = plan()
    requests, _ = read_trace(SLICE)
    cache, _ = replay(p, requests[:12], {"max_requests": 5})
    rows = cache.prefix.served()
    assert [r.prompt_tokens for r in rows] == [r.prompt_tokens for r in requests[7:12]]
    assert cache.prefix.served_total == 12   # (all it served, past the bound kept)
    assert kvatlas.allocate(p, backend="none").prefix.served_total is None   # (not recording)


def test_requests_without_content_are_recorded_by_length_and_a_request_ended_past_the_cache_too():
    p = plan()
    cache = kvatlas.allocate(p, backend="none")
    cache.prefix.record()
    cache.admit("plain", 1000, 10)
    cache.extend("plain", 1005)
    cache.finish("plain")
    cache.admit("cut", 700, 10, token_ids=list(range(700)))
    cache.extend("cut", 700)
    cache.allocator.finish("cut")   # ended on the allocator: nothing cached, but it was served
    plain, cut = cache.prefix.served()
    assert (plain.prompt_tokens, plain.output_tokens, len(plain.page_keys)) == (1000, 5, 0)
    assert (cut.prompt_tokens, cut.output_tokens, len(cut.page_keys)) == (700, 0, 2)
    a, b = served_requests([plain, cut])
    assert a.blocks is None and a.output_tokens == 5
    assert b.output_tokens == 1 and sum(b.block_lens) == 700 and len(b.blocks) == 3   # two pages and the tail
    cache.check_integrity()


@pytest.mark.parametrize("kwargs,field", [({"max_requests": 0}, "max_requests"), ({"max_requests": "10"}, "max_requests"),
                                          ({"max_requests": True}, "max_requests"), ({"clock": 3.0}, "clock")])
def test_bad_recording_arguments_are_named(kwargs, field):
    cache = kvatlas.allocate(plan(), backend="none")
    with pytest.raises(ConfigError) as e:
        cache.prefix.record(**kwargs)
    assert e.value.field == field
    with pytest.raises(RequestStateError, match="call record"):
        cache.prefix.served()


def test_a_concurrent_run_recorded_is_a_workload_the_fit_replays(tmp_path, capsys):
    """Requests admitted and finished interleaved (the simulator, many running at once) are recorded
    as they finish; the trace made of them feeds `kvatlas simulate --prefix-checkpoints fit`."""
    from kvatlas.cli import main
    from kvatlas.driving.sim import Simulator
    requests, _ = read_trace(SLICE)
    cache = kvatlas.allocate(plan(), backend="none")
    sim = Simulator(cache, requests, record=False)
    cache.prefix.record(clock=lambda: sim.now_s)   # the virtual clock: it reads each arrival as it is enqueued
    sim.run_offline()
    assert sim.stats.finished == 69 and sim.stats.peak_running > 1
    rows = cache.prefix.served()
    assert sorted((r.arrival_s, r.prompt_tokens, r.output_tokens) for r in rows) == \
        sorted((r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests)
    assert len({r.arrival_s for r in rows}) > 40   # (the passes would have rounded them to far fewer)
    path = tmp_path / "served.jsonl"
    write_trace(str(path), served_requests(rows))
    assert main(["simulate", "deepseek-v4-flash", "--memory", "16GiB", "--max-running-requests", "4",
                 "--backend", "none", "--workload", str(path), "--prefix-checkpoints", "fit", "--no-plot",
                 "--out", str(tmp_path / "fit")]) == 0
    assert "fitted: --prefix-checkpoints" in capsys.readouterr().out


def test_a_queued_request_arrives_when_it_began_to_wait():
    """A scheduler that enqueues its waiting requests (queue-aware eviction) gives the recorder
    their arrival; one that left the queue unadmitted leaves nothing behind."""
    now = [0.0]
    cache = kvatlas.allocate(plan(), backend="none")
    cache.prefix.record(clock=lambda: now[0])
    now[0] = 2.0
    cache.prefix.enqueue("a", 600, token_ids=list(range(600)))
    cache.prefix.enqueue("gone", 600, token_ids=list(range(600)))
    now[0] = 5.0
    assert cache.prefix.dequeue("gone")
    now[0] = 9.0
    cache.admit("a", 600, 4, token_ids=list(range(600)))
    cache.admit("b", 600, 4, token_ids=list(range(600)))   # never queued: it arrives as admitted
    for rid in ("a", "b"):
        cache.extend(rid, 604)
        cache.finish(rid)
    assert [(r.arrival_s, r.output_tokens, r.order) for r in cache.prefix.served()] == [(2.0, 4, 0), (9.0, 4, 2)]
    assert not cache.prefix._recorder.waiting and not cache.prefix._recorder.running


def test_requests_that_arrive_together_replay_in_the_order_they_arrived_not_admitted():
    now = [3.0]
    cache = kvatlas.allocate(plan(), backend="none")
    cache.prefix.record(clock=lambda: now[0])
    for rid, n in (("first", 700), ("second", 900)):
        cache.prefix.enqueue(rid, n, token_ids=list(range(n)))
    for rid, n in (("second", 900), ("first", 700)):   # admitted the other way round (held, reordered)
        cache.admit(rid, n, 2, token_ids=list(range(n)))
        cache.extend(rid, n + 2)
        cache.finish(rid)
    assert [r.prompt_tokens for r in cache.prefix.served()] == [900, 700]   # (finish order)
    assert [r.prompt_tokens for r in served_requests(cache.prefix.served())] == [700, 900]


def test_simulate_records_what_it_served_and_its_replay_hits_the_same(tmp_path, capsys):
    """`simulate --record-served` writes PREFIX.served.jsonl; simulating that trace with the same
    deployment hits what the recorded run hit (the same sharing, the same arrivals on the
    simulator's clock, ties in the order they arrived)."""
    from kvatlas.cli import main
    run = ["simulate", "deepseek-v4-flash", "--memory", "16GiB", "--max-running-requests", "8", "--backend", "none",
           "--prefix-checkpoints", "200", "--no-plot"]
    assert main([*run, "--workload", SLICE, "--record-served", "--out", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out
    served = tmp_path / "a.served.jsonl"
    assert str(served) in first and len(served.read_text().splitlines()) == 69
    assert main([*run, "--workload", str(served), "--out", str(tmp_path / "b")]) == 0
    second = capsys.readouterr().out
    line = lambda text: next(ln for ln in text.splitlines() if ln.startswith("prefix cache"))
    assert "hit" in line(first) and line(first) == line(second)


@pytest.mark.parametrize("extra,needle", [([], "--record-served: records what the prefix cache served, and it is off"),
                                          (["--prefix-checkpoints", "8", "--ranks", "2"], "--record-served: with --ranks")])
def test_simulate_record_served_needs_the_prefix_cache_and_one_rank(extra, needle, tmp_path, capsys):
    from kvatlas.cli import main
    assert main(["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "4", "--duration", "0.5",
                 "--backend", "none", "--no-plot", "--record-served", *extra, "--out", str(tmp_path / "r")]) == 2
    assert needle in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_pages_written_after_the_prompt_and_keyed_are_served_content_too():
    """A request whose finish keys what it generated (token ids given) made those pages shareable:
    the served trace carries them, so the next turn that repeats the answer hits them in the
    replay as it did when served."""
    import numpy as np
    p = plan()
    ids = np.arange(1000, 1800)   # A's prompt (600) and what it generates (200): three full pages
    turn = np.concatenate([ids, np.arange(5000, 5100)])

    def run(reqs, record):
        cache = kvatlas.allocate(p, backend="none")
        if record:
            cache.prefix.record()
        hits = []
        for rid, prompt, out, tokens in reqs:
            adm = cache.admit(rid, prompt, out, token_ids=tokens[:prompt])
            hits.append(adm.cached_tokens)
            cache.extend(rid, prompt + out - adm.cached_tokens)
            cache.finish(rid, token_ids=tokens[:prompt + out] if len(tokens) >= prompt + out else None)
        return cache, hits

    cache, hits = run([("a", 600, 200, ids), ("b", 900, 10, np.concatenate([turn, np.arange(10)]))], True)
    assert hits == [0, 768]
    a, b = cache.prefix.served()
    assert len(a.page_keys) == 3 and a.prompt_tokens == 600 and a.output_tokens == 200
    served = served_requests([a, b])
    assert sum(served[0].block_lens) == 800   # its output is content now: the replay keys its pages
    assert served[1].output_token_ids() is None   # (b's output completed no page: not content)
    _, again = run([(r.id, r.prompt_tokens, r.output_tokens, r.token_ids() if r.output_token_ids() is None
                     else np.concatenate([r.token_ids(), r.output_token_ids()])) for r in served], False)
    assert again == hits


def _shape(requests) -> list:
    """Each request's lengths and blocks, the block ids renamed in order of first use: the sharing
    between requests, whatever ids name the pages."""
    names: dict = {}
    return sorted((r.prompt_tokens, r.output_tokens, tuple(names.setdefault(b, len(names)) for b in r.blocks),
                   r.block_lens) for r in requests)


SERVE = ["serve", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests", "8",
         "--backend", "none", "--port", "0", "--step-ms", "2", "--duration", "1", "--rate", "12",
         "--system-prompts", "2", "--system-prompt-len", "512", "--prompt-len", "uniform:64:256",
         "--output-len", "uniform:8:32", "--progress-s", "60"]


def test_serve_records_what_it_served_for_the_next_fit(tmp_path, capsys):
    """`serve --record-served PATH` writes, when it stops, what the prefix cache served: every
    request that finished, the system prompts' pages shared between them as they were served.
    `simulate` replays that trace with the same sharing: recorded again, its requests have the
    same lengths and the same pages in common."""
    from kvatlas.cli import main
    path = tmp_path / "served.jsonl"
    assert main([*SERVE, "--prefix-checkpoints", "16", "--record-served", str(path)]) == 0
    out = capsys.readouterr().out
    served, problems = read_trace(str(path))
    assert not problems and len(served) >= 8
    assert f"written: {path} ({len(served)} requests served)" in out
    firsts = [r.blocks[0] for r in served]
    assert len(set(firsts)) == 2 and len(set(r.blocks[1] for r in served)) == 2   # two system prompts, two pages each
    assert all(r.prompt_tokens > 512 for r in served)
    again = tmp_path / "again"
    assert main(["simulate", *SERVE[1:10], "--prefix-checkpoints", "16", "--no-plot", "--workload", str(path),
                 "--record-served", "--out", str(again)]) == 0
    replayed, _ = read_trace(f"{again}.served.jsonl")
    assert _shape(replayed) == _shape(served)


@pytest.mark.parametrize("extra,where,needle", [
    ([], "served.jsonl", "--record-served: records what the prefix cache served, and it is off"),
    (["--prefix-checkpoints", "16"], "missing/served.jsonl", "--record-served: directory"),
])
def test_serve_record_served_is_refused_before_it_starts(extra, where, needle, tmp_path, capsys):
    """Refused with the flag named before the port is taken or anything allocated."""
    from kvatlas.cli import main
    path = tmp_path / where
    assert main([*SERVE, *extra, "--record-served", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "starting" not in err
    assert not path.exists()


def test_the_count_is_fitted_again_on_what_the_cache_served_as_it_runs():
    """Refit: every `every` requests served, the fit on the latest recorded, the count running now
    among its shares. Polled between the simulator's passes (as serve does), synchronously here:
    each fit is the fit of the requests served when it began, exactly, and the count running now
    is one of its trials."""
    from kvatlas.driving.fit import checkpoints_for_share, fit_checkpoints, share_of_points
    from kvatlas.driving.refit import Refit
    from kvatlas.driving.sim import Simulator
    requests, _ = read_trace(SLICE)
    p = plan()
    cache = kvatlas.allocate(p, backend="none")
    sim = Simulator(cache, requests, record=False)
    cache.prefix.record(clock=lambda: sim.now_s)
    options = dict(memory_bytes=16 << 30, max_running_requests=4, max_model_len=131072)
    refit = Refit(cache, "deepseek-v4-flash", options, every=30, background=False)
    began = []

    def poll(_):
        fits = refit.fits
        refit.poll()
        if refit.fits > fits:
            began.append(cache.prefix.served_total)
    sim.run_offline(on_step=poll)
    assert refit.fits == 2 and began[0] >= 30 and began[1] >= began[0] + 30
    latest = refit.state()["latest"]
    rows = cache.prefix.served()[:began[1]]
    shares = refit.fit_kwargs["shares"]
    assert share_of_points(p) in shares and len(shares) == len({checkpoints_for_share("deepseek-v4-flash", s, **options)
                                                              for s in shares})   # (no two buy the same count)
    want = fit_checkpoints("deepseek-v4-flash", served_requests(rows), shares=shares, simulator={}, **options)
    assert latest["requests"] == began[1] and latest["fit"] == want.to_dict()
    now = [t for t in want.trials if t.checkpoints == p.options.prefix_checkpoints]
    assert len(now) == 1 and latest["running_hit_ratio"] == now[0].hit_ratio and latest["running_checkpoints"] == 200
    assert "applies at the next start" in refit.line()
    from kvatlas.cli.serve import _state
    assert _state(sim, refit)()["prefix_fit"]["latest"] == latest   # (serve's /state)


def test_the_refit_fits_the_running_count_too_with_the_count_running_now_among_them():
    """running=: every candidate count gets its share fitted, the count running now among them (its
    trial at the running share is the baseline), chosen as fit_checkpoints chooses."""
    from kvatlas.driving.fit import fit_checkpoints, share_of_points
    from kvatlas.driving.refit import Refit
    p = plan()
    requests, _ = read_trace(SLICE)
    cache, _ = replay(p, requests[:24], {})
    options = dict(memory_bytes=16 << 30, max_running_requests=4, max_model_len=131072)
    refit = Refit(cache, "deepseek-v4-flash", options, every=24, running=(2, 8), ttft_slack=0.5, background=False)
    refit.poll()
    latest = refit.state()["latest"]
    assert share_of_points(p) in refit.fit_kwargs["shares"]
    want = fit_checkpoints("deepseek-v4-flash", served_requests(cache.prefix.served()),
                           shares=refit.fit_kwargs["shares"], simulator={}, running=(2, 4, 8), ttft_slack=0.5,
                           memory_bytes=16 << 30, max_model_len=131072)
    assert latest["fit"] == want.to_dict() and latest["running_fitted"]
    assert {t["max_running_requests"] for t in latest["fit"]["trials"]} == {2, 4, 8}
    assert latest["max_running_requests"] == want.best.running and latest["running_max_running_requests"] == 4
    assert f"--max-running-requests {want.best.running} " in refit.line() and "4 running requests and" in refit.line()


@pytest.mark.parametrize("kwargs,field", [({"every": 0}, "every"), ({"options": {"prefix_checkpoints": 8}}, "options")])
def test_bad_refit_arguments_are_named(kwargs, field):
    from kvatlas.driving.refit import Refit
    cache = kvatlas.allocate(plan(), backend="none")
    cache.prefix.record()
    args = {"every": 5, "options": {"memory_bytes": 16 << 30}, **kwargs}
    with pytest.raises(ConfigError, match=field):
        Refit(cache, "deepseek-v4-flash", args.pop("options"), **args)
    with pytest.raises(ConfigError, match="records nothing"):
        Refit(kvatlas.allocate(plan(), backend="none"), "deepseek-v4-flash", {"memory_bytes": 16 << 30}, every=5)


def test_serve_fits_the_count_again_in_a_process_of_its_own(capsys):
    """`serve --refit-every N`: a fit after every N requests served, in a spawned process while the
    loop serves on; the summary says what it found (the count for the next start, and what the
    count running now hits on the same requests)."""
    from kvatlas.cli import main
    assert main([*SERVE, "--prefix-checkpoints", "16", "--refit-every", "5", "--refit-running", "4", "--linger", "5"]) == 0
    out, err = capsys.readouterr()
    assert "kvatlas serve: resume points fitted on the latest" in err
    line = next(ln for ln in out.splitlines() if ln.startswith("resume points fitted again:"))
    assert "--max-running-requests" in line and "--prefix-checkpoints" in line and "next start" in line
    assert "8 running requests and the 16 resume points running now" in line


@pytest.mark.parametrize("extra,needle", [
    (["--prefix-checkpoints", "16", "--refit-running", "4"], "--refit-running: weighs what the refit tries"),
    (["--prefix-checkpoints", "16", "--refit-every", "5", "--refit-ttft-slack", "0.2"], "--refit-ttft-slack: weighs"),
    (["--refit-every", "5"], "--refit-every: records what the prefix cache served, and it is off"),
])
def test_serve_refit_flags_are_refused_alone(extra, needle, capsys):
    from kvatlas.cli import main
    assert main([*SERVE, *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and "starting" not in err
