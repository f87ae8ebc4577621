import json
import subprocess
import sys

import pytest

from kvatlas.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], capture_output=True, text=True)


def test_plan_default_table(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v4-flash" in out and "c4_kv" in out and "3,899.25 B" in out


def test_plan_json_schema(capsys):
    assert main(["plan", "deepseek-v4-pro", "--memory", "100GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "kvatlas.plan" and doc["schema_version"] == 1
    assert sum(b["bytes"] for b in doc["buffers"]) == doc["total_bytes"] <= doc["budget_bytes"] == 100 * 2**30
    assert doc["capacity"]["row_bytes_per_token"] == 5511.4375
    assert [c["context_tokens"] for c in doc["capacity"]["concurrency"]] == [4096, 32768, 131072, 1048576]


def test_plan_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert main(["plan", "--memory", "80GiB", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_models(capsys):
    assert main(["models", "--json"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert "deepseek-v4.1-flash" in names


@pytest.mark.parametrize("args,needle", [
    (["plan", "deepseek-v9"], "model"),
    (["plan", "--memory", "1GiB"], "memory"),
    (["plan", "--memory", "abc"], "--memory"),
    (["plan", "--memory", "120GiB", "--layout", "fp16"], "--layout"),
    (["plan", "--memory", "120GiB", "--max-running-requests", "-3"], "--max-running-requests"),
    (["plan", "--memory", "120GiB", "--draft-tokens", "x"], "--draft-tokens"),
])
def test_bad_input_exits_nonzero_without_traceback(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_malformed_config_file(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 3}')
    r = run_cli("plan", str(cfg), "--memory", "10GiB")
    assert r.returncode == 2 and "compress_ratios" in r.stderr and "Traceback" not in r.stderr
