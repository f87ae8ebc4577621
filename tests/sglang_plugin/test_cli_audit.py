"""`kvatlas audit --sglang`: the buffer map of SGLang's own pools, built offline."""

import json

from kvatlas.cli import main


def test_audit_prints_the_buffer_map(capsys):
    assert main(["audit", "--sglang", "deepseek-v4-pro", "--memory", "8GiB", "--max-running-requests", "32"]) == 0
    out = capsys.readouterr().out
    assert "KV pool (mem_usage): 8,611,961,032 B" in out and "15,681,728 B over" in out
    assert "unreachable by any index: 44,233,536 B" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha() and len(line.split()) == 10}
    assert rows["swa_kv"][3] == "61" and rows["c4_kv"][3] == "30" and rows["c128_kv"][3] == "31"


def test_audit_json_maps_every_storage_to_a_pool_and_layer(capsys):
    assert main(["audit", "--sglang", "deepseek-v4-flash", "--memory", "4GiB", "--max-running-requests", "32",
                 "--swa-mode", "cap", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"] == "sglang" and doc["kv_cache"]["tensor"] == 4_314_050_632
    storages = doc["storages"]
    assert sum(s["bytes"] for s in storages) == doc["total"]["tensor"]
    c128 = [s for s in storages if s["pool"] == "c128_kv"]
    assert [s["layer"] for s in c128] == list(range(3, 43, 2))    # V4-Flash: C128 on odd layers 3..41
    assert {s["layer"] for s in storages if s["pool"] == "swa_kv"} == set(range(43))
