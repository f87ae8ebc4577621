"""The arena: a plan's buffers as real tensors, through one backend interface.

The plain backend allocates the whole buffer map as ONE uint8 slab and carves every buffer as a
view at its planned offset. One allocation makes the accounting exact and cheap: on CUDA the
caching allocator rounds a block to 512 B (the plan is 512-aligned already) and reserves one
segment (rounded to 2 MiB above 10 MiB), so `memory_allocated()` grows by exactly the plan's
total and `memory_reserved()` by `cuda_segment_bytes(total)`. One tensor per layer per pool would
instead pay 512-B rounding and segment slack per tensor.

Zero-fill: the slab comes from `torch.empty` (no pass over memory). Only what a format reads
before anyone writes it is initialised: the null page/slot (unit 0) of every buffer, so padded
writes and reads through it see zeros, and the block tables (all entries point at the null page).
Compressor-state rings are cleared per request on admission (kv = 0, score = -inf) by the
allocator, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.buffers import BufferSpec
from ..errors import BudgetError, ConfigError
from ..planning.planner import Plan
from ..units import fmt_bytes, round_up

# PyTorch CUDACachingAllocator constants (c10/cuda/CUDACachingAllocator.cpp)
_SMALL_SIZE, _SMALL_BUFFER = 1 << 20, 2 << 20
_MIN_LARGE_ALLOC, _LARGE_BUFFER, _ROUND_LARGE = 10 << 20, 20 << 20, 2 << 20
_MIN_BLOCK = 512


def cuda_block_bytes(nbytes: int) -> int:
    """Growth of memory_allocated() for one torch.empty of nbytes."""
    return round_up(max(nbytes, 1), _MIN_BLOCK)


def cuda_segment_bytes(nbytes: int) -> int:
    """Growth of memory_reserved() for one allocation in a fresh caching allocator."""
    size = cuda_block_bytes(nbytes)
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return round_up(size, _ROUND_LARGE)


_TORCH_DTYPES = ("uint8", "int32", "float32", "bfloat16", "float64")


def torch_dtype(name: str):
    import torch
    if name not in _TORCH_DTYPES:
        raise ConfigError("dtype", f"{name!r} has no torch dtype here", f"use one of {_TORCH_DTYPES}")
    return getattr(torch, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """One buffer as allocated: its planned spec, its typed tensor and the bytes it spans."""

    spec: BufferSpec
    tensor: object          # torch.Tensor shaped spec.shape, dtype spec.dtype
    tensor_bytes: int       # bytes of the allocation this buffer spans, alignment tail included


class Backend:
    """What an arena needs from memory. `tensor_bytes` is measured from the storages actually
    allocated (each counted once), never copied from the plan. Subclasses: PlainBackend here; a VMM backend maps
    physical memory lazily under one address reservation."""

    name = "abstract"
    commits_upfront = True   # the whole plan is physical memory from allocate() on
    holds_memory = True      # False: bookkeeping only, buffers are meta tensors (cache/bookkeeping.py)

    def allocate(self, plan: Plan, device) -> dict[str, object]:
        """Return a uint8 tensor of spec.bytes for every buffer, by name."""
        raise NotImplementedError

    @property
    def tensor_bytes(self) -> int:
        raise NotImplementedError

    @property
    def reserved_bytes(self) -> int:
        raise NotImplementedError

    @property
    def physical_bytes(self) -> int:
        raise NotImplementedError

    def buffer_backing(self, buffer: str, tensor_bytes: int) -> tuple[int, int]:
        """(reserved, physical) bytes of one buffer, from counters (O(1)). Plain: its span."""
        return tensor_bytes, tensor_bytes

    def backing(self, buffer: str, first_unit: int, num_units: int) -> None:
        """Called before units [first, first + n) of a buffer first hold live data (VMM maps)."""

    def allocator_hooks(self):
        """What the allocator must tell when units go live or die (acquire/release/shortfall), or
        None when every unit is always backed: the allocator then takes its plain path, untouched."""
        return None

    def trim(self) -> int:
        """Give back memory held for reuse but backing nothing live; the bytes released.
        A backend that backs everything at allocation (plain) has nothing to trim."""
        return 0

    def release(self) -> None:
        """Give the memory back."""


class PlainBackend(Backend):
    """One torch.empty slab; every buffer a view. Physical == tensor (no lazy backing)."""

    name = "plain"

    def __init__(self) -> None:
        self.slab = None
        self._tensor = self._reserved = self._physical = 0

    def allocate(self, plan: Plan, device) -> dict[str, object]:
        import torch
        self.slab = torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)
        self._tensor = self.slab.untyped_storage().nbytes()
        is_cuda = self.slab.device.type == "cuda"
        # on CUDA the segment the caching allocator maps is both reserved and physically backed
        self._reserved = cuda_segment_bytes(self._tensor) if is_cuda else self._tensor
        self._physical = self._reserved
        return {b.name: self.slab.narrow(0, b.offset_bytes, b.bytes) for b in plan.buffers}

    @property
    def tensor_bytes(self) -> int:
        return self._tensor

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def physical_bytes(self) -> int:
        return self._physical

    def release(self) -> None:
        self.slab = None
        self._tensor = self._reserved = self._physical = 0


# Backends by name: a class, or "module:attribute" imported on first use. The arena names the
# backends that build on it (vmm imports this module for Backend) by path, so no import circle.
BACKENDS: dict[str, object] = {"plain": PlainBackend, "vmm": "kvatlas.vmm.backend:VmmBackend",
                               "none": "kvatlas.cache.bookkeeping:BookkeepingBackend"}


def register_backend(name: str, factory) -> None:
    """`factory`: a Backend class (or callable returning one), or a "module:attribute" path."""
    BACKENDS[name] = factory


def backend_factory(name: str):
    if name not in BACKENDS:
        raise ConfigError("backend", f"{name!r} is not a known arena backend", f"use one of {', '.join(BACKENDS)}")
    factory = BACKENDS[name]
    if isinstance(factory, str):
        import importlib
        module, _, attr = factory.partition(":")
        factory = BACKENDS[name] = getattr(importlib.import_module(module), attr)
    return factory


def make_backend(name: str, **kwargs) -> Backend:
    factory = backend_factory(name)
    import inspect
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError:
        raise ConfigError(", ".join(kwargs), f"not an option of the {name!r} backend",
                          "drop it, or choose a backend that takes it (max_physical_bytes: vmm)") from None
    return factory(**kwargs)


def parse_device(device):
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", f"{device!r} is not a device", "use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", f"{device!r} is not supported", "use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA is not available here", "use device='cpu'")
    return dev


def host_available_bytes() -> int:
    """Memory this machine can give now without swapping (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meta_device():
    import torch
    return torch.device("meta")


def check_device_fits(plan: Plan, device) -> None:
    """Refuse, before allocating, a plan larger than the device's free memory."""
    import torch
    dev = parse_device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
    else:
        free = total = host_available_bytes()
    if plan.total_bytes > free:
        raise BudgetError(
            f"memory: the plan needs {fmt_bytes(plan.total_bytes)} ({plan.total_bytes} B) but {dev} has "
            f"{fmt_bytes(free)} ({free} B) free of {fmt_bytes(total)}; lower memory_bytes or free the device")


class Arena:
    """A plan's buffers, allocated once; typed views by buffer name."""

    def __init__(self, plan: Plan, device="cpu", backend: Backend | str = "plain", **backend_options) -> None:
        self.plan = plan
        if not isinstance(backend, str) and backend_options:
            raise ConfigError(", ".join(backend_options), "backend options given with a backend object",
                              "pass them to the backend's constructor instead")
        if not isinstance(backend, (str, Backend)):
            raise ConfigError("backend", f"{backend!r} is not a backend", f"use one of {', '.join(BACKENDS)}")
        self.backend = make_backend(backend, **backend_options) if isinstance(backend, str) else backend
        if self.backend.commits_upfront:   # a lazily backed arena checks what it maps, as it maps
            check_device_fits(plan, device)
        raw = self.backend.allocate(plan, device)
        # a bookkeeping backend's buffers live on "meta": the device they report is that one
        self.device = parse_device(device) if self.backend.holds_memory else _meta_device()
        self.regions: dict[str, Region] = {}
        for b in plan.buffers:
            span = raw[b.name]
            typed = span.narrow(0, 0, b.data_bytes).view(torch_dtype(b.dtype)).view(b.shape)
            spanned = span.numel() if self.backend.holds_memory else 0   # a meta tensor spans no allocation
            self.regions[b.name] = Region(spec=b, tensor=typed, tensor_bytes=spanned)
        if self.backend.holds_memory:
            self._init_null_units()

    def _init_null_units(self) -> None:
        for r in self.regions.values():
            if r.spec.role == "table":
                r.tensor.zero_()        # every entry points at the null page until assigned
            elif r.spec.null_units and r.spec.units:
                r.tensor[: r.spec.null_units].zero_()

    def tensor(self, name: str):
        return self.regions[name].tensor

    @property
    def tensor_bytes(self) -> int:
        return self.backend.tensor_bytes

    def close(self) -> None:
        self.regions.clear()
        self.backend.release()
