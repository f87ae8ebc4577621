"""Peak memory and time of `kvatlas simulate` against the number of turns per session (issue 22).

    python bench/sim_turns.py [--turns 1,2500,5000,10000] [--rate 4] [--duration 1]

Each point is `kvatlas simulate tiny-v4 --memory 64MiB --max-running-requests 4 --backend none
--rate R --duration D --turns N --no-plot` in a fresh process: its peak resident memory
(ru_maxrss) and wall time. The baseline is the first point (the interpreter, the imports, the
cache and one turn per session); growth is measured above it. Linear growth shows as an
increment per turn that stays put while turns grow (and as an increment ratio equal to the turns
ratio); quadratic growth as one that grows with the turns (each turn k used to hold a copy of all
k previous turns' content).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, resource, sys
from kvatlas.cli import main
rc = main(json.loads(sys.argv[1]))
with open(sys.argv[2], "w") as f:
    json.dump({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, f)
"""


def point(turns: int, rate: float, duration: float, out_dir: str) -> dict:
    argv = ["simulate", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--backend", "none",
            "--rate", str(rate), "--duration", str(duration), "--turns", str(turns), "--seed", "1",
            "--no-plot", "--out", os.path.join(out_dir, f"t{turns}")]
    report = os.path.join(out_dir, f"t{turns}.json")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv), report], check=True, capture_output=True)
    wall = time.perf_counter() - t0
    with open(report) as f:
        r = json.load(f)
    return {"turns": turns, "rc": r["rc"], "rss_mib": r["maxrss_kib"] / 1024, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", default="1,2500,5000,10000")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        pts = [point(int(n), args.rate, args.duration, d) for n in args.turns.split(",")]
    base = pts[0]
    print(f"{'turns':>8} {'peak RSS MiB':>13} {'above base':>11} {'KiB per turn':>13} {'wall s':>8}")
    for p in pts:
        above = p["rss_mib"] - base["rss_mib"]
        per = 1024 * above / (p["turns"] - base["turns"]) if p["turns"] > base["turns"] else float("nan")
        print(f"{p['turns']:>8,} {p['rss_mib']:>13.1f} {above:>11.1f} {per:>13.2f} {p['wall_s']:>8.2f}")
    if len(pts) >= 3:
        a, b = pts[1], pts[-1]
        grow = (b["rss_mib"] - base["rss_mib"]) / max(a["rss_mib"] - base["rss_mib"], 1e-9)
        print(f"growth above base, {b['turns']:,} vs {a['turns']:,} turns: {grow:.2f}x "
              f"(linear: {(b['turns'] - base['turns']) / (a['turns'] - base['turns']):.2f}x)")


if __name__ == "__main__":
    main()
