import json
import subprocess
import sys

import pytest

from kvatlas.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], capture_output=True, text=True)


def test_table(capsys):
    assert main(["compare", "--memory", "120GiB"]) == 0
    out = capsys.readouterr().out
    for text in ("kvatlas [plan]", "sglang 0.5.23 [ratio 0.1 (default)]", "sglang 0.5.23 [cap]",
                 "vllm 0.33 [hybrid manager]", "GPU KV cache size: 12,507,513", "max_total_num_tokens: 17,798,400",
                 "+12,822,592", "1.785×", "kvatlas re-planned for one context"):
        assert text in out, text


def test_json(capsys):
    assert main(["compare", "deepseek-v4-pro", "--memory", "120GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "kvatlas.compare" and doc["schema_version"] == 1
    by = {(e["engine"], e["variant"]): e for e in doc["engines"]}
    assert by[("vllm 0.33", "hybrid manager")]["reported"]["capacity_tokens"] == 8_729_604
    assert by[("sglang 0.5.23", "ratio 0.1 (default)")]["reported"]["memory_gauge_bytes"] == 0
    for e in doc["engines"]:
        assert e["kvatlas_token_ratio"] >= 1
        assert sum(b["bytes"] for b in e["buffers"] if b["in_budget"]) == e["allocated_bytes"]
        assert e["reachable_bytes"] + e["dead_bytes"] == e["allocated_bytes"]


def test_variants_and_engine_flags(capsys):
    assert main(["compare", "--memory", "120GiB", "--engines", "kvatlas,sglang:cap", "--draft-tokens", "4",
                 "--sglang-no-radix", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    sg = doc["engines"][1]
    assert sg["variant"] == "cap, spec 4 draft" and sg["figures"]["prefix_tails"] == 0


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp.png"
    assert main(["compare", "--memory", "120GiB", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, text", [
    (["--engines", "kvatlas,trtllm"], "engine: 'trtllm' is not a modelled engine"),
    (["--engines", "vllm", "--state-dtype", "bf16"], "state_dtype: vllm 0.33: keeps compressor state in fp32"),
    (["--engines", "vllm", "--sglang-swa-ratio", "0.2"], "sglang options were given"),
    (["--engines", "sglang:cap", "--sglang-swa-ratio", "0.2"], "swa_ratio"),
    (["--engines", "sglang", "--draft-tokens", "12"], "draft_tokens"),
])
def test_bad_engine_options_exit_2(args, text):
    res = run_cli("compare", "--memory", "120GiB", *args)
    assert res.returncode == 2 and text in res.stderr and "Traceback" not in res.stderr
