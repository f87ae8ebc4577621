"""Every JSON document kvatlas prints or serves validates against the schema it names, the
schemas refuse what they should, and every shipped schema is used by a document here."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

import kvatlas
from kvatlas.cli import main
from kvatlas.observing import server, shipped
from test_e2e_prometheus import get_json

def printed(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def named(doc) -> tuple:
    return ("kvatlas.models", 1) if isinstance(doc, list) else (doc["schema"], doc["schema_version"])


PLANS = [["deepseek-v4-flash", "--memory", "120GiB"],
         ["deepseek-v4-pro", "--memory", "120GiB", "--draft-tokens", "3", "--tp", "8"],
         ["deepseek-v4.1-flash", "--memory", "64GiB", "--prefix-checkpoints", "100"],
         ["deepseek-v4-flash", "--memory", "40GiB", "--layout", "unified-fp8", "--pp", "2", "--pp-rank", "1"],
         # every flag that changes the document's shape: --fit's two kinds (and a mix), weights from
         # the config, weights given, none
         ["--fit", "8x128K", "--tp", "4"], ["--fit", "8x128K,32x4K", "--tp", "4"], ["--fit", "128K", "--tp", "4"],
         ["--fit", "128K,4K,1M", "--tp", "4"], ["tiny-v4", "--fit", "2x4K", "--max-model-len", "4096"],
         ["--tp", "4"], ["--weights", "0"], ["--weights", "40GiB", "--tp", "2"],
         ["deepseek-v4-flash", "--memory", "120GiB", "--draft-tokens", "2", "--draft-layers", "off",
          "--online-c128", "--layout", "fp32", "--indexer", "fp4"]]
# tune's shapes: --simulate or not, a budget given or from the weights, one engine, a sessions
# workload (prefix hits in the simulated rows), a trace, resume points fitted by replay
TUNES = [["--tp", "4", "--duration", "2", "--simulate"],
         ["deepseek-v4-pro", "--memory", "60GiB", "--duration", "2"],
         ["tiny-v4", "--memory", "1GiB", "--engines", "kvatlas", "--turns", "3", "--system-prompts", "2",
          "--system-prompt-len", "300", "--prompt-len", "200", "--duration", "2", "--simulate"],
         ["tiny-v4", "--memory", "1GiB", "--engines", "vllm,sglang", "--prompt-len", "uniform:100:3000"],
         ["tiny-v4", "--memory", "1GiB", "--engines", "kvatlas", "--turns", "3", "--system-prompts", "2",
          "--system-prompt-len", "300", "--prompt-len", "200", "--duration", "2", "--simulate", "--fit-checkpoints"]]
COMPARES = [["deepseek-v4-flash", "--memory", "120GiB"],
            ["--tp", "4", "--engines", "kvatlas,sglang:cap,sglang:ratio,vllm:sync", "--prefix-checkpoints", "64"],
            ["tiny-v4", "--memory", "512MiB", "--max-running-requests", "8", "--engines", "vllm,sglang"]]


@pytest.fixture(scope="module")
def documents():
    """(where it came from, document) for every kind of document, each made as a user makes it."""
    import contextlib
    import io
    out = []

    def cli(*argv):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(list(argv)) == 0
        out.append((" ".join(argv[:2]), json.loads(buf.getvalue())))
    for argv in PLANS:
        cli("plan", *argv, "--json")
    for argv in COMPARES:
        cli("compare", *argv, "--json")
    cli("alloc", "tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--max-model-len", "2048", "--json")
    cli("alloc", "tiny-v4", "--memory", "96MiB", "--max-running-requests", "4", "--prefix-checkpoints", "4",
        "--draft-tokens", "2", "--json")
    cli("models", "--json")
    for argv in TUNES:
        cli("tune", *argv, "--json")
    for tiers in ("shared", "host", "prefix", None):
        state, host_plan = _served_state(tiers)
        entry = state["caches"][0]
        assert entry["requests"]
        if tiers == "shared":
            assert entry["host_tier"] is not None and "prefix_cache" in entry
            assert entry["shared_tier"]["store"].startswith("memory")
            out += [("/state shared_tier", entry["shared_tier"])]
        if host_plan is not None:
            out += [("/state host_tier", entry["host_tier"]), ("plan_host", host_plan)]
        out += [(f"GET /state ({tiers})", state), ("/state ledger", entry["ledger"]), ("/state plan", entry["plan"])]
    out += _plugin_documents()
    out.append(("kvatlas route /state", _route_state()))
    return out


def _served_state(tiers="shared"):
    """/state of a cache with a shared tier below a host tier, a host tier alone, a prefix cache
    alone, or none (tiers None), and the host tier's plan (None without one)."""
    from kvatlas.driving.sim import Simulator
    from kvatlas.driving.workload import synthetic
    from kvatlas.tiers import attach_host_tier
    from kvatlas.tiers.shared import attach_shared_tier
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=4, max_model_len=2048,
                     prefix_checkpoints=0 if tiers is None else 8)
    cache = kvatlas.allocate(p)
    if tiers == "shared":
        attach_shared_tier(cache, "4MiB", "memory://test-schemas")   # a host tier with a shared store below it
    elif tiers == "host":
        attach_host_tier(cache, "4MiB")
    reqs = synthetic(rate_per_s=40, duration_s=0.2, prompt="uniform:16:600", output="uniform:2:30", seed=1)
    sim = Simulator(cache, reqs)
    for i in range(6):
        sim.step(i * 0.02)
    h = server.start(cache, port=0, extra_state=sim.state, request_state=sim.progress)
    try:
        return get_json(h.url + "/state"), cache.host.tier.plan.to_dict() if cache.host is not None else None
    finally:
        h.close()


def _route_state():
    """`kvatlas route`'s /state with one fake vLLM replica that has published (groups and blocks
    learned) and one where nothing listens (taken out, no events endpoint)."""
    import time
    from route_fleet import Fake, Router, get, post
    fake = Fake("a").start()
    try:
        r = Router([fake.replica_flag(), "http://127.0.0.1:9,name=gone"], "--health-interval-s", "0.2")
        try:
            assert post(r.url + "/v1/completions", {"prompt": list(range(5, 700)), "max_tokens": 1})[0] == 200
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                state = get(r.url + "/state")
                if state["replicas"][0]["ranks"][0]["index"]["blocks"] and not state["replicas"][1]["up"]:
                    return state
                time.sleep(0.1)
            raise AssertionError(f"the router learned nothing in 10 s: {state}")
        finally:
            r.stop()
    finally:
        fake.stop()


def _plugin_documents():
    """An engine plugin's ledger (built as the SGLang plugin builds one, without SGLang) and the
    /state it serves."""
    from plugin_ledger import sglang_like_ledger
    from kvatlas.integrations import foreign
    ledger = sglang_like_ledger()
    h = foreign.serve_state(lambda: [ledger.snapshot()])
    try:
        served = get_json(h.url + "/state")
    finally:
        h.close()
    return [("foreign ledger", ledger.snapshot().to_dict()), ("plugin /state", served)]


def test_shipped_schemas_are_valid_draft_2020_12():
    for name, version in shipped.SCHEMAS:
        schema = shipped.load_schema(name, version)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$schema"].endswith("/draft/2020-12/schema")
        if name != "kvatlas.models":
            assert schema["properties"]["schema"] == {"const": name}
            assert schema["properties"]["schema_version"] == {"const": version}


def test_every_document_validates_against_its_schema(documents):
    for where, doc in documents:
        errors = sorted(shipped.validator(doc).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{where}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def test_every_shipped_schema_is_used_by_a_document(documents):
    want = set(shipped.SCHEMAS)
    assert want == {named(d) for _, d in documents}


def test_schemas_refuse_what_they_should(capsys):
    good = printed(capsys, "plan", "tiny-v4", "--memory", "96MiB", "--max-model-len", "2048",
                   "--max-running-requests", "8", "--json")
    shipped.validator(good).validate(good)
    bad = []
    for change in (lambda d: d.pop("budget_bytes"), lambda d: d.update(extra_field=1),
                   lambda d: d["buffers"][0].update(bytes=-1), lambda d: d.update(schema_version=2),
                   lambda d: d["capacity"].update(max_total_tokens="many"), lambda d: d["layers"][0].update(kind="c5")):
        d = copy.deepcopy(good)
        change(d)
        bad.append(d)
    v = shipped.validator(good)
    assert all(not v.is_valid(d) for d in bad[:3] + bad[4:])
    with pytest.raises(kvatlas.ConfigError, match="version 2"):
        shipped.validator(bad[3])


def test_observe_prints_and_writes_the_files(tmp_path, capsys):
    assert main(["observe", "kvatlas.plan"]) == 0
    assert json.loads(capsys.readouterr().out)["properties"]["schema"] == {"const": "kvatlas.plan"}
    assert main(["observe", "--path", "rules"]) == 0
    assert capsys.readouterr().out.strip().endswith("kvatlas-rules.yml")
    assert main(["observe", "--write", str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert {p.rsplit("/", 2)[-2] for p in written} == {"grafana", "prometheus", "schemas"}
    assert json.loads((tmp_path / "out" / "schemas" / "kvatlas.state.v1.schema.json").read_text()) == \
        shipped.bundled("kvatlas.state", 1)
    assert main(["observe", "kvatlas.tune"]) == 0 and '"const": "kvatlas.tune"' in capsys.readouterr().out
    assert main(["observe", "kvatlas.tunes"]) == 2
    assert "kvatlas.tunes" in capsys.readouterr().err


def test_the_printed_schema_alone_checks_its_documents(documents, capsys, tmp_path):
    """`kvatlas observe NAME` prints one self-contained file: a validator given only that file (no
    registry, no other file) checks every document of that name, alloc's and /state's included."""
    printed_schemas = {}
    for where, doc in documents:
        name, version = named(doc)
        if name not in printed_schemas:
            assert main(["observe", name]) == 0
            printed_schemas[name] = json.loads(capsys.readouterr().out)
        schema = printed_schemas[name]
        assert not [r for r in _refs(schema) if not r.startswith("#")], name
        errors = list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
        assert not errors, f"{where}: {errors[0].message}"
    assert main(["observe", "--write", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    alloc = next(d for _, d in documents if named(d)[0] == "kvatlas.alloc")
    written = json.loads((tmp_path / "out" / "schemas" / "kvatlas.alloc.v1.schema.json").read_text())
    assert written == printed_schemas["kvatlas.alloc"] and "kvatlas.ledger.v1" in written["$defs"]
    jsonschema.Draft202012Validator(written).validate(alloc)
    broken = copy.deepcopy(alloc)
    broken["ledger"]["pools"] = 5   # the bundled ledger schema is really applied
    assert not jsonschema.Draft202012Validator(written).is_valid(broken)


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)
