"""SGLang integration tests: they run in the venv tests/sglang_plugin/setup_env.sh builds (SGLang 0.5.23 on
the CPU) and are skipped where SGLang is not installed (tests/conftest.py), e.g. in the main test run.

SGLang's metrics run prometheus_client in multiprocess mode; the directory must be set before
prometheus_client is first imported, so it is set here, as SGLang's launcher does for its processes.
"""

import importlib.util
import os
import tempfile

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
if HAVE_SGLANG and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvatlas-sglang-metrics-")


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own plugin loader, once per process, as every SGLang process runs it."""
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry
    return HookRegistry


@pytest.fixture(scope="session")
def sglang_sequence():
    return _sglang_sequence


def _sglang_sequence(model, memory, requests, swa_mode="ratio"):
    """Build the pools through SGLang's argument pipeline, configurator and _init_pools, with no
    kvatlas call in between: whatever kvatlas does happens inside SGLang's own calls (the hooks)."""
    import torch
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    from kvatlas.integrations.sglang import plugin as ks
    from kvatlas.units import parse_bytes
    import tempfile as tf
    with tf.TemporaryDirectory() as tmp:
        from sglang.srt import runtime_context
        from sglang.srt.server_args import prepare_server_args
        args = prepare_server_args(["--model-path", ks._model_dir(model, tmp), "--skip-tokenizer-init",
                                    "--device", "cpu", "--page-size", "256", "--max-running-requests",
                                    str(requests), "--chunked-prefill-size", "8192", "--kv-cache-dtype", "fp8_e4m3"])
        if swa_mode == "cap":
            args._swa_full_tokens_ratio_explicitly_set = False
        args.resolve_once()
        runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
        kvc = ks._configurator(args)
    cfg = kvc.config_from_budget(parse_bytes(memory))
    cfg.max_running_requests = kvc.resolve_max_num_reqs(cfg.max_total_num_tokens)
    cfg = create_memory_pool_configurator(kvc).finalize_with_max_running_requests(cfg)
    sizes = kvc._derive_pool_sizes(config=cfg)
    zeros, torch.zeros = torch.zeros, torch.empty
    try:
        return args, kvc._init_pools(sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    finally:
        torch.zeros = zeros
