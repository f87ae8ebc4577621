"""Runs the live shared-store tests (tests/shared_live.py: real Mooncake and Redis servers) in a
network namespace of their own whose only interface is `lo` (`unshare -n`), so that whatever
the servers bind, nothing outside this machine's loopback can reach them or be reached. Skips
with the reason where that namespace or the servers are not available (fails instead under
KVATLAS_REQUIRE_STORES, which CI sets: CI installs them)."""

import os
import shutil
import subprocess
import sys
import time

import store_servers as ss

HERE = os.path.dirname(os.path.abspath(__file__))


def _wait_for_ci_run(folder: str) -> None:
    """.ci/run started the live suite beside the main suite: wait for it and check its outcome."""
    rc = os.path.join(folder, "rc")
    end = time.monotonic() + 1200
    while not os.path.exists(rc) and time.monotonic() < end:
        time.sleep(1)
    out = open(os.path.join(folder, "out")).read()
    tail = "\n".join(line for line in out.splitlines() if not (line[:1] in "IWE" and line[1:2].isdigit()))
    print(tail[-6000:])
    assert os.path.exists(rc), "the live shared-store tests did not finish within 20 minutes"
    assert open(rc).read().strip() == "0", tail[-6000:]
    assert " passed" in tail and " skipped" not in tail.strip().splitlines()[-1]


def test_live_stores_in_a_network_namespace_with_only_lo():
    if os.environ.get("KVATLAS_SHARED_LIVE_RUN"):
        return _wait_for_ci_run(os.environ["KVATLAS_SHARED_LIVE_RUN"])
    if shutil.which("unshare") is None:
        ss.missing("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "-n", "--", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        ss.missing(f"cannot make a network namespace here ({probe.stderr.strip() or probe.returncode}): needs root")
    for exe in ("redis-server", "mooncake_master"):
        if ss._bin(exe) is None:
            ss.missing(f"{exe} is not installed (see README: Shared tier)")
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=ss.LOOPBACK)
    cmd = ["unshare", "-n", "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
           "ignore::DeprecationWarning", os.path.join(HERE, "shared_live.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=os.path.dirname(HERE))
    tail = "\n".join(line for line in r.stdout.splitlines() if not (line[:1] in "IWE" and line[1:2].isdigit()))
    print(tail[-6000:])
    assert r.returncode == 0, tail[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1]
