"""`kvatlas plan` whole-process wall time against a bare `python -c pass`, interleaved in one run.

Target (issue 2): under 6x the bare interpreter start. Byte-code is compiled first, as a regular
`pip install` does, so both sides start from .pyc files.

    python bench/plan_startup.py [--runs 40]
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    import kvatlas
    compileall.compile_dir(os.path.dirname(kvatlas.__file__), quiet=1)
    script = shutil.which("kvatlas") or os.path.join(os.path.dirname(sys.executable), "kvatlas")
    bare, plan = [sys.executable, "-c", "pass"], [script, "plan"]
    probe = subprocess.run([sys.executable, "-c", "import sys, kvatlas.cli as c; c.main(['plan']); "
                            "print(sorted(m for m in ('torch', 'matplotlib', 'rich', 'numpy') if m in sys.modules))"],
                           capture_output=True, text=True, check=True)
    heavy = probe.stdout.strip().splitlines()[-1]
    for cmd in (bare, plan):  # warm the page cache
        wall(cmd)
    a, b = [], []
    for _ in range(args.runs):
        a.append(wall(bare))
        b.append(wall(plan))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"python -c pass   median {ma * 1e3:7.2f} ms  (n={args.runs})")
    print(f"kvatlas plan     median {mb * 1e3:7.2f} ms  (n={args.runs})")
    print(f"ratio            {mb / ma:.2f}x   (target < 6x)")
    print(f"heavy modules imported by `kvatlas plan`: {heavy}")


if __name__ == "__main__":
    main()
