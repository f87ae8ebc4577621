"""The kvatlas vLLM plugin's cost on vLLM's hot path: the scheduler's step and `allocate_slots` with
the plugin loaded vs with `VLLM_PLUGINS=none`, on the same load (target: ratio <= 1.05).

The load: the first `--requests` requests of a Mooncake trace (a JSONL of timestamp, input_length,
output_length, hash_ids; its block ids become token ids as kvatlas.driving.content makes them),
replayed on vLLM's own engine core on the CPU (kvatlas.integrations.vllm: its planner, EngineCore,
AsyncScheduler, KVCacheManager with prefix caching, retention interval `--retention`), DeepSeek-V4-
Flash at `--gib` GiB, max_num_seqs 256, 8,192 tokens per pass. Requests join at their arrival
times on a virtual clock that each pass advances by kvatlas's time model (as bench/prefix_vllm.py),
so both modes schedule exactly the same batches (asserted: same steps, same allocate_slots calls,
same prefix hits).

Each mode runs in a fresh process (the plugin is loaded by vLLM's own `load_general_plugins()` in
its engine core, or not at all under `VLLM_PLUGINS=none`), modes alternating off/on for `--rounds`
rounds so machine noise lands on both. Timed in each process by the same wrapper in both modes,
around each call: `Scheduler.schedule` + `Scheduler.update_from_output` (which calls `make_stats`,
where the plugin's hook runs) = the scheduler's step; `KVCacheManager.allocate_slots`. The clock is
the calling thread's CPU time (`time.thread_time`: on a shared machine, time spent waiting for a core
would otherwise dominate, and it lands on either mode at random); the wall-clock step is printed
beside it. With the plugin, the census reads (each O(blocks), at most one per refresh interval of
wall time, and as the scheduler goes idle) are counted and timed. Figures: the ratio of the medians
over rounds, and each round's ratio.

Run in the vLLM venv (tests/vllm_plugin/setup_env.sh), once per vLLM release:
    .venv-vllm/bin/python bench/vllm_plugin_cost.py --trace TRACE.jsonl [--gib 64] [--requests 300]
        [--retention 8192] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GIB = 2**30
SERVING = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True}


def child(args) -> dict:
    """One replay in this process; returns its timings."""
    import logging

    from kvatlas.driving.timemodel import default_time_model
    from kvatlas.driving.traces import read_trace
    from kvatlas.integrations.vllm import offline as kv
    requests, bad = read_trace(args.trace)
    assert not bad, bad[:3]
    requests = requests[:args.requests]
    eng = kv.build_engine("deepseek-v4-flash", args.gib * GIB, prefix_cache_retention_interval=args.retention,
                          **SERVING)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from kvatlas.integrations.vllm import plugin as vllm_plugin
    loaded = vllm_plugin._P.registered and eng.scheduler in vllm_plugin._P.trackers
    tm = default_time_model()
    sched, mgr = eng.scheduler, eng.kv_cache_manager
    spent = {"schedule": 0.0, "update": 0.0, "allocate": 0.0, "step_wall": 0.0, "census": 0.0}
    calls = {"schedule": 0, "allocate": 0, "census": 0}
    prompt = {r.id: r.prompt_tokens for r in requests}
    pending = [0.0]

    def timed(name, fn, counter=None, wall=None):
        def call(*a, **kw):
            w0, t0 = time.perf_counter(), time.thread_time()
            out = fn(*a, **kw)
            spent[name] += time.thread_time() - t0
            if wall:
                spent[wall] += time.perf_counter() - w0
            if counter:
                calls[counter] += 1
            return out
        return call

    schedule = timed("schedule", sched.schedule, "schedule", "step_wall")

    def scheduled(*a, **kw):
        so = schedule(*a, **kw)
        before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        before.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        prefill = sum(n for rid, n in so.num_scheduled_tokens.items() if not (n == 1 and before[rid] >= prompt[rid]))
        decode = sum(1 for rid, n in so.num_scheduled_tokens.items() if n == 1 and before[rid] >= prompt[rid])
        if so.total_num_scheduled_tokens:
            pending[0] += tm.pass_time_s(prefill, decode)
        return so
    sched.schedule = scheduled
    sched.update_from_output = timed("update", sched.update_from_output, wall="step_wall")
    mgr.allocate_slots = timed("allocate", mgr.allocate_slots, "allocate")
    if loaded:   # the plugin's census reads, inside update_from_output's make_stats
        census = vllm_plugin._P.trackers[sched].census
        census.counts = timed("census", census.counts, "census")
    hits = 0
    t0, c0 = time.perf_counter(), time.process_time()
    clock, i, n, steps = 0.0, 0, len(requests), 0
    while i < n or eng.has_requests():
        if not eng.has_requests():
            clock = max(clock, requests[i].arrival_s)
        while i < n and requests[i].arrival_s <= clock:
            r = requests[i]
            eng.add_request(r.id, r.token_ids().tolist(), r.output_tokens)
            i += 1
        pending[0] = 0.0
        eng.step()
        steps += 1
        for out in eng.outputs:
            st = out.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                hits += st.prefix_cache_stats.hits
        eng.outputs.clear()
        clock += pending[0] or (0.0 if eng.core.batch_queue else tm.pass_s)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"vllm": kv.vllm_version(), "plugin_loaded": bool(loaded), "steps": steps, "hits": hits,
            "schedule_calls": calls["schedule"], "allocate_calls": calls["allocate"],
            "scheduler_step_s": spent["schedule"] + spent["update"], "schedule_s": spent["schedule"],
            "update_s": spent["update"], "allocate_s": spent["allocate"], "step_wall_s": spent["step_wall"],
            "census_reads": calls["census"], "census_s": spent["census"], "replay_cpu_s": cpu, "replay_wall_s": wall,
            "num_blocks": eng.kv_cache_config.num_blocks}


def run_mode(args, plugin: bool) -> dict:
    env = dict(os.environ)
    if plugin:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = "none"
    cmd = [sys.executable, __file__, "--child", "--trace", args.trace, "--gib", str(args.gib),
           "--requests", str(args.requests), "--retention", str(args.retention)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["plugin_loaded"] == plugin, got
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="Mooncake trace (JSONL)")
    ap.add_argument("--gib", type=int, default=64)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--retention", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs = {False: [], True: []}
    for _ in range(args.rounds):
        for plugin in (False, True):
            runs[plugin].append(run_mode(args, plugin))
    off, on = runs[False], runs[True]
    same = {k: {r[k] for r in off + on} for k in ("steps", "allocate_calls", "hits", "num_blocks")}
    assert all(len(v) == 1 for v in same.values()), f"the two modes did different work: {same}"
    print(f"vLLM {on[0]['vllm']}, V4-Flash {args.gib} GiB ({on[0]['num_blocks']:,} blocks), {args.requests} Mooncake "
          f"requests, retention {args.retention}: {on[0]['steps']:,} steps, {on[0]['allocate_calls']:,} allocate_slots "
          f"calls, {on[0]['hits']:,} prefix-hit tokens (identical in both modes); {args.rounds} rounds off/on")
    for key, label in (("scheduler_step_s", "scheduler step (schedule + update_from_output), CPU"),
                       ("allocate_s", "allocate_slots, CPU"), ("replay_cpu_s", "whole replay (engine steps), process CPU"),
                       ("step_wall_s", "scheduler step, wall clock"), ("replay_wall_s", "whole replay, wall clock")):
        a, b = statistics.median(r[key] for r in off), statistics.median(r[key] for r in on)
        rounds = ", ".join(f"{y[key] / x[key]:.3f}" for x, y in zip(off, on))
        print(f"  {label}: {a:.3f} s off, {b:.3f} s on: ratio {b / a:.3f} (rounds: {rounds})")
    reads = ", ".join(f"{r['census_reads']} in {r['census_s']:.3f} s" for r in on)
    print(f"  census reads with the plugin (count, CPU s), per round: {reads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
