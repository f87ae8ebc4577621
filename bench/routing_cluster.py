"""Routing policies side by side on N vLLM engine cores (the issue-36 harness).

Each replica is vLLM's real engine core (0.33 or 0.34, whichever the Python running this has) (its scheduler, hybrid KV cache manager and ZMQ
KV-event publisher with a replay socket, on loopback), built offline on the CPU by
`kvatlas.integrations.vllm.replica.ReplicaServer`: all in this process by default (one import of
vLLM, what a 2-core machine affords), each in a process of its own with `--processes`. Either way the
router learns what a replica holds only from the events it publishes. The router is kvatlas.routing: one `Fleet`
subscribing to every replica's events, one `PrefixIndex`, and the policy under test choosing a
replica for each request of the Mooncake trace at its timestamp.

Time is virtual (a discrete-event run, so the shared CPU's speed does not bend the results): each
replica's forward pass takes the time model's time for the tokens it computes (kvatlas's default:
20 ms + 40 µs per prefill token + 100 µs per decode token; hit tokens cost nothing); requests
arrive at their trace times. A pass runs when its replica is free; its events are published when
it runs, and before routing a request the router waits until its subscribers have applied every
batch the replicas published (a bounded wait; what is still missing is counted as event lag).

Per policy and N: cluster hit ratio (the engines' own `num_local_cached_tokens` per request, over
prompt tokens), load balance (max/mean of the replicas' running requests, sampled at each arrival
when any runs; and of requests assigned), mean TTFT (virtual), and prediction exactness: kvatlas's
predicted device tokens for the chosen replica (resident at routing time) against what the engine
then reported, under every policy, and the same for what it expected including the prefixes in
flight there (the prompts sent to that replica and not finished, `kvatlas.routing.inflight`); a miss
of the first is classified: `lag` (the index was behind vLLM's own answer at routing time),
`in_flight_prefix` (right at routing time; the engine then resumed from the end of a prompt in
flight there, as expected), `admission` (right at routing time; the cache changed otherwise before
the request was scheduled: a follower admitted in the same step as its writer's last chunk, an
eviction), `wrong`. Beside it the full group's prefix (what main_group_prefix scores) against the
same report, and how often it promised more than came.

    .venv-vllm/bin/python bench/routing_cluster.py --trace TRACE.jsonl [--start 0] [--requests 100]
        [--replicas 2,4,8] [--budgets 32GiB,64GiB] [--max-tokens 16] [--processes] [--json FILE]
        [--policies kvatlas,main_group_prefix,round_robin,least_loaded,oracle]
        [--variant kvatlas:in_flight_prefix=0,waiting=2048 ...]   (a policy with Weights changed: a sweep)

The N = 2 and 4 runs use the first replicas of the N = 8 set (each emptied, `reset_prefix_cache`, and
the index with it, before every run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import numpy as np

from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace
from kvatlas.routing import Fleet, InFlightPrefixes, PrefixIndex, ReplicaLoad, Weights, groups_from_metadata, make_policy

MODEL = "deepseek-v4-flash"
SERVING = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "async_scheduling": False,
           "max_model_len": 196_608}
POLICIES = "kvatlas,main_group_prefix,round_robin,least_loaded,oracle"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One replica: a `ReplicaServer` in this process (default: one import of vLLM for all, what 2
    shared cores afford) or in a process of its own (`--processes`); either way its events go out
    through vLLM's own ZMQ publisher on loopback and reach the router only that way."""

    def __init__(self, name: str, memory: str, own_process: bool) -> None:
        from kvatlas.integrations.vllm.replica import ReplicaServer, serve_replica
        self.name = name
        port, replay = free_port(), free_port()
        self.endpoint, self.replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
        self.server = self.conn = self.proc = None
        if own_process:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=serve_replica, daemon=True,
                                    args=(child, MODEL, memory, self.endpoint, self.replay, SERVING))
            self.proc.start()
        else:
            self.server = ReplicaServer(MODEL, memory, self.endpoint, self.replay, SERVING)
        self.metadata = None
        self.published = 0
        self.status = {"running": 0, "waiting": 0}

    def ready(self) -> None:
        if self.server is not None:
            self.metadata = self.server.metadata
            return
        tag, self.metadata = self.conn.recv()
        assert tag == "ready"

    def call(self, *msg):
        if self.server is not None:
            return self.server.handle(*msg)
        self.conn.send(msg)
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.call("stop")
        except (EOFError, OSError):
            pass
        if self.proc is not None:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def _seq(sub) -> int:
    last = sub.stats().last_seq
    return -1 if last is None else last


def caught_up(fleet: Fleet, replicas, timeout_s: float = 2.0) -> bool:
    """Wait until every subscriber applied every batch its replica published."""
    subs = {s.replica: s for s in fleet.subscribers()}
    deadline = time.monotonic() + timeout_s
    while True:
        if all(_seq(subs[r.name]) >= r.published - 1 for r in replicas):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def run_policy(name: str, replicas, fleet: Fleet, index: PrefixIndex, requests, max_tokens: int,
               weights: Weights | None = None, hold_s: float = 0.0) -> dict:
    for r in replicas:
        ok, r.published = r.call("reset")
        assert ok, f"{r.name}: reset_prefix_cache refused"
        r.status = {"running": 0, "waiting": 0}
    assert caught_up(fleet, replicas, 30.0), ("the index did not see the resets", [r.published for r in replicas], fleet.state()["subscribers"])
    for r in replicas:
        index.clear(r.name)
        index.mark_stale(r.name, 0, None)
    by_name = {r.name: r for r in replicas}
    oracle = (lambda rep, tokens: by_name[rep].call("hit", tokens)) if name == "oracle" else None
    now = [0.0]                       # the virtual clock, for the prefixes in flight (their timeout)
    # the prompts sent and not finished, under every policy (the exactness accounting's "expected
    # incl. in flight"); kvatlas and oracle score from the same object
    in_flight_prefixes = InFlightPrefixes(index.rule.align_tokens, clock=lambda: now[0])
    policy = make_policy(name, index=index, oracle=oracle, weights=weights, in_flight=in_flight_prefixes)
    holds = hold_s > 0 and name in ("kvatlas", "oracle")     # the policies that count prefixes in flight
    tm = default_time_model()
    free_at = {r.name: 0.0 for r in replicas}
    work = {r.name: False for r in replicas}
    in_flight = {r.name: 0 for r in replicas}
    rec, where, arrival, first = {}, {}, {}, {}
    held: dict = {}                   # request → (request, tokens, keys, the in-flight end it waits for)
    balance, assigned, lag_waits = [], {r.name: 0 for r in replicas}, 0
    i, clock = 0, 0.0
    wall = time.perf_counter()

    def dispatch(req, tokens, keys, chosen: str) -> None:
        """Send to the engine now; the prediction the exactness counts is made here."""
        p = index.predict(keys, [chosen])[chosen]
        truth = by_name[chosen].call("hit", tokens)
        pending = in_flight_prefixes.expected(keys, [chosen], exclude=held.keys() | {req.id}).get(chosen, (0, 0))[0]
        rec[req.id] = {"prompt": len(tokens), "kvatlas": p.device_tokens, "main": min(p.main_group_tokens, len(tokens)),
                       "expected": max(p.device_tokens, pending), "truth_at_routing": truth, "cached": None,
                       "held_s": clock - arrival[req.id]}
        by_name[chosen].call("add", req.id, tokens, max(1, min(req.output_tokens, max_tokens)))
        work[chosen] = True
        free_at[chosen] = max(free_at[chosen], clock)

    def waits(rid, keys, chosen: str) -> bool:
        """Whether a prompt sent to `chosen` (and not held) shares more of this one than is resident there."""
        pending = in_flight_prefixes.expected(keys, [chosen], exclude=held.keys() | {rid}).get(chosen)
        return pending is not None and pending[0] > index.predict(keys, [chosen])[chosen].device_tokens

    def release(replica: str | None = None) -> None:
        """Held requests (of `replica`, or all) that wait for nothing now or waited `hold_s`, in
        arrival order: one released first is a writer the next may wait for."""
        if not held:
            return
        caught_up(fleet, replicas)
        for rid, (req, tokens, keys) in list(held.items()):
            chosen = where[rid]
            if replica is not None and chosen != replica and clock - arrival[rid] < hold_s:
                continue
            if clock - arrival[rid] >= hold_s or not waits(rid, keys, chosen):
                del held[rid]
                dispatch(req, tokens, keys, chosen)

    while i < len(requests) or any(work.values()) or held:
        busy = [(free_at[n], n) for n, w in work.items() if w]
        t_step, step_name = min(busy) if busy else (float("inf"), None)
        t_arr = requests[i].arrival_s if i < len(requests) else float("inf")
        if t_arr == t_step == float("inf"):     # nothing runs: whatever is held goes
            clock = now[0] = max(clock, min(arrival[rid] for rid in held) + hold_s)
            release()
            continue
        if t_arr <= t_step:
            clock = now[0] = t_arr
            req = requests[i]
            i += 1
            tokens = req.token_ids().tolist()
            if not caught_up(fleet, replicas):
                lag_waits += 1
            release()
            loads = {r.name: ReplicaLoad(in_flight=in_flight[r.name], **r.status) for r in replicas}
            running = [r.status["running"] for r in replicas]
            if sum(running):
                balance.append(max(running) / (sum(running) / len(running)))
            keys = index.keys(tokens)
            choice = policy.choose(tokens if name == "oracle" else keys, loads)[0]
            chosen = choice.replica
            hold = holds and choice.in_flight_tokens > 0 and waits(req.id, keys, chosen)
            in_flight_prefixes.add(chosen, req.id, keys)
            where[req.id], arrival[req.id] = chosen, clock
            assigned[chosen] += 1
            in_flight[chosen] += 1
            if hold:
                held[req.id] = (req, tokens, keys)
            else:
                dispatch(req, tokens, keys, chosen)
        else:
            clock = now[0] = t_step
            r = by_name[step_name]
            out = r.call("step")
            r.published = out["published"]
            r.status = {"running": out["running"], "waiting": out["waiting"]}
            free_at[step_name] = clock + (tm.pass_time_s(out["prefill_tokens"], out["decode_tokens"]) if out["ran"] else 0)
            for rid, cached in out["cached"].items():
                rec[rid]["cached"] = cached
                first[rid] = free_at[step_name]
            for rid in out["finished"]:
                in_flight[where[rid]] -= 1
                in_flight_prefixes.finish(rid)
            work[step_name] = out["running"] + out["waiting"] > 0
            if held:
                release(step_name)
    out = summarize(name, rec, first, arrival, balance, assigned, lag_waits, time.perf_counter() - wall)
    out["rows"] = {rid: {**r, "replica": where[rid], "arrival_s": arrival[rid], "first_s": first.get(rid)}
                   for rid, r in rec.items()}
    return out


def summarize(name, rec, first, arrival, balance, assigned, lag_waits, wall_s) -> dict:
    rows = list(rec.values())
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] or 0 for r in rows)
    out = {"policy": name, "requests": len(rows), "prompt_tokens": prompt, "hit_tokens": cached,
           "hit_ratio": cached / prompt, "balance_running": float(np.mean(balance)) if balance else 1.0,
           "balance_assigned": max(assigned.values()) / (sum(assigned.values()) / len(assigned)),
           "ttft_mean_s": float(np.mean([first[k] - arrival[k] for k in first])) if first else None,
           "lag_waits": lag_waits, "wall_s": wall_s,
           "held": sum(r.get("held_s", 0) > 0 for r in rows),
           "held_mean_s": float(np.mean([r["held_s"] for r in rows if r.get("held_s", 0) > 0] or [0.0]))}
    for who in ("kvatlas", "main", "expected"):
        out[f"{who}_exact"] = sum(r[who] == r["cached"] for r in rows) / len(rows)
    # kvatlas's misses (resident now against what the engine then reported), by cause: `lag` its
    # index differed from vLLM's own answer at routing time and that answer held (events not yet
    # applied); right at routing time but the cache changed before the request was scheduled, either
    # `in_flight_prefix` (the engine resumed from the end of a prompt in flight there, as "expected
    # incl. in flight" said) or `admission` (anything else that changed it: a follower admitted in
    # the same step as its writer's last chunk, an eviction); `wrong` neither
    miss = [r for r in rows if r["kvatlas"] != r["cached"]]
    right_then = [r for r in miss if r["kvatlas"] == r["truth_at_routing"]]
    out["kvatlas_miss"] = {
        "lag": sum(r["kvatlas"] != r["truth_at_routing"] == r["cached"] for r in miss),
        "in_flight_prefix": sum(r["expected"] == r["cached"] for r in right_then),
        "admission": sum(r["expected"] != r["cached"] for r in right_then),
        "wrong": sum(r["kvatlas"] != r["truth_at_routing"] != r["cached"] for r in miss)}
    out["main_over"] = sum(r["main"] > r["cached"] for r in rows)      # main group promised more than came
    return out


def table(results: list[dict]) -> str:
    lines = ["| budget | N | policy | hit ratio | vs oracle | vs main_group | max/mean running | max/mean assigned "
             "| TTFT mean s | kvatlas exact (resident now) | exact incl. in flight | misses lag/in-flight prefix/admission/wrong "
             "| main_group exact (over-promised) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        peers = {x["policy"]: x for x in results if x["budget"] == r["budget"] and x["n"] == r["n"]}
        ratio = lambda other: (f"{r['hit_tokens'] / peers[other]['hit_tokens']:.3f}"
                               if other in peers and peers[other]["hit_tokens"] else "-")
        m = r["kvatlas_miss"]
        lines.append(f"| {r['budget']} | {r['n']} | {r['policy']} | {r['hit_ratio']:.4f} | {ratio('oracle')} | "
                     f"{ratio('main_group_prefix')} | {r['balance_running']:.2f} | {r['balance_assigned']:.2f} | "
                     f"{r['ttft_mean_s']:.2f} | {r['kvatlas_exact']:.3f} | {r['expected_exact']:.3f} | "
                     f"{m['lag']}/{m['in_flight_prefix']}/{m['admission']}/{m['wrong']} | "
                     f"{r['main_exact']:.3f} ({r['main_over']}) |")
    return "\n".join(lines)


def start_fleet(replicas, attempts: int = 10):
    """A fresh index and fleet bound to the replicas' event endpoints. The previous N's fleet bound
    the same ports a moment ago: a bind refused while the old socket is let go is tried again."""
    for attempt in range(attempts):
        index = PrefixIndex(MODEL)
        fleet = Fleet(index)
        for r in replicas:
            fleet.add(r.name, r.endpoint, replay_endpoint=r.replay, idle_probe_s=0.02, bind=True,
                      groups=groups_from_metadata(index.rule, r.metadata))
        fleet.start()
        time.sleep(0.5)
        refused = [s.stats().stale_reason for s in fleet.subscribers()
                   if (s.stats().stale_reason or "").startswith("cannot bind")]
        if not refused:
            return index, fleet
        fleet.stop()
        print(f"fleet: {refused[0]}; trying again", file=sys.stderr)
        time.sleep(1.0 + attempt)
    raise SystemExit(f"could not bind the replicas' event endpoints: {refused}")


def parse_variant(text: str) -> tuple[str, Weights]:
    """"kvatlas:in_flight_prefix=0.5,waiting=2048" → ("kvatlas", Weights(in_flight_prefix=0.5, waiting=2048))."""
    name, _, pairs = text.partition(":")
    fields = {f.name for f in dataclasses.fields(Weights)}
    values = {}
    for pair in filter(None, pairs.split(",")):
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"--variant {text}: {key!r} is not a Weights field (one of {', '.join(sorted(fields))})")
        values[key] = float(value)
    return name, Weights(**values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--start", type=int, default=0, help="the first request of the trace to replay")
    ap.add_argument("--requests", type=int, default=100, help="how many requests from --start")
    ap.add_argument("--processes", action="store_true", help="each replica in a process of its own")
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--budgets", default="32GiB,64GiB")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--max-tokens", type=int, default=16, help="cap on each request's output tokens (CPU time)")
    ap.add_argument("--variant", action="append", default=[], metavar="POLICY:NAME=VALUE,...",
                    help="also run POLICY with these Weights changed (repeat for a sweep), e.g. "
                         "kvatlas:in_flight_prefix=0,waiting=2048")
    ap.add_argument("--hold-s", type=float, default=0.0,
                    help="kvatlas and oracle hold a request whose chosen replica is still computing a prefix it "
                         "extends (a prefix in flight) until that prefix is shown resident or its writer ends, at "
                         "most this many seconds (virtual); 0: send at once")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", action="store_true", help="keep every request's row in the JSON")
    args = ap.parse_args()
    runs = [(name, name, None) for name in args.policies.split(",") if name]
    for v in args.variant:
        runs.append((v, *parse_variant(v)))
    requests, bad = read_trace(str(args.trace))
    assert not bad
    requests = requests[args.start:args.start + args.requests]
    t0 = requests[0].arrival_s if requests else 0.0
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in requests]
    ns = [int(x) for x in args.replicas.split(",")]
    results = []
    for budget in args.budgets.split(","):
        t0 = time.perf_counter()
        replicas = [Replica(f"r{k}", budget, args.processes) for k in range(max(ns))]
        try:
            for r in replicas:
                r.ready()
            print(f"{budget}: {len(replicas)} replicas built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            for n in ns:
                index, fleet = start_fleet(replicas[:n])
                try:
                    for label, name, weights in runs:
                        res = run_policy(name, replicas[:n], fleet, index, requests, args.max_tokens, weights, args.hold_s)
                        res.update(budget=budget, n=n, policy=label, weights=dataclasses.asdict(weights or Weights()))
                        results.append(res)
                        rows = res.pop("rows")
                        if args.rows:
                            res["rows"] = rows
                        print(json.dumps({k: v for k, v in res.items() if k != "rows"}), file=sys.stderr, flush=True)
                finally:
                    fleet.stop()
        finally:
            for r in replicas:
                r.stop()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
