"""The host tier's memory: one CPU slab for the whole host buffer map, pinned once at start-up.

Pinning goes through `cudaHostRegister` on a plain allocation rather than `pin_memory=True`:
PyTorch's pinned-memory allocator rounds every block up to a power of two (a 96 GiB tier would
pin 128 GiB), registration pins exactly the planned bytes. Pinning costs about 0.42 s per GiB on
the H200 host (SPEC §7), so it happens here once, never per request. Without CUDA the slab is
plain memory and nothing is pinned (copies are synchronous memcpy then).
"""

from __future__ import annotations

from ..cache.arena import torch_dtype
from ..errors import BudgetError, ConfigError
from ..units import fmt_bytes


def check_host_fits(host_plan, beside_bytes: int = 0, field: str = "host_memory_bytes") -> None:
    """Refuse, before pinning, a host tier larger than the memory this machine has available
    (as the device budget is checked against the device's free memory). `beside_bytes`: what
    else will take host memory first (a CPU cache's own pools)."""
    from ..cache.arena import host_available_bytes
    avail = host_available_bytes()
    need = host_plan.total_bytes
    if need + beside_bytes > avail:
        also = f" beside {fmt_bytes(beside_bytes)} of device pools in host memory" if beside_bytes else ""
        room = max(avail - beside_bytes, 0)
        raise BudgetError(f"{field}: the host tier needs {fmt_bytes(need)} ({need:,} B){also}, but this machine has "
                          f"{fmt_bytes(avail)} ({avail:,} B) available; lower {field} to at most {room:,} B, or free "
                          "host memory")


class HostMemory:
    def __init__(self, host_plan, pin: bool | None = None) -> None:
        import torch
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ConfigError("pin", "pinned host memory needs CUDA, which is not available here",
                              "leave pin unset (plain memory on CPU-only machines)")
        self.plan = host_plan
        self.slab = torch.empty(host_plan.total_bytes, dtype=torch.uint8)
        self.pinned = False
        if cuda and pin is not False:
            self._register()
        self.raw: dict[str, object] = {}      # uint8 [units, unit_bytes] per host buffer
        self.typed: dict[str, object] = {}    # dtype, shaped [units, *inner_shape]
        self.span_bytes: dict[str, int] = {}
        for b in host_plan.buffers:
            span = self.slab.narrow(0, b.offset_bytes, b.bytes)
            data = span.narrow(0, 0, b.data_bytes)
            self.raw[b.name] = data.view(b.units, b.unit_bytes)
            self.typed[b.name] = data.view(torch_dtype(b.dtype)).view(b.shape)
            self.span_bytes[b.name] = b.bytes

    def _register(self) -> None:
        import torch
        nbytes = self.slab.numel()
        err = torch.cuda.cudart().cudaHostRegister(self.slab.data_ptr(), nbytes, 0)
        if int(err) != 0:
            self.slab = None
            raise BudgetError(f"host_memory_bytes: pinning {fmt_bytes(nbytes)} ({nbytes} B) of host memory failed "
                              f"(CUDA error {int(err)}); lower host_memory_bytes or raise the locked-memory limit")
        self.pinned = True

    @property
    def tensor_bytes(self) -> int:
        return 0 if self.slab is None else self.slab.untyped_storage().nbytes()

    def __del__(self) -> None:
        # A tier dropped without close() must not leave its range registered: the freed slab's
        # addresses get reused by ordinary tensors, and a copy from pageable memory that a stale
        # registration covers fails with "invalid argument" (seen on the H200 when a whole GPU
        # test run shared one process).
        if getattr(self, "pinned", False):
            self.release()

    def release(self) -> None:
        if self.slab is not None and self.pinned:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
        self.raw.clear()
        self.typed.clear()
        self.slab = None
        self.pinned = False
