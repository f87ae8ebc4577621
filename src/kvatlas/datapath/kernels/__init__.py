"""Triton kernels for CUDA, imported only when a CUDA tensor asks for them.

CPU-only installs never import triton: `available()` only looks for the package, and the kernel
modules are imported on first use. Formats without a kernel fall back to the torch reference,
which runs on CUDA too.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

# formats with store/gather kernels (codec format names)
KERNEL_FORMATS = frozenset({"fp8_ds_mla", "indexer_fp8"})


@lru_cache(maxsize=1)
def available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    import torch
    return torch.cuda.is_available()


def supports(codec, op: str) -> bool:
    return available() and codec.fmt.name in KERNEL_FORMATS


def store(codec, geom, buffer, layers: range, slots, values) -> None:
    from . import codec_triton
    codec_triton.store(codec, geom, buffer, layers, slots, values)


def gather(codec, geom, buffer, layers: range, slots):
    from . import codec_triton
    return codec_triton.gather(codec, geom, buffer, layers, slots)


def layer_ops(codec, geom, buffer, layer: int, layers: int = 1):
    from . import codec_triton
    return codec_triton.LayerOps(codec, geom, buffer, layer, layers)


def compress(*args, **kwargs):
    from . import compress_triton
    return compress_triton.compress(*args, **kwargs)


def append(*args, **kwargs):
    from . import compress_triton
    return compress_triton.append(*args, **kwargs)
