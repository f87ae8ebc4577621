"""`kvatlas tune`'s vLLM flags checked against the installed vLLM's own planner (0.34 or 0.33) on the
CPU: with the tuned flags and with its defaults, its KVCacheConfig has exactly the predicted blocks and
its start-up log line ("GPU KV cache size") exactly the predicted figure; its engine core starts with
the tuned flags (the retention interval is one it accepts). `compare --engines vllm,vllm@0.33` and tune's
figures are also held beside both releases' planners in one run, the other release's in its own venv
(`.venv-vllm-0.33.0` beside `.venv-vllm`, or KVATLAS_VLLM_OTHER_PYTHON)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvatlas.advice import profile, tune
from kvatlas.driving.traces import read_trace

HEAD = "tests/data/mooncake_head.jsonl"
GIB = 2**30


@pytest.fixture(scope="module")
def kv():
    from kvatlas.integrations.vllm import offline as vllm
    return vllm


def _options(flags: dict) -> dict:
    return {"max_num_seqs": flags["--max-num-seqs"], "max_num_batched_tokens": flags["--max-num-batched-tokens"],
            "max_model_len": flags["--max-model-len"],
            "prefix_cache_retention_interval": flags["--prefix-cache-retention-interval"]}


@pytest.fixture(scope="module")
def advice():
    reqs, _ = read_trace(HEAD)
    return tune("deepseek-v4-flash", profile(reqs), engines=("vllm",), tp=4)


@pytest.mark.parametrize("which", ["tuned", "default"])
def test_planner_gives_the_predicted_blocks_and_logged_figure(kv, advice, which):
    setting = getattr(advice.engine("vllm"), which)
    cfg, config = kv.kv_cache_config("deepseek-v4-flash", advice.budget_bytes, **_options(setting.flags))
    assert cfg.num_blocks == setting.reported["num_gpu_blocks"]
    assert config.cache_config.kv_cache_size_tokens == setting.reported["gpu_kv_cache_size_tokens"]


def test_engine_core_starts_with_the_tuned_flags(kv, advice):
    e = advice.engine("vllm")
    eng = kv.build_engine("deepseek-v4-flash", advice.budget_bytes, **_options(e.tuned.flags))
    assert eng.kv_cache_config.num_blocks == e.tuned.reported["num_gpu_blocks"]
    assert eng.core.scheduler.max_num_running_reqs == e.tuned.flags["--max-num-seqs"]


def _release(kv) -> str:
    return kv.series()


def test_compare_figures_are_the_installed_releases_planner(kv):
    """`compare --engines vllm,vllm@0.33`: the entry of the installed release equals its own planner,
    run here on the same budget and limits (the other release's entry is checked in its own venv)."""
    from kvatlas.engines import compare
    results = compare("deepseek-v4-flash", 120 * GIB, lineup=["vllm", "vllm@0.33"], max_model_len=1_048_576)
    assert [r.engine for r in results] == ["vllm 0.34", "vllm 0.33"]
    mine = next(r for r in results if r.engine == f"vllm {_release(kv)}")
    cfg, config = kv.kv_cache_config("deepseek-v4-flash", 120 * GIB, max_model_len=1_048_576)
    assert cfg.num_blocks == mine.figures["num_blocks"] == 128_561
    assert config.cache_config.kv_cache_size_tokens == mine.reported.capacity_tokens == 12_507_513
    assert {t.block_stride for t in cfg.kv_cache_tensors} == {mine.figures["bytes_per_block"]}


ROOT = Path(__file__).resolve().parents[2]
OTHER_PYTHON_ENV = "KVATLAS_VLLM_OTHER_PYTHON"
OTHER_VENV = {"0.34": ".venv-vllm-0.33.0", "0.33": ".venv-vllm"}   # what setup_env.sh builds for the other release


def _other_python(kv) -> str:
    """The other release's venv (KVATLAS_VLLM_OTHER_PYTHON names its python), or skip saying how to build it."""
    python = os.environ.get(OTHER_PYTHON_ENV) or str(ROOT / OTHER_VENV[kv.series()] / "bin" / "python")
    if not os.path.exists(python):
        other = "0.33.0" if kv.series() == "0.34" else "0.34.0"
        pytest.skip(f"the other vLLM release's venv is not built: KVATLAS_VLLM_VERSION={other} bash "
                    f"tests/vllm_plugin/setup_env.sh (or {OTHER_PYTHON_ENV}=its python)")
    return python


def test_compare_and_tune_equal_both_releases_planners_side_by_side(kv, advice):
    """`compare --engines vllm,vllm@0.33` and `tune`'s vLLM flags, beside 0.34's and 0.33's own planners
    in one run: the installed release's here, the other's in its own venv (planner_figures.py)."""
    from kvatlas.engines import compare
    budget, mm = 120 * GIB, {"max_model_len": 1_048_576}
    cases = [["deepseek-v4-flash", budget, mm], ["deepseek-v4-pro", budget, mm]]
    cases += [["deepseek-v4-flash", advice.budget_bytes, _options(getattr(advice.engine("vllm"), w).flags)]
              for w in ("tuned", "default")]
    import planner_figures
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "VLLM_CONFIGURE_LOGGING": "0"}
    out = subprocess.run([_other_python(kv), str(Path(planner_figures.__file__)), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs, mine = json.loads(out.stdout.strip().splitlines()[-1]), planner_figures.figures(cases)
    planners = {mine["series"]: mine["cases"], theirs["series"]: theirs["cases"]}
    assert sorted(planners) == ["0.33", "0.34"], sorted(planners)
    for i, model in enumerate(("deepseek-v4-flash", "deepseek-v4-pro")):
        results = compare(model, budget, lineup=["vllm", "vllm@0.33"], **mm)
        assert [r.engine for r in results] == ["vllm 0.34", "vllm 0.33"]
        for r in results:
            own = planners[r.engine.split()[1]][i]
            assert (r.figures["num_blocks"], r.reported.capacity_tokens, [r.figures["bytes_per_block"]]) == \
                (own["num_blocks"], own["logged_tokens"], own["bytes_per_block"]), (r.engine, own)
    assert planners["0.34"][0]["num_blocks"] == 128_561 and planners["0.34"][0]["logged_tokens"] == 12_507_513
    for j, which in enumerate(("tuned", "default")):
        reported = getattr(advice.engine("vllm"), which).reported
        for release, figs in planners.items():
            assert (figs[2 + j]["num_blocks"], figs[2 + j]["logged_tokens"]) == \
                (reported["num_gpu_blocks"], reported["gpu_kv_cache_size_tokens"]), (release, which)


@pytest.mark.skipif("__import__('kvatlas.integrations.vllm.offline', fromlist=['x']).series() != '0.34'",
                    reason="the extensible cache is vLLM 0.34's")
@pytest.mark.parametrize("peak", [0, 6 * GIB])
def test_elastic_sizing_is_vllms_measurement(kv, peak):
    """kvatlas's model of 0.34's sizing (engines.vllm.sizing_modes) beside vLLM's own code: its
    utilization default, its headroom constants, the reservation, the measurement after warm-up
    (`measure_kv_cache_bytes`), the blocks its ExtensibleKVCache commits; and the fixed rule's
    budget through its planner."""
    from vllm.config import CacheConfig
    from vllm.v1.worker import extensible_kv_cache as ext

    from kvatlas.engines import run_engine
    from kvatlas.engines import vllm as model
    for extensible in (True, False):
        c = CacheConfig(enable_extensible_kv_cache=extensible)
        assert c.resolved_gpu_memory_utilization == model.resolved_gpu_memory_utilization(None, extensible)
    assert (ext.KV_CACHE_MARGIN_FLOOR_BYTES, ext.KV_CACHE_MARGIN_FRACTION, ext.KV_CACHE_NON_TORCH_RESERVE_BYTES,
            ext.KV_CACHE_WARMUP_RESERVE_FRACTION) == (model.MARGIN_FLOOR_BYTES, model.MARGIN_FRACTION,
                                                      model.NON_TORCH_RESERVE_BYTES, model.WARMUP_RESERVE_FRACTION)
    r = run_engine("vllm", "deepseek-v4-flash", tp=4, weights_bytes="auto", max_model_len=65_536,
                   activation_peak_bytes=peak)
    m = r.figures["sizing"]
    e, total, weights = m["extensible"], m["gpu_total_bytes"], m["weights_bytes"]
    warmup = {"init_free_memory": total, "requested_memory": total, "non_kv_bytes": weights,
              "transient_peak_bytes": peak}
    assert e["kv_bytes"] == ext.measure_kv_cache_bytes(init_free_memory=total, free_memory=total - weights - (2 << 20),
                                                       committed_bytes=2 << 20, requested_memory=total,
                                                       transient_peak_bytes=peak)
    # the reservation is what the profiler reports at utilization 1.0; warm-up then measures
    cfg, config = kv.kv_cache_config("deepseek-v4-flash", e["reserved_bytes"], max_model_len=65_536,
                                     extensible_kv_cache=True, warmup=warmup)
    assert cfg.num_blocks == e["num_blocks"] and config.cache_config.num_gpu_blocks == e["num_blocks"]
    assert e["reserved_blocks"] == e["reserved_bytes"] // r.figures["bytes_per_block"]
    fixed, _ = kv.kv_cache_config("deepseek-v4-flash", m["fixed"]["kv_bytes"], max_model_len=65_536)
    assert fixed.num_blocks == m["fixed"]["num_blocks"] < e["num_blocks"]
