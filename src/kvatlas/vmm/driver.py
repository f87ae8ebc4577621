"""The driver interface of the VMM backend, and its real implementation over the CUDA driver API.

A driver does four things: reserve one address range, map and unmap granularity-sized chunks of
it (each a separate physical allocation, so each can be given back alone), and expose the whole
range as one uint8 tensor, created once. Everything above it (which chunks, when) is plain
bookkeeping in kvatlas.vmm.chunks, tested on CPU with the stand-in in kvatlas.vmm.standin.

CudaDriver uses `cuda.bindings.driver` (the cuda-python package). Verified on an H200 (SPEC §7):
2 MiB granularity; reserving 256 GiB costs nothing; create + map + set-access of N bytes lowers
free device memory by exactly N; unmap returns it. Every CUresult is checked: out-of-memory
raises DeviceOutOfMemory (the allocator turns it into a refused request), anything else a
DriverError naming the call and the CUDA error.
"""

from __future__ import annotations

import threading

from ..errors import ConfigError


class DeviceOutOfMemory(RuntimeError):
    """The device has no physical memory left for a chunk; nothing was mapped."""


class DriverError(RuntimeError):
    """A CUDA driver call failed for a reason other than memory: a bug or a broken device."""


class Driver:
    """What the VMM backend needs from a device. Offsets are relative to the reservation."""

    label = "abstract"
    granularity = 0

    def reserve(self, nbytes: int) -> None:
        raise NotImplementedError

    def map(self, offset: int, nbytes: int) -> None:
        """Back [offset, offset + nbytes) with fresh physical memory (contents undefined)."""
        raise NotImplementedError

    def unmap(self, offset: int, nbytes: int) -> None:
        raise NotImplementedError

    def quiesce(self) -> None:
        """Wait until no queued device work can still touch memory about to be unmapped."""

    def tensor(self):
        """One uint8 tensor over the whole reservation (call once, after the first chunk is mapped)."""
        raise NotImplementedError

    def mapped_offsets(self) -> set[int]:
        raise NotImplementedError

    def close(self) -> None:
        """Unmap everything still mapped and give the address range back."""


def load_cuda_bindings():
    """The cuda-python driver module, or a ConfigError that says what to install or use instead."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise ConfigError("backend", "the vmm backend needs CUDA and cuda-python (cuda.bindings.driver), "
                          "which is not installed here",
                          "pip install cuda-python on a CUDA machine, or use backend='plain'") from None
    return cu


class _CAI:
    """The reservation as a __cuda_array_interface__ object, so torch can view it (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


class CudaDriver(Driver):
    label = "cuda"

    def __init__(self, device) -> None:
        import torch
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError("backend", f"the vmm backend needs CUDA and cuda-python; device is {device}",
                              "use device='cuda' on a CUDA machine, or backend='plain'")
        self.cu = cu = load_cuda_bindings()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.zeros(1, device=self.device)   # makes torch create the primary context first
        self._call("cuInit", 0)
        (self.cudev,) = self._call("cuDeviceGet", index)
        (vmm_ok,) = self._call("cuDeviceGetAttribute",
                               cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                               self.cudev)
        if not vmm_ok:
            raise ConfigError("backend", f"{self.device} does not support CUDA virtual memory management",
                              "use backend='plain'")
        (self.ctx,) = self._call("cuDevicePrimaryCtxRetain", self.cudev)   # torch's context, shared
        self._bound: set[int] = set()
        self._bind()
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = index
        self.access = cu.CUmemAccessDesc()
        self.access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = index
        self.access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        (g,) = self._call("cuMemGetAllocationGranularity", self.prop,
                          cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.granularity = int(g)
        self.base = self.reserved = 0
        self._mapped: dict[int, int] = {}   # offset → bytes, for close()

    def _call(self, name: str, *args):
        """Every driver call goes through here: a CUresult other than success never passes."""
        cu = self.cu
        out = getattr(cu, name)(*args)
        err = out[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            text = _error_name(cu, err)
            if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise DeviceOutOfMemory(f"{name}: {text}")
            raise DriverError(f"{name}{_brief(args)} failed with {text} ({int(err)}); the vmm backend cannot "
                              "continue on this device — use backend='plain'")
        return out[1:]

    def _ptr(self, offset: int):
        return self.cu.CUdeviceptr(self.base + offset)

    def _bind(self) -> None:
        """Make the primary context current on the calling thread (driver calls need one)."""
        tid = threading.get_ident()
        if tid not in self._bound:
            self._call("cuCtxSetCurrent", self.ctx)
            self._bound.add(tid)

    def reserve(self, nbytes: int) -> None:
        self._bind()
        (ptr,) = self._call("cuMemAddressReserve", nbytes, self.granularity, self.cu.CUdeviceptr(0), 0)
        self.base, self.reserved = int(ptr), nbytes

    def map(self, offset: int, nbytes: int) -> None:
        self._bind()
        (handle,) = self._call("cuMemCreate", nbytes, self.prop, 0)
        try:
            self._call("cuMemMap", self._ptr(offset), nbytes, 0, handle, 0)
        except BaseException:
            self.cu.cuMemRelease(handle)   # best effort: the map error is the one to report
            raise
        try:
            # the mapping keeps the memory alive; dropping the handle now lets cuMemUnmap free it
            self._call("cuMemRelease", handle)
            self._call("cuMemSetAccess", self._ptr(offset), nbytes, [self.access], 1)
        except BaseException:
            self.cu.cuMemUnmap(self._ptr(offset), nbytes)
            raise
        self._mapped[offset] = nbytes

    def unmap(self, offset: int, nbytes: int) -> None:
        self._bind()
        self._call("cuMemUnmap", self._ptr(offset), nbytes)
        self._mapped.pop(offset, None)

    def quiesce(self) -> None:
        import torch
        torch.cuda.synchronize(self.device)

    def tensor(self):
        import torch
        return torch.as_tensor(_CAI(self.base, self.reserved), device=self.device)

    def mapped_offsets(self) -> set[int]:
        return set(self._mapped)

    def close(self) -> None:
        if not self.reserved:
            return
        self.quiesce()
        self._bind()
        for offset, nbytes in sorted(self._mapped.items()):
            self._call("cuMemUnmap", self._ptr(offset), nbytes)
        self._mapped.clear()
        self._call("cuMemAddressFree", self.cu.CUdeviceptr(self.base), self.reserved)
        self._call("cuDevicePrimaryCtxRelease", self.cudev)
        self.base = self.reserved = 0


def _error_name(cu, err) -> str:
    res, text = cu.cuGetErrorName(err)
    if res != cu.CUresult.CUDA_SUCCESS:
        return f"CUresult {int(err)}"
    return text.decode() if isinstance(text, bytes) else str(text)


def _brief(args) -> str:
    return "(" + ", ".join(str(a) if isinstance(a, int) else type(a).__name__ for a in args) + ")"
