import json
import subprocess
import sys

import pytest

import kvatlas
from kvatlas.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], capture_output=True, text=True)


def test_plan_default_table(capsys):
    assert main(["plan", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v4-flash" in out and "c4_kv" in out and "3,899.25 B" in out
    # the budget is the GPU's share less the weights the config implies for one of 4 ranks
    assert "weights 40,924,052,296 B (38.11 GiB) per rank from the config" in out
    assert "leaves 94,755,285,790 B (88.25 GiB) of KV budget" in out


def test_plan_on_one_gpu_says_the_weights_do_not_fit(capsys):
    assert main(["plan"]) == 2   # V4-Flash's 159.6 GB checkpoint exceeds 0.9 of one H200
    err = capsys.readouterr().err
    assert "weights take 159,609,485,896 B per rank" in err and "use --tp 2" in err


def test_plan_fit_smallest_budget_and_running_requests(capsys):
    assert main(["plan", "--fit", "8x128K,32x4K", "--tp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fit = doc["fit"]
    assert fit["kind"] == "smallest_budget" and fit["budget_bytes"] == doc["total_bytes"] == doc["budget_bytes"]
    assert doc["options"]["max_running_requests"] == 40 and doc["options"]["max_model_len"] == 131072
    p = kvatlas.plan("deepseek-v4-flash", fit["budget_bytes"], max_running_requests=40, max_model_len=131072)
    assert p.num_full_pages - 1 == 8 * 512 + 32 * 16   # exactly the pages the mix fills
    q = kvatlas.plan("deepseek-v4-flash", fit["budget_bytes"] - 1, max_running_requests=40, max_model_len=131072)
    assert q.num_full_pages - 1 < 8 * 512 + 32 * 16   # one byte less cannot hold them
    assert main(["plan", "--memory", "120GiB", "--fit", "128K"]) == 0
    out = capsys.readouterr().out
    assert "for 131,072-token contexts in 120.00 GiB per rank: --max-running-requests 242" in out
    p = kvatlas.plan("deepseek-v4-flash", "120GiB", max_running_requests=242)
    assert p.concurrency_in_plan(131072) == 242
    assert kvatlas.plan("deepseek-v4-flash", "120GiB", max_running_requests=243).concurrency_in_plan(131072) < 243


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
