"""Test-only stand-in for torchvision in the SGLang integration venv.

SGLang imports ``torchvision.transforms`` (and friends) at module level for multimodal preprocessing;
PyPI's torchvision builds need a CUDA torch. Nothing on the KV-pool path calls it, so every
``torchvision.*`` submodule imports, and touching anything in one raises, naming the stand-in.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _Absent:
    """Any attribute of a stand-in module: usable as a base class or annotation, fails if called."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a test stand-in here")

    def __getattr__(self, attr):
        return _Absent(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


class _StandinModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Finder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Absent(f"torchvision.{attr}")
