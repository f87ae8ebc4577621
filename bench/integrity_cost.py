"""What `kvatlas simulate --check-integrity` costs: the same run with and without it, as CPU time
(issue 38: it took about 1,700 s of CPU on the Mooncake trace at 64 GiB, where the run alone takes
a minute or two).

    python bench/integrity_cost.py --trace mooncake_synthetic.jsonl [--memory 64GiB] [--rounds 2]
                                   [--prefix-checkpoints N] [--json FILE]

Each round runs the command twice in child processes, without and then with --check-integrity
(bookkeeping backend, no plot), and reads each child's user + system CPU seconds from
getrusage; the ratio with/without is taken per round (the baseline is measured in the same
round, on the same machine). The figures and the command are printed; the simulate summary's
"forward passes" line is the same for both (the debug mode only reads).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str]) -> tuple[float, float, str]:
    c0, w0 = child_cpu_s(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return child_cpu_s() - c0, time.perf_counter() - w0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="a Mooncake-format JSONL trace")
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--memory", default="64GiB")
    ap.add_argument("--prefix-checkpoints", default=None, help="passed to simulate when given")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = [sys.executable, "-m", "kvatlas", "simulate", args.model, "--memory", args.memory, "--backend", "none",
                "--workload", args.trace, "--no-plot", "--out", os.path.join(tmp, "run")]
        if args.prefix_checkpoints is not None:
            base += ["--prefix-checkpoints", args.prefix_checkpoints]
        for _ in range(args.rounds):
            plain_cpu, plain_wall, plain_out = run(base)
            checked_cpu, checked_wall, checked_out = run(base + ["--check-integrity"])
            passes = [ln for ln in plain_out.splitlines() if "forward passes" in ln]
            same = passes == [ln for ln in checked_out.splitlines() if "forward passes" in ln]
            recounts = [ln for ln in checked_out.splitlines() if "whole recounts" in ln]
            rows.append({"plain_cpu_s": plain_cpu, "checked_cpu_s": checked_cpu, "plain_wall_s": plain_wall,
                         "checked_wall_s": checked_wall, "ratio": checked_cpu / plain_cpu, "same_passes": same,
                         "passes": passes[0] if passes else "", "integrity": recounts[0] if recounts else ""})
            print(f"without {plain_cpu:.1f} s CPU, with --check-integrity {checked_cpu:.1f} s CPU: "
                  f"{checked_cpu / plain_cpu:.2f}x; {rows[-1]['passes']}; {rows[-1]['integrity']}", flush=True)
    out = {"command": " ".join(base[1:]), "rounds": rows, "max_ratio": max(r["ratio"] for r in rows)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if all(r["same_passes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
