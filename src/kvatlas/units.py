"""Byte quantities: parsing "120GiB" and printing them back."""

from __future__ import annotations

import re

from .checks import MAX_BYTES
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
            raise ConfigError(field, f"{_short(text)} is not a size",
                              "write a number with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
        number = match.group(1)
        # whole numbers stay exact ints (a float would round 400 digits to inf); fractions
        # are capped first, so float() never sees more than a few digits that matter
        if "." in number and _UNITS[unit] == 1 and float(number[:40]) != int(float(number[:40])):
            raise ConfigError(field, f"{_short(text)} is a fraction of a byte",
                              "give whole bytes, or a unit: 1.5GiB, 1.5GB")
        if "." in number:
            value = int(float(number[:40]) * _UNITS[unit]) if len(number.split(".")[0]) < 25 else MAX_BYTES + 1
        else:
            value = int(number[:40]) * _UNITS[unit] if len(number) < 40 else MAX_BYTES + 1
    if value <= 0:
        raise ConfigError(field, f"{_short(text)} is not positive", "give a size above 0")
    if value > MAX_BYTES:
        raise ConfigError(field, f"{_short(text)} is more than 1 EiB", "give a size of at most 1024TiB (2**60 bytes)")
    return value


def _short(text) -> str:
    """A value quoted in an error, cut so a 400-digit argument still gives a one-line message."""
    r = repr(text)
    return r if len(r) <= 40 else r[:30] + "…" + r[-6:]


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
