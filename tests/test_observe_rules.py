"""The shipped dashboard and Prometheus rules: promtool accepts the rules and passes their unit
tests; every dashboard query parses; every metric and label they name exists in a real scrape of
a running `kvatlas serve` (prefix cache and host tier on) or among the SGLang plugin's families.

promtool comes with Debian's `prometheus` package (.ci/run installs it); without it the promtool
tests skip, saying so. The serve runs on loopback, is stopped by its PID, and every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.observing import shipped

import test_e2e_prometheus as e2e

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: install Debian's 'prometheus' "
                                    "package (apt-get install prometheus) to check the shipped rules")
METRIC = re.compile(r"\bkvatlas_[a-z0-9_]+\b")
# what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARS = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}
TARGET_LABELS = {"job", "instance"}   # added by Prometheus to every scraped sample


def dashboard_queries() -> list[str]:
    dash = json.loads(shipped.read("dashboard"))
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def grafana(expr: str) -> str:
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    return expr


def label_names(text: str) -> set[str]:
    """Labels a query or rule refers to: matchers, by/without/on/ignoring lists, templates."""
    names = set(re.findall(r"(\w+)\s*=~?\s*\"", text))
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    names |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text)) | set(re.findall(r"\$labels\.(\w+)", text))
    return names


@needs_promtool
def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    shipped.write_all(str(tmp_path))
    folder = tmp_path / "prometheus"
    for argv in (["check", "rules", "kvatlas-rules.yml"], ["test", "rules", "kvatlas-rules.test.yml"]):
        r = subprocess.run([PROMTOOL, *argv], cwd=folder, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "SUCCESS" in r.stdout + r.stderr


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    """promtool parses each query as the expression of a recording rule."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, q in enumerate(dashboard_queries()):
        if q.startswith("label_values("):   # Grafana's own function, not PromQL: check its selector
            q = q[len("label_values("):].rsplit(",", 1)[0]
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(grafana(q))}"]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text("\n".join(lines) + "\n")
    r = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# arrivals over 8 s: Prometheus (1 s scrapes) must see the counters rise, not only their final values
SERVE = ["tiny-v4", "--memory", "96MiB", "--max-model-len", "2048", "--max-running-requests", "8",
         "--prefix-checkpoints", "8", "--host-memory", "4MiB", "--system-prompts", "2", "--system-prompt-len", "600",
         "--rate", "4", "--duration", "8", "--prompt-len", "uniform:32:300", "--output-len", "uniform:4:16",
         "--linger", "-1", "--progress-s", "60"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """(URL of a Prometheus loaded with the shipped rules or None without the binary, the port it
    scrapes): started first, so it sees the serve's workload from its start."""
    port = e2e.free_port()
    if e2e.PROMETHEUS is None:
        yield None, port
        return
    folder = tmp_path_factory.mktemp("prometheus")
    shipped.write_all(str(folder / "assets"))
    with e2e.running_prometheus(folder, port, [folder / "assets" / "prometheus" / "kvatlas-rules.yml"]) as prom:
        yield prom, port


@pytest.fixture(scope="module")
def serve(prometheus):
    """A running `kvatlas serve` (its URL); stopped by its PID when the module's tests are done."""
    proc = subprocess.Popen([sys.executable, "-m", "kvatlas", "serve", *SERVE, "--port", str(prometheus[1])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "endpoints at " in line, line + (proc.stderr.read() if proc.poll() is not None else "")
        yield line.split("endpoints at ", 1)[1].split("/metrics", 1)[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def scrape(serve):
    """(sample names, label names) of one /metrics scrape of the running serve."""
    import urllib.request
    with urllib.request.urlopen(serve + "/metrics", timeout=20) as r:
        text = r.read().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return {s.name for s in samples}, {k for s in samples for k in s.labels}


def plugin_families():
    """(sample names, label names) the SGLang plugin writes, from a ledger built as it builds one."""
    from prometheus_client import CollectorRegistry, generate_latest
    from plugin_ledger import sglang_like_ledger
    from kvatlas.integrations import foreign
    ledger = sglang_like_ledger()
    foreign.write_gauges(ledger.snapshot())
    reg = CollectorRegistry(auto_describe=False)
    for g in foreign._GAUGES.values():
        reg.register(g)
    samples = [s for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples]
    return {s.name for s in samples}, {k for s in samples for k in s.labels}


def test_every_metric_and_label_the_dashboard_and_rules_name_exists(scrape):
    names, labels = scrape
    assert "kvatlas_prefix_hit_tokens_total" in names and "kvatlas_host_tier_restore_seconds_count" in names
    rules = shipped.read("rules")
    queries = dashboard_queries()
    used = set(METRIC.findall(rules)) | {m for q in queries for m in METRIC.findall(q)}
    assert len(used) > 25
    assert not used - names, sorted(used - names)
    plugin_names, plugin_labels = plugin_families()
    sglang = {m for q in queries if 'engine="sglang"' in q for m in METRIC.findall(q)}
    assert sglang and not sglang - plugin_names, sorted(sglang - plugin_names)
    known = labels | plugin_labels | TARGET_LABELS
    referred = label_names(rules) | {n for q in queries for n in label_names(q)}
    referred |= {n for p in json.loads(shipped.read("dashboard"))["panels"]
                 for t in p.get("targets", ()) for n in label_names(t.get("legendFormat", ""))}
    assert not referred - known, sorted(referred - known)
    assert {"engine", "tp_rank", "pp_rank", "dp_rank"} <= plugin_labels


@pytest.mark.skipif(e2e.PROMETHEUS is None, reason="prometheus binary not found: install Debian's 'prometheus' "
                    "package (apt-get install prometheus) to run the rules against a real server")
def test_a_real_prometheus_records_the_rules_and_answers_every_panel(prometheus, serve):
    prom = prometheus[0]
    e2e.wait_for("the workload to finish", lambda: e2e.get_json(serve + "/state")["workload"]["done"], 30)
    done_at = time.time()
    e2e.wait_for("a rule evaluation after a scrape after the end",
                 lambda: e2e.query(prom, f"timestamp(kvatlas:kv_cache_free:ratio) > {done_at + 1.5}"), 15)
    totals = e2e.get_json(serve + "/state")["caches"][0]["ledger"]["totals"]
    (free,) = e2e.query(prom, "kvatlas:kv_cache_free:ratio")
    want = 1 - (totals["occupied"] - totals["evictable"]) / totals["addressable"]
    assert float(free["value"][1]) == pytest.approx(want, rel=1e-12) and free["metric"]["job"] == "kvatlas"
    (hit,) = e2e.query(prom, "kvatlas:prefix_hit:ratio_rate15m")
    assert 0 < float(hit["value"][1]) < 1      # the shared system prompts hit
    missed = e2e.query(prom, "kvatlas:prefix_missed:ratio_rate15m")
    assert {m["metric"]["reason"] for m in missed} == {"no_cached_prefix", "no_checkpoint", "evicted",
                                                       "partial_page"}
    for q in dashboard_queries():
        if q.startswith("label_values(") or 'engine="sglang"' in q:
            continue
        assert e2e.query(prom, grafana(q)), q        # every kvatlas panel has data


def test_package_data_ships_every_asset():
    tomllib = pytest.importorskip("tomllib")
    import fnmatch
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        patterns = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["kvatlas"]
    pkg = os.path.join(root, "src", "kvatlas")
    for folder, _, files in os.walk(shipped.ASSETS_DIR):
        for f in files:
            rel = os.path.relpath(os.path.join(folder, f), pkg).replace(os.sep, "/")
            assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
