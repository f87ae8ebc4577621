"""Byte quantities: parsing "120GiB" and printing them back."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

KIB, MIB, GIB = 2**10, 2**20, 2**30


def parse_bytes(text: str | int, field: str = "memory") -> int:
    """Parse "120GiB", "1.5TB", "4096" (bytes) into an int number of bytes."""
    if isinstance(text, bool):
        raise ConfigError(field, f"{text!r} is not a size", "give bytes such as 120GiB or 4096")
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(field, f"{text!r} is not a size",
                              "write a number with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(field, f"{text!r} is not positive", "give a size above 0")
    return value


def fmt_bytes(n: float) -> str:
    """Human form with binary units, e.g. 1.50 GiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:g} B"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
