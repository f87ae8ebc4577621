"""The installed vLLM's own planner figures for a list of deployments, as JSON: imported by the tests,
and run as a script in the other release's venv so that one test holds kvatlas's figures beside both
releases' planners (0.34's and 0.33's), each run by its own code.

    python tests/vllm_plugin/planner_figures.py '[["deepseek-v4-flash", 128849018880, {"max_model_len": 1048576}]]'

prints one line {"series": "0.34", "cases": [{"num_blocks", "logged_tokens", "bytes_per_block"}]}.
"""

import json
import sys


def figures(cases) -> dict:
    """`cases`: [model, budget bytes, EngineOptions fields]; vLLM's KVCacheConfig and logged figure for each."""
    from kvatlas.integrations.vllm import offline as kv
    out = []
    for model, budget, options in cases:
        cfg, config = kv.kv_cache_config(model, budget, **options)
        out.append({"num_blocks": cfg.num_blocks, "logged_tokens": config.cache_config.kv_cache_size_tokens,
                    "bytes_per_block": sorted({t.block_stride for t in cfg.kv_cache_tensors})})
    return {"series": kv.series(), "cases": out}


if __name__ == "__main__":
    print(json.dumps(figures(json.loads(sys.argv[1]))))
