"""The vLLM plugin's cost per stats interval at 16 vs 1,024 running requests (target: ratio <= 1.5).

(Its cost on the scheduler's hot path, plugin loaded vs VLLM_PLUGINS=none, is bench/vllm_plugin_cost.py.)

Two of vLLM's own engine cores (0.33 or 0.34, whichever the venv holds) (kvatlas.integrations.vllm: its planner, EngineCore, Scheduler,
KVCacheManager on the CPU, the plugin loaded by vLLM's own plugin loader), the same configuration
(V4-Flash, 120 GiB, max_num_seqs 1,024), one serving 16 decoding requests and one 1,024. What the
plugin does each stats interval (after `Scheduler.make_stats`) is timed: read the census, build the
snapshot, write the board. The two are timed alternately, in rounds, so machine noise lands on
both; the figure is the ratio of medians. Beside it, for scale: vLLM's own `make_stats`, and the
plugin's share of the 1,024-request engine's decode steps' profiled time (the census is counted
from vLLM's state once per refresh interval; nothing on the allocation path is wrapped).

Run in the vLLM venv (tests/vllm_plugin/setup_env.sh):
    .venv-vllm/bin/python bench/vllm_stats_cost.py [--rounds 30] [--reads 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

GIB = 2**30


def serving_engine(requests: int):
    from kvatlas.integrations.vllm import offline as kv
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    eng = kv.build_engine("deepseek-v4-flash", 120 * GIB, max_model_len=8192, max_num_seqs=1024,
                          max_num_batched_tokens=16384)
    for i in range(requests):
        eng.add_request(f"r{i}", [1 + i % 5000] * 300, max_tokens=100_000)
    for _ in range(60):   # admit and prefill every request, then a few decode steps
        eng.step()
        if len(eng.scheduler.running) == requests and all(r.num_output_tokens > 2 for r in eng.scheduler.running):
            break
    assert len(eng.scheduler.running) == requests, len(eng.scheduler.running)
    return eng, vllm_plugin._P.trackers[eng.scheduler]


def per_read(tracker, reads: int) -> float:
    """Seconds per forced refresh (the census has moved: the whole interval's work)."""
    t0 = time.perf_counter()
    for _ in range(reads):
        tracker.last = None
        tracker.refresh()
    return (time.perf_counter() - t0) / reads


def per_make_stats(eng, reads: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reads):
        eng.scheduler.make_stats()
    return (time.perf_counter() - t0) / reads


def profiled_share(eng, steps: int) -> float:
    """Share of the decode steps' profiled time spent in the plugin's own functions (the stats hook
    and, once per refresh interval, the census count)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values())
    ours = sum(v[2] for k, v in stats.items() if any(m in k[0] for m in ("integrations/vllm/census", "integrations/vllm/plugin",
                                                                          "integrations/vllm/ledger", "integrations/boards")))
    return ours / total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    small, t_small = serving_engine(16)
    big, t_big = serving_engine(1024)
    a, b, ms_a, ms_b = [], [], [], []
    for _ in range(args.rounds):
        a.append(per_read(t_small, args.reads))
        b.append(per_read(t_big, args.reads))
        ms_a.append(per_make_stats(small, args.reads // 4))
        ms_b.append(per_make_stats(big, args.reads // 4))
    ra, rb = statistics.median(a), statistics.median(b)
    samples = len(t_big.board.keys) if t_big.board else 0
    print(f"plugin per stats interval: {ra * 1e6:.1f} us at 16 running, {rb * 1e6:.1f} us at 1,024 running "
          f"({samples} samples written): ratio {rb / ra:.3f} (target <= 1.5)")
    print(f"vLLM's own make_stats (the plugin's hook finds the census unchanged between these calls): {statistics.median(ms_a) * 1e6:.1f} us at 16, "
          f"{statistics.median(ms_b) * 1e6:.1f} us at 1,024")
    print(f"the plugin's own functions: {profiled_share(big, args.steps // 2):.2%} of those steps' profiled time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
