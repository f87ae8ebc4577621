"""`kvatlas tune` on the whole Mooncake trace (issue 26): what the tuned flags hold against each
engine's defaults, in one run.

    PYTHONPATH=src python3 bench/tune_mooncake.py --trace mooncake_synthetic.jsonl [--tp 4] [--no-simulate]

For DeepSeek-V4-Flash on H200s (KV budget per rank = 0.9 × the GPU less the weights the config
implies at --tp), per engine: the token capacity its pools hold and the requests held at the
trace's p90 and longest context, default flags against tuned flags (the engine models `compare`
uses; tests/sglang_plugin and tests/vllm_plugin check the same figures against the engines' own
code). With the simulator (default on): the trace through kvatlas's bookkeeping cache under its
default flags (no prefix cache) and its tuned flags, the way `kvatlas tune --simulate` does it:
prefix-hit ratio, prompt tokens computed, passes with the queue head waiting, virtual seconds.
Prints one JSON document; every figure is a ratio of two settings measured in this run.
"""

from __future__ import annotations

import argparse
import json
import time

from kvatlas.advice import profile, tune
from kvatlas.driving.measure import measure
from kvatlas.driving.timemodel import default_time_model
from kvatlas.driving.traces import read_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--no-simulate", action="store_true")
    ap.add_argument("--sequential", action="store_true", help="also replay the trace one request after another "
                    "through the tuned plan's prefix cache (bench/prefix_hit.py's replay, SPEC §8's calibration)")
    args = ap.parse_args()
    reqs, _ = read_trace(args.trace)
    tm = default_time_model()
    prof = profile(reqs)
    t = tune("deepseek-v4-flash", prof, tp=args.tp)
    out = {"trace": args.trace, "requests": len(reqs), "tp": args.tp, "budget_bytes": t.budget_bytes,
           "weights_bytes": t.options.weights_bytes, "profile": prof.to_dict()}
    if not args.no_simulate:   # as `tune --simulate`
        w = time.perf_counter()
        default = measure(t.kvatlas_plan("default"), reqs, tm)
        tuned = measure(t.kvatlas_plan("tuned"), reqs, tm)
        out["simulated"] = {"default": default.to_dict(), "tuned": tuned.to_dict(),
                            "wall_s": time.perf_counter() - w}
    if args.sequential:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from prefix_hit import load, simulate
        trace = load(Path(args.trace))
        r = simulate(t.kvatlas_plan("tuned"), "kvatlas", trace)
        blocks = sum(-(-prompt // 512) for prompt, _, _ in trace)
        out["sequential"] = {"hit_ratio_blocks": r["hit_blocks"] / blocks, "hit_blocks": r["hit_blocks"],
                             "blocks": blocks, "evicted_pages": r["evicted_pages"],
                             "evicted_checkpoints": r["evicted_checkpoints"], "seconds": r["seconds"]}
    out["engines"] = [{"engine": e.engine, "command": e.command(),
                       "default_capacity": e.default.token_capacity, "tuned_capacity": e.tuned.token_capacity,
                       "capacity_ratio": e.capacity_ratio,
                       "default_requests_at": e.default.requests_at, "tuned_requests_at": e.tuned.requests_at,
                       "default_reported": e.default.reported, "tuned_reported": e.tuned.reported}
                      for e in t.engines]
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
