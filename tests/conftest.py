import importlib.util
import os

import pytest

# the engine plugins' tests run in venvs of their own (each folder's setup_env.sh builds it) and are
# skipped wherever that engine is not installed, e.g. in the main test environment
ENGINE_FOLDERS = {"tests/sglang_plugin/": ("sglang", "SGLang 0.5.23", ".venv-sglang"),
                  "tests/vllm_plugin/": ("vllm", "vLLM 0.34.0", ".venv-vllm")}


def pytest_collection_modifyitems(config, items):
    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch
        has_cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
    for folder, (module, engine, venv) in ENGINE_FOLDERS.items():
        if importlib.util.find_spec(module) is not None:
            continue
        skip = pytest.mark.skip(reason=f"{engine} not installed: run {folder}setup_env.sh, then "
                                       f"{venv}/bin/python -m pytest {folder.rstrip('/')}")
        for item in items:
            if folder in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(skip)
