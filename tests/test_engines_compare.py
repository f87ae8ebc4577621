"""The lineup: kvatlas beside the engine models, and the contract that it holds at least as many tokens."""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas import plan
from kvatlas.engines import compare, parse_entry, run_engine
from kvatlas.errors import BudgetError, ConfigError

GIB = 2**30


@pytest.mark.parametrize("model", ["deepseek-v4-flash", "deepseek-v4-pro"])
@pytest.mark.parametrize("kw", [{}, {"draft_tokens": 4}, {"indexer": "fp4"}, {"max_model_len": 131_072}])
def test_kvatlas_holds_at_least_as_many_tokens(model, kw):
    results = compare(model, 120 * GIB, **kw)
    base = results[0]
    assert base.engine == "kvatlas" and len(results) == 4
    for r in results[1:]:
        assert base.token_capacity >= r.token_capacity, r.variant


def test_bf16_state_lineup_without_vllm():
    results = compare("deepseek-v4-flash", 120 * GIB, lineup=("kvatlas", "sglang", "sglang:cap"), state_dtype="bf16")
    assert all(results[0].token_capacity >= r.token_capacity for r in results[1:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(["deepseek-v4-flash", "deepseek-v4-pro"]), gib=st.integers(24, 160),
       requests=st.sampled_from([1, 8, 64, 256, 512]), draft=st.sampled_from([0, 2, 4]),
       max_len=st.sampled_from([8192, 131_072, 1_048_576]))
def test_kvatlas_never_holds_fewer_tokens(model, gib, requests, draft, max_len):
    opts = dict(max_running_requests=requests, draft_tokens=draft, max_model_len=max_len)
    try:
        results = compare(model, gib * GIB, **opts)
    except BudgetError:
        return  # some engine (or kvatlas) cannot start at all here
    for r in results[1:]:
        assert results[0].token_capacity >= r.token_capacity, (r.engine, r.variant)
        assert r.reachable_bytes + r.dead_bytes == r.allocated_bytes


def test_native_row_is_the_plan():
    p = plan("deepseek-v4-flash", 120 * GIB)
    r = run_engine("kvatlas", "deepseek-v4-flash", 120 * GIB)
    assert (r.allocated_bytes, r.dead_bytes, r.token_capacity) == (p.total_bytes, p.dead_bytes, p.max_total_tokens)
    assert r.unreachable_bytes == 0 and r.reported.memory_gauge_bytes == p.total_bytes


def test_lineup_entries():
    assert parse_entry("sglang:cap") == ("sglang", {"swa_mode": "cap"})
    assert parse_entry("vllm") == ("vllm", {})
    with pytest.raises(ConfigError, match="engine: 'trtllm' is not a modelled engine"):
        parse_entry("trtllm")
    with pytest.raises(ConfigError, match="sglang:cap"):
        parse_entry("sglang:fast")


def test_engine_options_must_match_the_lineup():
    with pytest.raises(ConfigError) as err:
        compare("deepseek-v4-flash", 120 * GIB, lineup=("vllm",), engine_options={"sglang": {"swa_ratio": 0.2}})
    assert err.value.field == "engine"
    with pytest.raises(ConfigError) as err:
        compare("deepseek-v4-flash", 120 * GIB, lineup=("vllm",), engine_options={"vllm": {"swa_ratio": 0.2}})
    assert err.value.field == "swa_ratio"


def test_sglang_ratio_option_reaches_the_engine():
    r = compare("deepseek-v4-flash", 120 * GIB, lineup=("sglang",), engine_options={"sglang": {"swa_ratio": 0.2}})[0]
    assert r.figures["swa_ratio"] == 0.2 and "default" not in r.variant


def test_engine_models_do_not_import_torch():
    code = ("import sys, kvatlas.engines.sglang, kvatlas.engines.vllm, kvatlas.engines.native, kvatlas.cli.compare;"
            "from kvatlas.engines import compare; compare('deepseek-v4-flash', 120 * 2**30);"
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
