"""The prefix cache on a real trace with concurrency: a slice of the Mooncake trace whose requests
share their prompts' openings (tests/data/README.md) replayed by `kvatlas simulate` through the
bookkeeping-only backend, every book recounted after every forward pass.

Before issue 23's fix this slice ended with "ledger invariants broken: total: evictable ... >
occupied ..." (exit status 2, as if the user had erred): two requests resumed from one cached
point retired a shared SWA page in the same pass, and the page was counted evictable twice (and,
as an orphan, freed twice). With --check-integrity the recount names the first pass it breaks in."""

from pathlib import Path

import pytest

from kvatlas.cli import main
from kvatlas.errors import IntegrityError

SLICE = str(Path(__file__).parent / "data" / "mooncake_shared3.jsonl")
RUN = ["simulate", "deepseek-v4-flash", "--memory", "16GiB", "--backend", "none", "--prefix-checkpoints", "500",
       "--workload", SLICE, "--no-plot", "--check-integrity"]


def test_shared_prefix_slice_keeps_every_book_after_every_pass(tmp_path, capsys):
    assert main(RUN + ["--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "69 admitted" in out or "69 finished" in out, out


def test_shared_prefix_slice_hits_and_accounts_every_queried_token(tmp_path):
    from kvatlas.cli import _parse
    from kvatlas.cli.common import plan_from_args
    from kvatlas.cli.drive import build
    _, args = _parse(RUN + ["--out", str(tmp_path / "run")])
    cache, sim, _ = build(args, plan_from_args)
    sim.run_offline()
    s = cache.prefix.stats
    assert sim.stats.finished == 69 and sim.stats.peak_running > 1
    assert s.queried_tokens == 1_104_708 == s.hit_tokens + sum(s.missed().values())
    assert s.hit_ratio > 0.8   # 66 of the 69 open with a prefix cached before them
    cache.flush()
    cache.check_integrity()


def test_a_broken_book_is_a_bug_not_bad_input(tmp_path, capsys, monkeypatch):
    """Exit status 1 and the one-line bug report, never 2 (bad input)."""
    from kvatlas.cache.kvcache import KVCache

    def broken(self):
        raise IntegrityError("cache invariants broken: ledger evictable swa_pages: 2 units counted, 0 recounted")
    monkeypatch.setattr(KVCache, "check_integrity", broken)
    code = main(["simulate", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "2", "--duration", "0.5",
                 "--prefix-checkpoints", "4", "--check-integrity", "--no-plot", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "internal error: IntegrityError" in err[0] and "after pass" in err[0] and "bug in kvatlas" in err[0]
    assert "Traceback" not in err[0]


def test_check_integrity_changes_nothing_it_checks(tmp_path, capsys):
    """The debug mode only reads: the same run with and without it prints the same figures."""
    args = ["simulate", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "8", "--rate", "20", "--duration", "1",
            "--prefix-checkpoints", "8", "--system-prompts", "2", "--system-prompt-len", "600", "--no-plot",
            "--out", str(tmp_path / "t")]
    seen = []
    for extra in ([], ["--check-integrity"]):
        assert main(args + extra) == 0
        seen.append([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("prefix cache", "forward passes"))])
    assert seen[0] == seen[1] and len(seen[0]) == 2


# ------------------------------------------------------------------ what --check-integrity recounts, and when
def _sim(share):
    import kvatlas
    from kvatlas.driving.sim import Simulator
    from kvatlas.driving.workload import synthetic
    cache = kvatlas.allocate(kvatlas.plan("tiny-v4", "96MiB", max_running_requests=8, prefix_checkpoints=8),
                             backend="none")
    reqs = synthetic(rate_per_s=40, duration_s=1, prompt="uniform:100:900", output="uniform:4:40", seed=3)
    return cache, Simulator(cache, reqs, check_integrity=True, integrity_share=share)


def test_every_pass_recounted_with_no_share_and_first_and_last_with_a_tiny_one():
    cache, sim = _sim(None)
    sim.run_offline()
    assert sim.stats.steps > 20 and sim.integrity_recounts == sim.stats.steps + 1   # each pass, then the end
    cache, sim = _sim(1e-9)     # the first recount spends the share: only the end's follows
    sim.run_offline()
    assert sim.integrity_recounts == 2 and sim.stats.steps > 20


def test_a_counter_break_is_named_at_the_pass_after_it():
    """The O(1) counters are compared after every pass, whatever the share."""
    cache, sim = _sim(1e-9)
    def corrupt(s):
        if s.stats.steps == 6:
            s.cache.ledger.running_requests += 1
    with pytest.raises(IntegrityError, match=r"after pass 7 .*ledger running"):
        sim.run_offline(on_step=corrupt)


def test_a_deep_break_between_recounts_names_the_last_whole_pass():
    """A book no counter shows (a free page given an owner) is found by the next whole recount,
    which names the last pass the books were whole after."""
    cache, sim = _sim(1e-9)
    def corrupt(s):
        if s.stats.steps == 6:
            fl = s.cache.allocator.full
            fl.owner[fl._stack[0]] = 99
    with pytest.raises(IntegrityError, match=r"every book was whole after pass 1 .*integrity_share=None") as exc:
        sim.run_offline(on_step=corrupt)
    assert "a free id has an owner" in str(exc.value)
    cache, sim = _sim(None)
    with pytest.raises(IntegrityError, match=r"^after pass 7 .*a free id has an owner") as exc:
        sim.run_offline(on_step=corrupt)
    assert "whole after" not in str(exc.value)
