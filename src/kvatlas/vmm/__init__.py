"""Elastic physical backing: the `vmm` arena backend (CUDA virtual memory via cuda-python).

Layers, bottom up: `driver` (reserve / map / unmap chunks: CudaDriver over cuda.bindings.driver,
and `standin.StandInDriver`, an in-memory stand-in for CPU tests), `layout` (where each buffer
lies in the reservation, which chunks a unit touches), `chunks` (refcounts, mapped set,
hysteresis, the physical cap), `backend` (VmmBackend; the arena names it "vmm" by module path).
Nothing here imports CUDA until allocate().
"""

from .backend import VmmBackend
from .chunks import ChunkMap
from .driver import DeviceOutOfMemory, Driver, DriverError
from .layout import ChunkLayout, chunks_per_unit
from .standin import StandInDriver

__all__ = ["ChunkLayout", "ChunkMap", "DeviceOutOfMemory", "Driver", "DriverError", "StandInDriver", "VmmBackend",
           "chunks_per_unit"]
