"""What operators consume from the plugin, checked inside SGLang's own code: `kvatlas audit
--sglang --json` validates against its shipped schema, and the metrics SGLang's /metrics serves
after a stats refresh (its radix cache built) carry every family and label the shipped dashboard's
SGLang panels use."""

import json
import re

import pytest

from kvatlas.cli import main
from kvatlas.observing import shipped


def test_audit_json_validates_against_its_schema(capsys):
    pytest.importorskip("jsonschema")
    assert main(["audit", "--sglang", "deepseek-v4-flash", "--memory", "4GiB", "--max-running-requests", "32",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["schema"], doc["schema_version"]) == ("kvatlas.foreign_ledger", 1) and doc["storages"]
    shipped.validator(doc).validate(doc)


def test_the_dashboards_sglang_panels_read_families_the_plugin_serves(plugins_loaded, sglang_sequence):
    from test_live import _scrape, _stats
    from test_prefix import _tree
    from kvatlas.integrations.sglang import plugin as ks
    args, pools = sglang_sequence("deepseek-v4-flash", "4GiB", 32)
    assert [lg for lg in ks.ledgers() if lg.source is pools.token_to_kv_pool]
    _tree(pools)     # SGLang's radix cache over the pools: the evictable pages and the prefix-tail quota
    _stats(args)
    scrape = _scrape()
    names = {name for name, _ in scrape}
    labels = {k for _, labs in scrape for k, _ in labs}
    dash = json.loads(shipped.read("dashboard"))
    queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", ()) if 'engine="sglang"' in t["expr"]]
    used = {m for q in queries for m in re.findall(r"\bkvatlas_[a-z0-9_]+\b", q)}
    assert used and used <= names, sorted(used - names)
    assert {"engine", "tp_rank", "pp_rank", "dp_rank", "pool", "measure"} <= labels
