"""The simulator with a host tier under the prefix cache (`kvatlas simulate --host-memory`):
pages evicted from a too-small device come back from host, and a request that restores waits
on the simulator's clock for the modeled transfer time before its first forward pass."""

from __future__ import annotations

import pytest

import kvatlas
from kvatlas.cli import main
from kvatlas.driving.sessions import sessions
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import TimeModel
from kvatlas.planning.hostplan import HOST_CHECKPOINTS, HOST_PAGES
from kvatlas.tiers import HostLink
from kvatlas.tiers.modeled import RESTORE_BYTES_PER_S, ModeledHost

WORKLOAD = dict(rate_per_s=6, duration_s=3, turns="3", first_len="uniform:1024:2048", followup_len="32",
                output="16", think="2", seed=0)


def _run(max_running: int):
    plan = kvatlas.plan("tiny-v4", "72MiB", max_running_requests=max_running, prefix_checkpoints=2)
    cache = kvatlas.allocate(plan, backend="none")
    link = HostLink(cache.prefix, ModeledHost(plan, 256 << 20))
    sim = Simulator(cache, sessions(**WORKLOAD), time_model=TimeModel(pass_s=0.02, prefill_s_per_token=40e-6),
                    host=link)
    sim.run_offline()
    assert sim.done
    cache.check_integrity()
    return cache, sim, link


def test_host_hits_and_exact_bytes():
    cache, sim, link = _run(4)
    snap, tier = link.snapshot(), link.tier
    assert snap.hits["host_hit_tokens"] > 0 and snap.hits["host_hit_requests"] > 0
    assert cache.prefix.stats.evicted_pages > 0
    # bytes moved each way are the moved entries' host bytes, exactly
    assert snap.bytes_to_device == (snap.moved_to_device["pages"] * tier.plan.unit_bytes(HOST_PAGES)
                                    + snap.moved_to_device["checkpoints"] * tier.plan.unit_bytes(HOST_CHECKPOINTS))
    assert snap.bytes_to_host == (snap.moved_to_host["pages"] * tier.plan.unit_bytes(HOST_PAGES)
                                  + snap.moved_to_host["checkpoints"] * tier.plan.unit_bytes(HOST_CHECKPOINTS))
    assert snap.moved_to_device["pages"] == snap.hits["restored_pages"] > 0
    # the clock charged every restore: its modeled seconds, at least bytes / measured bandwidth
    assert sim.host_clock.restore_s == pytest.approx(tier.modeled_seconds["device"], rel=1e-12)
    assert sim.host_clock.restore_s > snap.bytes_to_device / RESTORE_BYTES_PER_S
    assert sim.host_clock.restoring == snap.hits["host_hit_requests"]


def test_restoring_request_waits_exactly_the_modeled_seconds():
    """One request at a time: nothing else can take a pass, so a restoring request's first pass
    starts exactly when its restores (behind the offloads that made room for them) land."""
    _, sim, link = _run(1)
    firsts = sim.host_clock.first_passes
    assert firsts
    alone = 0
    for issued_s, admitted_s, queued_s, restore_s, first_s in firsts.values():
        assert restore_s > 0
        ready_s = issued_s + queued_s + restore_s
        assert first_s == pytest.approx(max(ready_s, admitted_s), rel=1e-9, abs=1e-12)
        if issued_s == admitted_s:   # restored at admission: the pass waited exactly the modeled seconds
            assert first_s - admitted_s == pytest.approx(queued_s + restore_s, rel=1e-9, abs=1e-12)
            assert first_s > admitted_s
            alone += 1
    assert alone > 0
    assert sum(f[3] for f in firsts.values()) == pytest.approx(link.tier.modeled_seconds["device"], rel=1e-12)


def test_without_host_tier_the_same_run_only_hits_device():
    plan = kvatlas.plan("tiny-v4", "72MiB", max_running_requests=4, prefix_checkpoints=2)
    cache = kvatlas.allocate(plan, backend="none")
    sim = Simulator(cache, sessions(**WORKLOAD), time_model=TimeModel(pass_s=0.02, prefill_s_per_token=40e-6))
    sim.run_offline()
    with_host, _, _ = _run(4)
    assert with_host.prefix.stats.hit_tokens > cache.prefix.stats.hit_tokens


ARGS = ["simulate", "tiny-v4", "--memory", "72MiB", "--max-running-requests", "4", "--rate", "6",
        "--duration", "3", "--turns", "3", "--think", "2", "--prompt-len", "uniform:1024:2048",
        "--output-len", "16", "--followup-len", "32", "--no-plot", "--backend", "none"]


def test_cli_reports_host_tier(tmp_path, capsys):
    assert main(ARGS + ["--prefix-checkpoints", "2", "--host-memory", "256MiB", "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("host tier"))
    assert "modeled, no memory" in line and "host 0 " not in line and "restore" in line
    assert "GB/s to device" in out

