"""vLLM integration tests: they run in the venv tests/vllm_plugin/setup_env.sh builds (vLLM 0.33.0 on the
CPU, without its dependencies) and are skipped where vLLM is not installed, e.g. in the main test
environment."""

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM 0.33.0 not installed: run tests/vllm_plugin/setup_env.sh, then "
                                   ".venv-vllm/bin/python -m pytest tests/vllm_plugin")
    for item in items:
        if "tests/vllm_plugin/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
