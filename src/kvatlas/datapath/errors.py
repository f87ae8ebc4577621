"""Errors of the data path. All are `KvatlasError` (a `ValueError`), each naming the fix."""

from __future__ import annotations

from ..errors import KvatlasError


class DataPathError(KvatlasError):
    """Bad input to a store, gather or compressor call."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}; {fix}")


class NonFiniteError(DataPathError):
    """Values to quantize hold NaN or ±Inf: no scale can represent them, so nothing is written."""


class OutOfRangeError(DataPathError):
    """Values exceed what a fixed-range format (uniform fp8, V4.1 fp4) holds without clamping."""


class SlotError(DataPathError):
    """A slot, page or layer index falls outside the buffer."""


class RingOverrunError(DataPathError):
    """Draft tokens overwrote ring rows that a later compression still needs."""
