"""The routing harness's vLLM replica, kept under its first name: it lives in
`kvatlas.integrations.vllm.replica` (the vllm package holds every module that imports vLLM)."""

from .vllm.replica import *  # noqa: F401,F403  (the same names)
from .vllm.replica import __all__  # noqa: F401
