import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch
        has_cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
