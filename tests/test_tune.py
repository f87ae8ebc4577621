"""kvatlas.advice: the workload profile, the flags tune picks and what the engine models predict
for them (the engines' own code checks the same figures in tests/sglang_plugin and tests/vllm_plugin)."""

import json
import re

import pytest

from kvatlas.advice import Pace, profile, tune
from kvatlas.advice.tune import pick_chunk, pick_running, sglang_swa_need
from kvatlas.cli import main
from kvatlas.driving.traces import read_trace
from kvatlas.driving.workload import Request
from kvatlas.engines import sglang as sg
from kvatlas.errors import ConfigError

HEAD = "tests/data/mooncake_head.jsonl"


@pytest.fixture(scope="module")
def head():
    reqs, _ = read_trace(HEAD)
    return reqs


@pytest.fixture(scope="module")
def flash(head):
    return tune("deepseek-v4-flash", profile(head), tp=4)


def test_profile_by_hand():
    pace = Pace(pass_s=1.0, prefill_s_per_token=0.0, decode_s_per_token=0.0)   # one second a pass, 256 tokens
    reqs = [Request(id="a", arrival_s=0.0, prompt_tokens=256, output_tokens=3),    # prefill [0, 1), 3 passes: [0, 4)
            Request(id="b", arrival_s=1.0, prompt_tokens=512, output_tokens=1),    # [1, 3) + 1: [1, 4)
            Request(id="e", arrival_s=1.5, prompt_tokens=256, output_tokens=1),    # waits for the stream: [3, 5)
            Request(id="c", arrival_s=5.0, prompt_tokens=256, output_tokens=1),    # [5, 7)
            Request(id="d", arrival_s=0.0, prompt_tokens=256, output_tokens=1, after="c", think_s=1.0)]  # [8, 10)
    p = profile(reqs, pace, chunk=256)
    assert (p.peak_in_flight, p.requests, p.sessions, p.prompt_max, p.context_max) == (3, 5, 4, 512, 513)
    assert p.span_s == 10.0 and p.mean_in_flight == pytest.approx((4 + 3 + 2 + 2 + 2) / 10)
    assert pick_running(p) == 8 and pick_running(p.__class__(**{**p.to_dict(), "peak_in_flight": 33})) == 48


def test_chunk_rule():
    p = profile([Request(id="a", arrival_s=0.0, prompt_tokens=20000, output_tokens=1)])
    assert pick_chunk(p, Pace()) == 8192        # 20 ms per pass ≤ 10% of 8,192 × 40 µs
    assert pick_chunk(p, Pace(pass_s=0.005)) == 2048
    short = profile([Request(id="a", arrival_s=0.0, prompt_tokens=1000, output_tokens=1)])
    assert pick_chunk(short, Pace()) == 2048    # no larger than the median prompt needs


def test_sglang_ratio_is_the_smallest_that_holds_the_need(flash, head):
    e = flash.engine("sglang")
    ratio = e.tuned.flags["--swa-full-tokens-ratio"]
    from dataclasses import replace
    opts = replace(flash.options, max_running_requests=flash.running, chunked_prefill_tokens=flash.chunk,
                   max_model_len=flash.max_model_len)
    need = sglang_swa_need(flash.model, opts, flash.budget_bytes, max(r.prompt_tokens for r in head))
    swa = lambda r: sg.configure(flash.model, sg.setup_for(flash.model, opts, {**sg.OPTIONS, "swa_ratio": r}),
                                 flash.budget_bytes).swa_tokens
    assert swa(ratio) >= need > swa(round(ratio - 1e-4, 4)) and e.tuned.reported["swa_tokens"] == swa(ratio)
    # the default ratio (0.1) spends far more on SWA: the tuned flags hold more full tokens
    assert e.default.reported["swa_full_tokens_ratio"] == 0.1 and e.capacity_ratio > 1.5


def test_tuned_flags_raise_capacity_over_the_defaults(flash):
    sgl, vll, kva = (flash.engine(n) for n in ("sglang", "vllm", "kvatlas"))
    assert sgl.tuned.token_capacity > sgl.default.token_capacity
    assert vll.tuned.token_capacity > vll.default.token_capacity
    assert vll.default.flags["--max-num-seqs"] == 1024 and vll.tuned.flags["--max-num-seqs"] == flash.running
    assert kva.tuned.flags["--prefix-checkpoints"] == flash.checkpoints > 0 == kva.default.flags["--prefix-checkpoints"]
    # every tuned engine holds the workload's longest request and its peak in flight at the p90 context
    for e in (sgl, vll, kva):
        assert e.tuned.requests_at[flash.profile.context_max] >= 1
        assert e.tuned.requests_at[flash.profile.context_p90] == flash.running


def test_two_alternating_1m_sessions_get_a_pool_that_keeps_both_tails():
    reqs = []
    for k in range(2):
        for s in "AB":
            prompt = 1_000_000 if k == 0 else 1_002_200
            reqs.append(Request(id=f"{s}{k}", arrival_s=0.0, prompt_tokens=prompt, output_tokens=200,
                                after=None if k == 0 else f"{s}0"))
    t = tune("deepseek-v4-flash", profile(reqs), engines=("sglang",), tp=4)
    e = t.engine("sglang")
    tails = 2 * (128 + 256)
    assert e.tuned.reported["swa_tokens"] >= 1_002_200 + 200 + tails   # one session's prefill whole + both tails
    from dataclasses import replace
    opts = replace(t.options, max_running_requests=t.running, chunked_prefill_tokens=t.chunk, max_model_len=t.max_model_len)
    cap = sg.configure(t.model, sg.setup_for(t.model, opts, {**sg.OPTIONS, "swa_mode": "cap"}), t.budget_bytes)
    assert cap.swa_tokens < 1_000_000   # cap mode's pool cannot hold one prefill: it evicts the other tail
    assert e.tuned.token_capacity >= 2 * 1_002_400   # and both sessions' full KV stays cached


def test_tune_cli_json(capsys):
    assert main(["tune", "--tp", "4", "--workload", HEAD, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "kvatlas.tune" and doc["schema_version"] == 1 and doc["simulated"] is None
    assert [e["engine"] for e in doc["engines"]] == ["sglang 0.5.23", "vllm 0.34", "kvatlas"]
    assert doc["budget_bytes"] == 94_755_285_790 and doc["weights_bytes"] == 40_924_052_296
    sgl = doc["engines"][0]
    assert sgl["command"].startswith("--swa-full-tokens-ratio ") and sgl["tuned"]["token_capacity"] > 0
    assert main(["tune", "--tp", "4", "--workload", HEAD]) == 0
    out = capsys.readouterr().out
    assert "sglang 0.5.23: --swa-full-tokens-ratio" in out and "vllm 0.34: --max-num-seqs" in out


def test_tune_refuses_bad_input(capsys):
    assert main(["tune", "--tp", "4", "--workload", HEAD, "--engines", "trtllm"]) == 2
    assert "--engines" in capsys.readouterr().err
    assert main(["tune", "--tp", "4", "--workload", HEAD, "--engines", "sglang", "--simulate"]) == 2
    with pytest.raises(ConfigError):
        tune("deepseek-v4-flash", profile([]))


def test_tune_simulate_measures_hits_and_the_peak(capsys):
    args = ["tune", "tiny-v4", "--memory", "1GiB", "--engines", "kvatlas", "--simulate", "--duration", "10",
            "--rate", "2", "--system-prompts", "2", "--system-prompt-len", "1024", "--output-len", "uniform:4:16",
            "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    d, t = doc["simulated"]["default"], doc["simulated"]["tuned"]
    assert d["finished"] == t["finished"] == doc["workload"]["requests"]
    assert d["hit_ratio"] == 0 < t["hit_ratio"] and t["prefill_tokens"] + t["hit_tokens"] == d["prefill_tokens"]
    assert doc["engines"][0]["tuned"]["flags"]["--max-running-requests"] == pick_running(profile_of(doc))


def profile_of(doc):
    from kvatlas.advice import Profile
    return Profile(**doc["workload"])


# ------------------------------------------------------------------ advice that cannot hurt (issues 38, 39)
CONTEXT_FLAGS = ("--context-length", "--max-model-len")


def _tuned_contexts(doc) -> list[int]:
    return [int(e["tuned"]["flags"][f]) for e in doc["engines"] for f in CONTEXT_FLAGS if f in e["tuned"]["flags"]]


@pytest.mark.parametrize("extra,floor", [([], 1_048_576), (["--max-model-len", "65536"], 65_536),
                                         (["--workload", HEAD], 1_048_576)])
def test_tune_sets_no_context_below_the_models_or_the_users(capsys, extra, floor):
    """Without a workload (or with one: a sample is no limit on the next request) every engine's
    tuned context is the model's, or the user's --max-model-len; the text says what it assumed."""
    assert main(["tune", "--tp", "4", *extra, "--json"]) == 0
    contexts = _tuned_contexts(json.loads(capsys.readouterr().out))
    assert len(contexts) == 3 and min(contexts) >= floor, contexts
    assert main(["tune", "--tp", "4", *extra]) == 0
    out = capsys.readouterr().out
    import re
    printed = [int(v.replace(",", "")) for v in re.findall(r"--(?:context-length|max-model-len) (\d[\d,]*)", out)]
    assert len(printed) >= 6 and min(printed) >= floor, printed   # the commands and the tables' and why's figures
    assert ("assumed: no workload given" in out) == ("--workload" not in extra)


def test_every_tuned_row_says_why_its_figures_differ(flash):
    for e in flash.engines:
        lines = [w for w in e.why if w.startswith("token capacity ")]
        assert len(lines) == 1 and f"{e.capacity_ratio:.2f}× the default's" in lines[0], e.why
    kva = flash.engine("kvatlas")
    assert re.search(r"[\d,]+ resume points (\([\d,]+ kept, [^)]*\) )?take [\d,]+ B",
                     next(w for w in kva.why if w.startswith("token capacity ")))


def test_the_kvatlas_default_row_is_what_compare_says(capsys):
    assert main(["compare", "--tp", "8", "--json"]) == 0
    comp = next(e for e in json.loads(capsys.readouterr().out)["engines"] if e["engine"] == "kvatlas")
    assert main(["tune", "--tp", "8", "--engines", "kvatlas", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engines"][0]["default"]["token_capacity"] == comp["token_capacity"]
    assert doc["budget_bytes"] == comp["budget_bytes"] == 114_536_191_390
    assert doc["engines"][0]["default"]["max_running_requests"] == comp["max_running_requests"]
    why = next(w for w in doc["engines"][0]["why"] if w.startswith("token capacity "))
    assert "resume points (7,018 kept" in why and f"{comp['token_capacity']:,} →" in why   # what differs, and why


def test_engines_named_twice_are_advised_once(capsys):
    assert main(["tune", "tiny-v4", "--memory", "1GiB", "--engines", "kvatlas,kvatlas,vllm,vllm", "--json"]) == 0
    assert [e["engine"] for e in json.loads(capsys.readouterr().out)["engines"]] == ["kvatlas", "vllm 0.34"]
    t = tune("tiny-v4", profile([Request(id="a", arrival_s=0.0, prompt_tokens=100, output_tokens=10)]),
             memory_bytes=2**30, engines=["vllm", "vllm"])
    assert [e.engine for e in t.engines] == ["vllm 0.34"]


def test_weights_zero_as_plan_takes_it(capsys):
    assert main(["plan", "--weights", "0", "--json"]) == 0
    plan_budget = json.loads(capsys.readouterr().out)["budget_bytes"]
    assert main(["tune", "--weights", "0", "--engines", "kvatlas", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["budget_bytes"] == plan_budget and doc["weights_bytes"] == 0


def test_a_small_budget_gets_resume_points_that_fit(capsys):
    """tiny-v4 in 64 MiB: kvatlas's defaults (256 requests) do not start there, and the tuned row
    says so; its own pick of resume points fits (it used to pick 31, which did not)."""
    assert main(["tune", "tiny-v4", "--memory", "64MiB", "--engines", "kvatlas", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["engines"][0]
    assert e["default"]["token_capacity"] == 0 and "refused" in e["default"]["reported"]
    import kvatlas
    f = e["tuned"]["flags"]
    p = kvatlas.plan("tiny-v4", "64MiB", max_running_requests=f["--max-running-requests"],
                     max_model_len=f["--max-model-len"], chunked_prefill_tokens=f["--chunked-prefill-tokens"],
                     prefix_checkpoints=f["--prefix-checkpoints"])
    assert p.max_total_tokens == e["tuned"]["token_capacity"] and any("refuses to start" in w for w in e["why"])
