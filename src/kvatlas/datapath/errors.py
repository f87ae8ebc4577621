"""Errors of the data path. All are `ConfigError`s (so `KvatlasError`, a `ValueError`): each
names the field at fault and the fix."""

from __future__ import annotations

from ..errors import ConfigError


class DataPathError(ConfigError):
    """Bad input to a store, gather or compressor call."""


class NonFiniteError(DataPathError):
    """Values to quantize hold NaN or ±Inf: no scale can represent them, so nothing is written."""


class OutOfRangeError(DataPathError):
    """Values exceed what a fixed-range format (uniform fp8, V4.1 fp4) holds without clamping."""


class SlotError(DataPathError):
    """A slot, page or layer index falls outside the buffer."""


class RingOverrunError(DataPathError):
    """Draft tokens overwrote ring rows that a later compression still needs."""
