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
                 "vllm 0.34 [hybrid manager]", "GPU KV cache size: 12,507,513", "max_total_num_tokens: 17,798,400",
                 "+12,822,592", "1.785×", "kvatlas re-planned for one context"):
        assert text in out, text


def test_json(capsys):
    assert main(["compare", "deepseek-v4-pro", "--memory", "120GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "kvatlas.compare" and doc["schema_version"] == 1
    by = {(e["engine"], e["variant"]): e for e in doc["engines"]}
    assert by[("vllm 0.34", "hybrid manager")]["reported"]["capacity_tokens"] == 8_729_604
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


def test_states_gpu_and_entry_point_and_marks_refusals(capsys):
    assert main(["compare", "--memory", "120GiB", "--indexer", "fp4"]) == 0
    out = capsys.readouterr().out
    assert "max running 256, GPU h200" in out
    assert ("- vllm 0.34 [hybrid manager, fp4 indexer]: assumes vllm serve on h200: max_num_batched_tokens 8,192 "
            "(its default there), max_num_seqs 256 (given; its default there 1,024)") in out
    assert "REFUSED on h200: the fp4 indexer needs a Blackwell GPU; h200 is hopper" in out
    assert "vllm 0.34 [hybrid manager, fp4 indexer] REFUSED" in out  # its table rows carry the mark
    assert main(["compare", "--memory", "120GiB", "--gpu", "b200", "--vllm-entrypoint", "offline", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpu"] == "b200"
    vl = doc["engines"][-1]
    assert vl["refused"] is None and vl["figures"]["max_num_batched_tokens"] == 16_384
    assert vl["assumes"].startswith("the offline LLM class on b200")
    assert main(["compare", "--memory", "120GiB", "--indexer", "fp4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["refused"] for e in doc["engines"]] == [None, None, None,
                                                       "the fp4 indexer needs a Blackwell GPU; h200 is hopper"]


def test_sglang_truth_counts_free_lists(capsys):
    assert main(["compare", "--memory", "120GiB", "--engines", "sglang"]) == 0
    assert "130,082,784,840" in capsys.readouterr().out  # 130,082,170,968 + 613,872 B of lists and counter


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp.png"
    assert main(["compare", "--memory", "120GiB", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, text", [
    (["--engines", "kvatlas,trtllm"], "--engines: 'trtllm' is not a modelled engine"),
    (["--engines", "vllm", "--state-dtype", "bf16"], "--state-dtype: vllm 0.34: keeps compressor state in fp32"),
    (["--engines", "vllm", "--sglang-swa-ratio", "0.2"], "sglang options were given"),
    (["--engines", "sglang:cap", "--sglang-swa-ratio", "0.2"], "--sglang-swa-ratio"),
    (["--engines", "sglang", "--draft-tokens", "12"], "--draft-tokens"),
    (["--engines", "vllm", "--vllm-entrypoint", "api"], "invalid choice: 'api'"),
    (["--engines", "vllm", "--gpu", "a100"], "invalid choice: 'a100'"),
])
def test_bad_engine_options_exit_2(args, text):
    res = run_cli("compare", "--memory", "120GiB", *args)
    assert res.returncode == 2 and text in res.stderr and "Traceback" not in res.stderr


def test_verdicts_one_line_per_engine_before_the_tables(capsys):
    from kvatlas.cli import main
    assert main(["compare", "--memory", "120GiB"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("verdicts\n"):out.index("\nmemory")].strip().splitlines()[1:]
    assert len(lines) == 4 and out.index("verdicts") < out.index("capacity (same budget")
    assert lines[1] == ("- sglang 0.5.23 [ratio 0.1 (default)]: holds 17,798,400 tokens, kvatlas 1.78× that; its "
                        "max_total_num_tokens (17,798,400 tokens) is the truth, its memory gauge reads 0 B of "
                        "130,082,784,840 B; 12,822,592 B (12.23 MiB) over its budget, 1.14 GiB beside it, "
                        "28,814,784 B unreachable")
    assert "GPU KV cache size says 12,507,513 tokens, 0.42× the 29,504,512 it holds" in lines[3]
    assert "memory gauge is exact; within its budget" in lines[0]
    assert main(["compare", "--memory", "120GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdicts"] == [l[2:] for l in lines] == [e["verdict"] for e in doc["engines"]]
