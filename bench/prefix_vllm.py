"""Prefix-cache hits beside vLLM's own scheduler and KV cache manager (0.33 or 0.34), on the Mooncake
synthetic trace, V4-Flash, at several budgets, one request at a time and with the trace's
concurrency, in one run.

- vLLM: its real EngineCore, Scheduler (async scheduling) and hybrid KVCacheManager with prefix
  caching on, built offline on CPU by `kvatlas.integrations.vllm.build_engine`; the budget is the
  KV bytes the memory profiler would report (the worker's `determine_available_memory`, the value
  `--kv-cache-memory-bytes` sets), and vLLM's planner turns it into blocks. One run per
  `prefix_cache_retention_interval` (0: only each prompt's replay boundary and shared-prefix
  junctions keep their sliding-window tails; N: also one tail every N tokens; None: a tail at
  every 256-token boundary). Hits are vLLM's own count (`PrefixCacheStats.hits` of the scheduler
  stats, what `vllm:prefix_cache_hits` exports; a preempted request's lookup again is not a hit).
- kvatlas: the plan of bench/prefix_hit.py (25% of the budget in resume points unless
  `--kvatlas-checkpoint-share` says otherwise), bookkeeping only;
  pages shared as they are written (`--kvatlas-share finish` shares them at the request's finish
  instead, as before issue 34). `--hold-for-writers N`: the simulator's cache-aware admission
  (a waiting request whose next pages running requests are writing is passed over for up to N
  passes; default the Simulator's), the concurrent mode's TTFT (mean, p50, p90, on the virtual
  clock) printed beside its hits; vLLM's concurrent rows print theirs too (arrival to the end of
  the pass whose outputs carry the request's first token, on the same clock). Queue-aware
  eviction on (the Simulator's default: arrivals enqueued with the prefix cache, whose eviction
  keeps what waiting requests would hit; `--no-kvatlas-queue-aware-eviction` turns it off).
- vLLM as shipped: `VLLM_PLUGINS` is set empty before vLLM is imported, so no plugin installed in
  the venv (kvatlas's own among them) loads inside the vLLM side. vLLM 0.34's
  `cache_aware_admission_window` (`--admission-window N`, 0.34 only; its threshold left at its
  default) runs as further settings beside the retention intervals; kvatlas's own prefix-first
  admission (`--kvatlas-admission-window W`, `Simulator(admission_window=W)`) is the same rule on
  its side, so each window is compared like for like. The offline builder
  (`kvatlas.integrations.vllm.offline.build_engine`) builds 0.33 and 0.34 engine cores.
- The bound: the most any prefix cache can hit on the trace (unbounded memory, one request at a
  time, whole 512-token blocks, a token left to compute), printed beside every budget, with
  kvatlas's share of it.

Both see the same content: vLLM gets each prompt's token ids from the trace's block ids
(`Request.token_ids()`, kvatlas.driving.content), kvatlas the same tokens (concurrent) or the page
keys of the same blocks (sequential, as prefix_hit.py). Modes:

- sequential: a request is added and run to completion before the next (vLLM: add, step until
  done; kvatlas: prefix_hit.simulate's kvatlas policy);
- concurrent: requests join at their arrival times on a virtual clock that each forward pass
  advances by the time model (default: 20 ms + 40 µs per prefill token + 100 µs per decode
  token), counted from what the pass computes: vLLM's SchedulerOutput (tokens of requests still
  in their prompt, or recomputing, are prefill; one token of a request past its prompt is
  decode), kvatlas's Simulator (its own passes).

The same serving limits for both: 256 running requests (vLLM's max_num_seqs default, kvatlas's
max_running_requests; `--max-running N` sets both), 8,192 tokens per pass (max_num_batched_tokens, chunked prefill on;
chunked_prefill_tokens), max_model_len the model's (1,048,576), no speculative decoding.
Hit ratio: hit prompt tokens / prompt tokens, and in 512-token blocks (hit tokens / 512 over the
trace's blocks) as prefix_hit.py counts it.

    .venv-vllm/bin/python bench/prefix_vllm.py [--budgets 16,32,64,120] [--retention 0,4096,8192,16384,None]
        [--modes sequential,concurrent] [--engines kvatlas,vllm] [--admission-window 0,64] [--kvatlas-admission-window W] [--hold-for-writers N]
        [--max-running N] [--limit N] [--json FILE]
    .venv-vllm/bin/python bench/prefix_vllm.py --merge A.json B.json ...   (runs made apart, one table)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import prefix_hit

import kvatlas
from kvatlas.driving.sim import Simulator
from kvatlas.driving.timemodel import TimeModel, default_time_model
from kvatlas.driving.traces import read_trace

MODEL = "deepseek-v4-flash"
SERVING = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True}
RETENTION = "0,4096,8192,16384,None"
GOAL = 1.1


def load(path: Path, limit: int):
    trace = prefix_hit.load(path)
    requests, bad = read_trace(str(path))
    assert not bad and [r.id for r in requests] == [f"line{i + 1}" for i in range(len(trace))], "trace order"
    if limit:
        trace, requests = trace[:limit], requests[:limit]
    return trace, requests


# ---- kvatlas ---------------------------------------------------------------------------------

def kvatlas_sequential(p, trace, reuse: float | None = None) -> dict:
    hits = np.zeros(len(trace), np.int64)
    r = prefix_hit.simulate(p, "kvatlas", trace, on_admit=hits.__setitem__, reuse_weight=reuse)
    return {"hits": hits, "seconds": r["seconds"], "missed_tokens": r["missed_tokens"]}


def kvatlas_concurrent(p, requests, tm: TimeModel, share: str = "written", hold: int | None = None,
                       window: int | None = None, reuse: float | None = None, queue_aware: bool = True,
                       cache=None) -> dict:
    """cache: one the caller allocated (backend "none"; its calls may be wrapped: the other
    prefix benches change what eviction or admission does), else one of plan p."""
    if cache is None:
        cache = kvatlas.allocate(p, backend="none", **({} if reuse is None else {"prefix_reuse_weight": reuse}))
    cache.prefix.share_as_written = share == "written"
    index = {r.id: i for i, r in enumerate(requests)}
    hits = np.zeros(len(requests), np.int64)
    admitted, finished = np.zeros_like(hits), np.zeros_like(hits)   # the pass of each (passes before it)
    admit, finish = cache.admit, cache.finish

    def admit_recorded(rid, *args, **kwargs):
        adm = admit(rid, *args, **kwargs)
        hits[index[rid]], admitted[index[rid]] = adm.cached_tokens, sim.stats.steps
        return adm

    def finish_recorded(rid, *args, **kwargs):
        finished[index[rid]] = sim.stats.steps
        return finish(rid, *args, **kwargs)

    cache.admit, cache.finish = admit_recorded, finish_recorded
    sim = Simulator(cache, requests, record=False, time_model=tm, **({} if hold is None else {"hold_for_writers": hold}),
                    **({} if window is None else {"admission_window": window}), queue_aware_eviction=queue_aware)
    t0 = time.perf_counter()
    sim.run_offline()
    cache.check_integrity()
    s = cache.prefix.stats
    assert s.hit_tokens == hits.sum() and s.queried_tokens == s.hit_tokens + sum(s.missed().values())
    ttft = sim.latency.summary()["all"]["ttft_s"]
    return {"hits": hits, "seconds": time.perf_counter() - t0, "missed_tokens": s.missed(),
            "admitted_pass": admitted.tolist(), "finished_pass": finished.tolist(), "passes": sim.stats.steps,
            "peak_running": sim.stats.peak_running, "virtual_s": sim.clock_s, "hold_for_writers": sim.hold_for_writers,
            "held_passes": sim.stats.held_passes, "admission_window": sim.admission_window,
            "reordered_passes": sim.stats.reordered_passes, "writer_points_read": s.writer_points_read,
            "queue_aware_eviction": sim.queue_aware_eviction, "evicted_awaited_pages": s.evicted_awaited_pages,
            "ttft_s": {k: ttft[k] for k in ("mean", "p50", "p90", "p99")}}


# ---- vLLM ------------------------------------------------------------------------------------

class VllmReplay:
    """One vLLM engine core over the trace: per-request hits from the KV cache manager's own
    record of each admission, forward passes from the scheduler's outputs."""

    def __init__(self, budget: int, retention: int | None, requests, tm: TimeModel, window: int = 0) -> None:
        import vllm

        from kvatlas.integrations.vllm import offline as kv
        self.version = vllm.__version__
        self.eng = kv.build_engine(MODEL, budget, prefix_cache_retention_interval=retention, **SERVING)
        if window:   # vLLM 0.34's cache-aware admission
            sched = self.eng.scheduler
            if not hasattr(sched.scheduler_config, "cache_aware_admission_window"):
                raise SystemExit(f"--admission-window: vLLM {self.version} has no cache_aware_admission_window (0.34+)")
            # the scheduler copies the window from its config when it is built (as `cache_aware_window`,
            # 0 unless prefix caching is on and the policy FCFS): set both, and check it took
            sched.scheduler_config.cache_aware_admission_window = window
            if not hasattr(sched, "cache_aware_window"):
                raise SystemExit(f"--admission-window: vLLM {self.version}'s scheduler keeps no cache_aware_window")
            sched.cache_aware_window = window
        logging.getLogger("vllm").setLevel(logging.WARNING)   # no per-request log lines
        self.requests, self.tm = requests, tm
        self.index = {r.id: i for i, r in enumerate(requests)}
        self.hits = np.full(len(requests), -1, np.int64)
        self.passes = self.prefill_tokens = self.decode_tokens = self.preempted_lookups = 0
        self.stats_hits = self.stats_queries = 0
        self.pending_s = 0.0        # pass time of the batches scheduled since the clock last moved
        self.first_s = np.full(len(requests), np.nan)   # virtual time of each request's first output token
        self._firsts: list = []     # requests whose first token the last step put out
        self._hook()

    def _hook(self) -> None:
        mgr, sched = self.eng.kv_cache_manager, self.eng.scheduler
        record, schedule = mgr.record_prefix_cache_stats, sched.schedule

        def recorded(request, num_hits):
            if request.num_preemptions > 0:
                self.preempted_lookups += 1
            else:
                self.hits[self.index[request.request_id]] = num_hits
            return record(request, num_hits)

        def scheduled(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._count_pass(out)
            return out

        mgr.record_prefix_cache_stats = recorded
        sched.schedule = scheduled

    def _count_pass(self, so) -> None:
        if so.total_num_scheduled_tokens == 0:
            return
        before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        prefill = decode = 0
        for rid, n in so.num_scheduled_tokens.items():
            if n == 1 and before[rid] >= self.requests[self.index[rid]].prompt_tokens:
                decode += 1
            else:
                prefill += n
        self.passes += 1
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.pending_s += self.tm.pass_time_s(prefill, decode)

    def _add(self, r) -> None:
        self.eng.add_request(r.id, r.token_ids().tolist(), r.output_tokens)

    def _step(self) -> None:
        self.eng.step()
        for out in self.eng.outputs:   # the scheduler stats a stat logger would get
            st = out.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                self.stats_hits += st.prefix_cache_stats.hits
                self.stats_queries += st.prefix_cache_stats.queries
            for o in out.outputs:
                i = self.index[o.request_id]
                if o.new_token_ids and np.isnan(self.first_s[i]):
                    self.first_s[i] = -1.0   # (its time: the clock once the pass is counted, concurrent)
                    self._firsts.append(i)
        self.eng.outputs.clear()

    def sequential(self) -> dict:
        t0 = time.perf_counter()
        for r in self.requests:
            self._add(r)
            while self.eng.has_requests():
                self._step()
        return self._result(t0)

    def concurrent(self) -> dict:
        t0, clock, i, n = time.perf_counter(), 0.0, 0, len(self.requests)
        eng = self.eng
        while i < n or eng.has_requests():
            if not eng.has_requests():
                clock = max(clock, self.requests[i].arrival_s)
            while i < n and self.requests[i].arrival_s <= clock:
                self._add(self.requests[i])
                i += 1
            self.pending_s = 0.0
            self._step()
            queue = eng.core.batch_queue
            # a step that scheduled nothing while nothing is in flight: an idle pass, so that time moves
            clock += self.pending_s or (0.0 if queue else self.tm.pass_s)
            for j in self._firsts:   # the first token comes out at the end of the pass that made it
                self.first_s[j] = clock
            self._firsts.clear()
        out = self._result(t0)
        out["virtual_s"] = clock
        ttft = self.first_s - np.array([r.arrival_s for r in self.requests])
        assert not np.isnan(ttft).any(), "a request never put out a token"
        out["ttft_s"] = {"mean": float(ttft.mean()), **{f"p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)}}
        return out

    def _result(self, t0: float) -> dict:
        assert (self.hits >= 0).all(), "a request was never admitted"
        assert self.stats_hits == self.hits.sum(), (self.stats_hits, int(self.hits.sum()))
        assert self.stats_queries == sum(r.prompt_tokens for r in self.requests)
        cfg = self.eng.kv_cache_config
        return {"hits": self.hits, "seconds": time.perf_counter() - t0, "passes": self.passes,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "preempted_lookups": self.preempted_lookups, "num_blocks": cfg.num_blocks,
                "block_bytes": cfg.kv_cache_tensors[0].block_stride}



# ---- the run ---------------------------------------------------------------------------------

def run_budget(gib: int, trace, requests, retentions, modes, engines, tm, rows: list, save, windows=(0,),
               share: str = "written", hold: int | None = None, kv_window: int | None = None,
               checkpoint_share: float = 0.25, online_c128: bool = False, queue_aware: bool = True) -> None:
    """Every run at one budget, appended to rows; save() after each (a long run keeps what it has)."""
    p = prefix_hit.make_plan(gib, checkpoint_share, max_running_requests=SERVING["max_num_seqs"],
                             **(dict(online_c128=True) if online_c128 else {}))
    for mode in modes:
        if "kvatlas" in engines:
            r = kvatlas_sequential(p, trace) if mode == "sequential" else \
                kvatlas_concurrent(p, requests, tm, share, hold, kv_window, queue_aware=queue_aware)
            r.update(engine="kvatlas", retention=None, prefix_checkpoints=p.options.prefix_checkpoints, share=share)
            rows.append(finish_row(r, gib, mode, requests))
            save()
        if "vllm" in engines:
            for window in windows:
                for ret in retentions:
                    replay = VllmReplay(gib << 30, ret, requests, tm, window)
                    r = replay.sequential() if mode == "sequential" else replay.concurrent()
                    r.update(engine="vllm", retention=ret, version=replay.version, window=window)
                    rows.append(finish_row(r, gib, mode, requests))
                    save()
                    del replay


def setting(r: dict) -> str:
    """A vLLM run's settings, short: version, retention interval, admission window."""
    return f"{r.get('version', '0.33.0')} ret {r['retention']}" + (f" win {r['window']}" if r.get("window") else "")


def finish_row(r: dict, gib: int, mode: str, requests) -> dict:
    prompt = sum(x.prompt_tokens for x in requests)
    blocks = sum(-(-x.prompt_tokens // 512) for x in requests)
    hits = np.asarray(r.pop("hits"))
    r.update(budget_gib=gib, mode=mode, max_running=SERVING["max_num_seqs"], hit_tokens=int(hits.sum()),
             prompt_tokens=prompt, blocks=blocks,
             hit_ratio=float(hits.sum() / prompt), hit_ratio_blocks=float(hits.sum() / 512 / blocks),
             hits=hits.tolist())
    name = "kvatlas" if r["engine"] == "kvatlas" else f"vLLM {setting(r)}"
    extra = f", {r['passes']} passes" if "passes" in r else ""
    extra += (f", TTFT mean {r['ttft_s']['mean']:.2f} s p50 {r['ttft_s']['p50']:.2f} s p90 {r['ttft_s']['p90']:.2f} s"
              if "ttft_s" in r else "")
    extra += f", {r['preempted_lookups']} lookups after preemption" if r.get("preempted_lookups") else ""
    extra += f", {SERVING['max_num_seqs']} running at most" if SERVING["max_num_seqs"] != 256 else ""
    print(f"{gib:>4} GiB {mode:>10} {name:>26}: hit {r['hit_ratio']:7.2%} of prompt tokens, "
          f"{r['hit_ratio_blocks']:7.2%} in blocks  ({r['seconds']:.0f} s{extra})", flush=True)
    return r


def summary(rows: list[dict]) -> list[dict]:
    """Per budget and mode: kvatlas beside vLLM's best retention setting."""
    out = []
    for gib, mode in sorted({(r["budget_gib"], r["mode"]) for r in rows}, key=lambda k: (k[0], k[1] != "sequential")):
        group = [r for r in rows if r["budget_gib"] == gib and r["mode"] == mode]
        ours = [r for r in group if r["engine"] == "kvatlas"]
        theirs = [r for r in group if r["engine"] == "vllm"]
        if not ours or not theirs:
            continue
        best = max(theirs, key=lambda r: r["hit_tokens"])
        k = ours[0]
        seq = [r for r in rows if r["budget_gib"] == gib and r["mode"] == "sequential" and r["engine"] == "kvatlas"]
        out.append({"budget_gib": gib, "mode": mode, "kvatlas": k, "vllm": theirs, "best": best,
                    "points_from_sequential": 100 * (k["hit_ratio"] - seq[0]["hit_ratio"]) if seq else None,
                    "ratio": k["hit_tokens"] / best["hit_tokens"] if best["hit_tokens"] else float("inf")})
    return out


def table(rows: list[dict], bound: float | None) -> None:
    """bound: the trace's (hit ratio in prompt tokens), beside every budget; the goal is met at 1.1×
    vLLM's best or at 98% of the bound where 1.1× lies above it."""
    print("| budget | mode | kvatlas hit (tokens / blocks) | points from sequential | vLLM by setting (tokens) "
          "| vLLM best | kvatlas / vLLM best | bound | kvatlas / bound | run time kvatlas / vLLM runs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summary(rows):
        k, b = s["kvatlas"], s["best"]
        each = ", ".join(f"{setting(r)}: {r['hit_ratio']:.2%}" for r in s["vllm"])
        times = f"{k['seconds']:.0f} s / " + ", ".join(f"{r['seconds']:.0f}" for r in s["vllm"]) + " s"
        of_bound = k["hit_ratio"] / bound if bound else None
        met = s["ratio"] >= GOAL or (of_bound is not None and of_bound >= 0.98 and GOAL * b["hit_ratio"] > bound)
        ok = "" if met else " (short of the goal)"
        d = s["points_from_sequential"]
        print(f"| {s['budget_gib']} GiB | {s['mode']} | {k['hit_ratio']:.2%} / {k['hit_ratio_blocks']:.2%} "
              f"| {'' if d is None else f'{d:+.2f}'} | {each} "
              f"| {setting(b)}: {b['hit_ratio']:.2%} / {b['hit_ratio_blocks']:.2%} | {s['ratio']:.2f}×{ok} "
              f"| {'' if bound is None else f'{bound:.2%}'} | {'' if of_bound is None else f'{of_bound:.3f}'} "
              f"| {times} |")


def reachable(hash_ids, admitted, finished) -> tuple[np.ndarray, np.ndarray]:
    """Per request (in admission order, the trace's), the 512-token blocks of its prompt that
    earlier requests hold: (in one that finished before it was admitted, in one admitted before
    it). The first is all a cache publishing at finish can hit; the second, what one that
    publishes while a request runs can (vLLM caches blocks as soon as they are scheduled)."""
    tree: dict = {}    # (parent node, block id) -> [node, first finish pass, first admission pass]
    done, seen = np.zeros(len(hash_ids), np.int64), np.zeros(len(hash_ids), np.int64)
    for j, ids in enumerate(hash_ids):
        node, path = 0, []
        for b in ids:
            entry = tree.get((node, b))
            if entry is None:
                break
            path.append(entry)
            node = entry[0]
        done[j] = sum(1 for e in path if e[1] < admitted[j])   # first finish is monotone along a path
        seen[j] = len(path)
        node = 0
        for b in ids:
            entry = tree.setdefault((node, b), [len(tree) + 1, finished[j], admitted[j]])
            entry[1] = min(entry[1], finished[j])
            node = entry[0]
    return done, seen


def gaps(rows: list[dict], trace_path: Path) -> None:
    """Where vLLM's best setting hits deeper than kvatlas: how many requests and tokens, and how
    much of that lay only in requests still running when kvatlas admitted the request."""
    lines = [json.loads(line) for line in trace_path.read_text().splitlines()]
    for s in summary(rows):
        k, b = np.asarray(s["kvatlas"]["hits"]), np.asarray(s["best"]["hits"])
        more, less = b > k, k > b
        line = (f"{s['budget_gib']} GiB {s['mode']}: vLLM ({setting(s['best'])}) deeper on {more.sum()} requests "
                f"(+{int((b - k)[more].sum()):,} tokens), kvatlas deeper on {less.sum()} "
                f"(+{int((k - b)[less].sum()):,} tokens)")
        kv = s["kvatlas"]
        if "admitted_pass" in kv:
            n = len(k)
            done, seen = reachable([x["hash_ids"] for x in lines[:n]], kv["admitted_pass"], kv["finished_pass"])
            cap = (np.array([x["input_length"] for x in lines[:n]]) - 1) // 256 * 256   # a hit leaves a token
            done, seen = np.minimum(done * 512, cap), np.minimum(seen * 512, cap)
            running_only = np.clip(np.minimum(b, seen) - np.maximum(k, done), 0, None)
            line += (f"; of vLLM's extra, {int(running_only[more].sum()):,} tokens were held only by requests still "
                     f"running when kvatlas admitted it; such tokens over all requests: {int((seen - done).sum()):,} "
                     f"({(seen - done).sum() / kv['prompt_tokens']:.2%} of prompt tokens)")
        print(line + f"; kvatlas misses: {kv['missed_tokens']}")


def ceiling(path: Path, block: int = 512) -> tuple[float, float]:
    """The most any prefix cache can hit on the trace, one request at a time with unbounded
    memory: per request, its leading whole blocks whose content (a block id, chained over its
    prefix) an earlier request had, at least one prompt token left to compute. (hit ratio in
    prompt tokens, in blocks)."""
    seen: set = set()
    tokens = blocks = hit = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            ids, n = r["hash_ids"], int(r["input_length"])
            k = 0
            while k < len(ids) and ids[k] in seen:
                k += 1
            hit += min(k, (n - 1) // block)
            tokens, blocks = tokens + n, blocks + len(ids)
            seen.update(ids)
    return hit * block / tokens, hit / blocks


def parse_retention(text: str) -> list[int | None]:
    return [None if x.strip() == "None" else int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=prefix_hit.TRACE)
    ap.add_argument("--budgets", default="16,32,64,120")
    ap.add_argument("--retention", default=RETENTION, help="vLLM prefix_cache_retention_interval values (None: all)")
    ap.add_argument("--modes", default="sequential,concurrent")
    ap.add_argument("--engines", default="kvatlas,vllm")
    ap.add_argument("--admission-window", default="0",
                    help="vLLM 0.34 cache_aware_admission_window values, each run with every retention (0: off)")
    ap.add_argument("--kvatlas-share", default="written", choices=("written", "finish"),
                    help="kvatlas shares a request's pages as they are written (default) or at its finish")
    ap.add_argument("--hold-for-writers", type=int, default=None,
                    help="kvatlas's cache-aware admission: passes a waiting request may be passed over while running "
                         "requests write the pages right past its cached prefix (default: the Simulator's)")
    ap.add_argument("--kvatlas-admission-window", type=int, default=None,
                    help="kvatlas's prefix-first admission: waiting requests at the head of the queue ordered by "
                         "cached prefix, as vLLM 0.34's cache_aware_admission_window (default: the Simulator's)")
    ap.add_argument("--kvatlas-checkpoint-share", type=float, default=0.25,
                    help="kvatlas's resume points as a share of each budget (default 0.25; `kvatlas simulate "
                         "--prefix-checkpoints fit` fits it to a workload)")
    ap.add_argument("--kvatlas-online-c128", action="store_true",
                    help="kvatlas keeps C128 compressor state as one running max/sum/kv row per layer (122,880 B a "
                         "request slot instead of a 128-row ring's 10,485,760 B; vLLM has no such mode)")
    ap.add_argument("--kvatlas-queue-aware-eviction", action=argparse.BooleanOptionalAction, default=True,
                    help="kvatlas's simulator enqueues arrivals with the prefix cache, whose eviction keeps what "
                         "waiting requests would hit (default on; --no-kvatlas-queue-aware-eviction: as before)")
    ap.add_argument("--vllm-plugins", default="",
                    help="VLLM_PLUGINS for the vLLM side (default empty: vLLM as shipped, no plugin loads)")
    ap.add_argument("--max-running", type=int, default=SERVING["max_num_seqs"],
                    help="running requests at most, for both: vLLM's max_num_seqs and kvatlas's max_running_requests "
                         f"(default {SERVING['max_num_seqs']}, vLLM's default)")
    ap.add_argument("--limit", type=int, default=0, help="first N requests only (0: all)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--merge", type=Path, nargs="+", help="print the table of earlier --json runs")
    args = ap.parse_args()
    os.environ["VLLM_PLUGINS"] = args.vllm_plugins   # before vLLM is imported (build_engine imports it)
    if args.max_running < 1:
        ap.error(f"--max-running: {args.max_running} is not a count of requests; give 1 or more")
    SERVING["max_num_seqs"] = args.max_running
    if args.merge:
        rows = [r for p in args.merge for r in json.loads(p.read_text())["results"]]
    else:
        trace, requests = load(args.trace, args.limit)
        tm = default_time_model()
        print(f"{len(requests)} requests, {sum(r.prompt_tokens for r in requests):,} prompt tokens; {tm.describe()}")
        rows: list[dict] = []

        def save() -> None:
            if args.json:
                args.json.write_text(json.dumps({"time_model": tm.describe(), "serving": SERVING, "results": rows}))

        for gib in (int(x) for x in args.budgets.split(",")):
            run_budget(gib, trace, requests, parse_retention(args.retention), args.modes.split(","),
                       args.engines.split(","), tm, rows, save, [int(x) for x in args.admission_window.split(",")],
                       args.kvatlas_share, args.hold_for_writers, args.kvatlas_admission_window,
                       args.kvatlas_checkpoint_share, args.kvatlas_online_c128, args.kvatlas_queue_aware_eviction)
    tok = blk = None
    if not args.limit:
        tok, blk = ceiling(args.trace)
    table(rows, tok)
    gaps(rows, args.trace)
    if tok is not None:
        print(f"the most any cache can hit on this trace (unbounded memory, one request at a time, whole blocks): "
              f"{tok:.2%} of prompt tokens, {blk:.2%} in blocks")


if __name__ == "__main__":
    main()
