"""What the eviction's credit for reuse is worth (`kvatlas.prefix.tree`, `reuse_weight`): kvatlas's
prefix cache on the shared Mooncake trace at each budget, sequential and concurrent, once per weight,
in one run; each weight's hit ratio in prompt tokens against weight 0 (plain LRU, leaves first) of
the same run. The runs are prefix_vllm.py's kvatlas side (the same plan, time model and simulator;
time is virtual, so every figure is deterministic).

    python bench/prefix_reuse.py --trace ../shared/traces/mooncake_synthetic.jsonl \
        [--budgets 16,32,64,120] [--modes sequential,concurrent] [--weights 0,0.25,0.5,1] \
        [--kvatlas-admission-window 4096]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import prefix_hit
from prefix_vllm import default_time_model, finish_row, kvatlas_concurrent, kvatlas_sequential, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=prefix_hit.TRACE)
    ap.add_argument("--budgets", default="16,32,64,120")
    ap.add_argument("--modes", default="sequential,concurrent")
    ap.add_argument("--weights", default="0,0.25,0.5,1", help="reuse weights, the first the baseline")
    ap.add_argument("--kvatlas-admission-window", type=int, default=None,
                    help="the simulator's prefix-first admission window (default: the Simulator's)")
    args = ap.parse_args()
    weights = [float(w) for w in args.weights.split(",")]
    trace, requests = load(args.trace, 0)
    tm = default_time_model()
    print(f"{len(requests)} requests, {sum(r.prompt_tokens for r in requests):,} prompt tokens; {tm.describe()}")
    print("| budget | mode | " + " | ".join(f"weight {w:g}" for w in weights) + " | best / first |")
    print("|---|---|" + "---|" * len(weights) + "---|")
    for gib in (int(x) for x in args.budgets.split(",")):
        p = prefix_hit.make_plan(gib, 0.25)
        for mode in args.modes.split(","):
            ratios = []
            for w in weights:
                r = (kvatlas_sequential(p, trace, reuse=w) if mode == "sequential" else
                     kvatlas_concurrent(p, requests, tm, window=args.kvatlas_admission_window, reuse=w))
                r.update(engine="kvatlas", retention=None)
                ratios.append(finish_row(r, gib, mode, requests)["hit_ratio"])
            best = max(ratios)
            cells = " | ".join(f"**{x:.2%}**" if x == best else f"{x:.2%}" for x in ratios)
            print(f"| {gib} GiB | {mode} | {cells} | {best / ratios[0]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
