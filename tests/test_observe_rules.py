"""The shipped dashboard and Prometheus rules: promtool accepts the rules and passes their unit
tests; every dashboard query parses; every metric and label they name exists in a real scrape of
a running `kvatlas serve` (prefix cache, host tier and shared tier on) or among the SGLang and vLLM
plugins' families; every metric family kvatlas or a plugin writes has a panel; a real Prometheus
scraping the serve and both plugins' exporters answers every panel.

promtool comes with Debian's `prometheus` package (.ci/run installs it); without it the promtool
tests skip, saying so. The serve and the plugins' exporters run on loopback, the serve is stopped
by its PID, the exporters' threads by their server, and every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.observing import shipped
from kvatlas.observing.metrics import HELP

import test_e2e_prometheus as e2e

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: install Debian's 'prometheus' "
                                    "package (apt-get install prometheus) to check the shipped rules")
METRIC = re.compile(r"\bkvatlas_[a-z0-9_]+\b")
# what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARS = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}
TARGET_LABELS = {"job", "instance"}   # added by Prometheus to every scraped sample
ENGINES = ("sglang", "vllm")          # the plugins' panels select engine="sglang" / engine="vllm"
ROUTE = re.compile(r"\bkvatlas_route_")  # kvatlas route's panels: a router's own families


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
         "--linger", "-1", "--progress-s", "60", "--shared-tier", "memory://observe"]


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def engines():
    """{job: port} of one loopback /metrics per plugin, exporting what it adds to its engine's, and
    one of a router's families (kvatlas route)."""
    from prometheus_client import make_wsgi_app
    from plugin_ledger import plugin_registries
    from route_fleet import route_registry
    with plugin_registries() as regs:
        regs = {**regs, "route": route_registry()}
        servers = {f"{engine}-plugin" if engine != "route" else "kvatlas-route":
                   make_server("127.0.0.1", 0, make_wsgi_app(reg), WSGIServer, _Quiet) for engine, reg in regs.items()}
        threads = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in servers.values()]
        for t in threads:
            t.start()
        try:
            yield {job: srv.server_address[1] for job, srv in servers.items()}
        finally:
            for srv, t in zip(servers.values(), threads):
                srv.shutdown()
                srv.server_close()
                t.join(timeout=10)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, engines):
    """(URL of a Prometheus loaded with the shipped rules or None without the binary, the port it
    scrapes for job kvatlas): started first, so it sees the serve's workload from its start; it
    scrapes the plugins' exporters too."""
    port = e2e.free_port()
    if e2e.PROMETHEUS is None:
        yield None, port
        return
    folder = tmp_path_factory.mktemp("prometheus")
    shipped.write_all(str(folder / "assets"))
    with e2e.running_prometheus(folder, port, [folder / "assets" / "prometheus" / "kvatlas-rules.yml"],
                                more_jobs=engines) as prom:
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


def route_families():
    """(sample names, label names) a router's registry writes."""
    from prometheus_client import generate_latest
    from route_fleet import route_registry
    samples = [s for fam in text_string_to_metric_families(generate_latest(route_registry()).decode()) for s in fam.samples]
    return {s.name for s in samples}, {k for s in samples for k in s.labels}


def plugin_families():
    """{engine: (sample names, label names)} the SGLang and vLLM plugins write, from ledgers built
    as they build them, exported as they export them."""
    from prometheus_client import generate_latest
    from plugin_ledger import plugin_registries
    out = {}
    with plugin_registries() as regs:
        for engine, reg in regs.items():
            samples = [s for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples]
            out[engine] = {s.name for s in samples}, {k for s in samples for k in s.labels}
    return out


def test_every_metric_and_label_the_dashboard_and_rules_name_exists(scrape):
    names, labels = scrape
    assert {"kvatlas_prefix_hit_tokens_total", "kvatlas_host_tier_restore_seconds_count",
            "kvatlas_shared_tier_op_seconds_count"} <= names
    rules = shipped.read("rules")
    queries = dashboard_queries()
    plugins = plugin_families()
    engine_query = {q for q in queries if any(f'engine="{e}"' in q for e in ENGINES) or ROUTE.search(q)}
    used = set(METRIC.findall(rules)) | {m for q in set(queries) - engine_query for m in METRIC.findall(q)}
    assert len(used) > 40
    assert not used - names, sorted(used - names)
    plugin_labels = set()
    for engine, (plugin_names, engine_labels) in plugins.items():
        drawn = {m for q in queries if f'engine="{engine}"' in q for m in METRIC.findall(q)}
        assert drawn and not drawn - plugin_names, (engine, sorted(drawn - plugin_names))
        plugin_labels |= engine_labels
    route_names, route_labels = route_families()
    drawn = {m for q in queries if ROUTE.search(q) for m in METRIC.findall(q)}
    assert len(drawn) > 10 and not drawn - route_names, sorted(drawn - route_names)
    plugin_labels |= route_labels
    known = labels | plugin_labels | TARGET_LABELS
    referred = label_names(rules) | {n for q in queries for n in label_names(q)}
    referred |= {n for p in json.loads(shipped.read("dashboard"))["panels"]
                 for t in p.get("targets", ()) for n in label_names(t.get("legendFormat", ""))}
    assert not referred - known, sorted(referred - known)
    assert {"engine", "tp_rank", "pp_rank", "dp_rank"} <= plugin_labels


def test_every_metric_family_kvatlas_or_a_plugin_writes_has_a_panel():
    """Each family of kvatlas's table (a counter as NAME_total, a summary as NAME_sum and
    NAME_count; the build info `kvatlas` is the table panel's kvatlas_info) and each family a
    plugin writes appears in a dashboard query."""
    drawn = {m for q in dashboard_queries() for m in METRIC.findall(q)}
    forms = {name: {name, f"{name}_total", f"{name}_sum", f"{name}_count"} for name in HELP if name != "kvatlas"}
    assert len(forms) > 50
    missing = sorted(name for name, f in forms.items() if not f & drawn)
    assert not missing, f"no dashboard panel draws {missing}"
    for engine, (plugin_names, _) in plugin_families().items():
        assert len(plugin_names) > 5 and not plugin_names - drawn, (engine, sorted(plugin_names - drawn))
    from kvatlas.routing.metrics import HELP as ROUTE_HELP
    missing = sorted(n for n in ROUTE_HELP if not {n, f"{n}_total", f"{n}_bucket", f"{n}_count"} & drawn)
    assert not missing, f"no dashboard panel draws the router's {missing}"
    assert "kvatlas_info" in drawn


@pytest.mark.skipif(e2e.PROMETHEUS is None, reason="prometheus binary not found: install Debian's 'prometheus' "
                    "package (apt-get install prometheus) to run the rules against a real server")
def test_a_real_prometheus_records_the_rules_and_answers_every_panel(prometheus, serve):
    prom = prometheus[0]
    e2e.wait_for("the workload to finish", lambda: e2e.get_json(serve + "/state")["workload"]["done"], 30)
    done_at = time.time()
    e2e.wait_for("a rule evaluation after a scrape after the end",
                 lambda: e2e.query(prom, f'timestamp(kvatlas:kv_cache_free:ratio{{job="kvatlas"}}) > {done_at + 1.5}'),
                 15)
    state = e2e.get_json(serve + "/state")["caches"][0]
    totals = state["ledger"]["totals"]
    (free,) = e2e.query(prom, 'kvatlas:kv_cache_free:ratio{job="kvatlas"}')
    want = 1 - (totals["occupied"] - totals["evictable"]) / totals["addressable"]
    assert float(free["value"][1]) == pytest.approx(want, rel=1e-12)
    (hit,) = e2e.query(prom, "kvatlas:prefix_hit:ratio_rate15m")
    assert 0 < float(hit["value"][1]) < 1      # the shared system prompts hit
    missed = e2e.query(prom, "kvatlas:prefix_missed:ratio_rate15m")
    assert {m["metric"]["reason"] for m in missed} == {"no_cached_prefix", "no_checkpoint", "evicted",
                                                       "partial_page"}
    shared = e2e.query(prom, 'kvatlas:shared_tier_missed:ratio_rate15m{kind="page"}')
    assert {m["metric"]["reason"] for m in shared} == set(state["shared_tier"]["misses"]["page"])
    (breaker,) = e2e.query(prom, "kvatlas_shared_tier_breaker_open")
    assert breaker["value"][1] == "0" and not state["shared_tier"]["breaker"]["open"]
    (blocks,) = e2e.query(prom, 'kvatlas_pool_total_blocks{job="vllm-plugin",engine="vllm"}')
    assert blocks["value"][1] == "16"            # the vLLM-like pool's 17 blocks less the null block
    for q in dashboard_queries():
        if not q.startswith("label_values("):
            assert e2e.query(prom, grafana(q)), q    # every panel has data, the plugins' included


def test_docs_explain_every_record_and_alert():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "observe.md")) as fh:
        doc = fh.read()
    names = re.findall(r"^\s*- (?:record|alert): (\S+)$", shipped.read("rules"), re.M)
    assert len(names) > 20
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/observe.md does not explain {missing}"


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
