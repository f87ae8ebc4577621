"""The boundary checks every public input passes: request ids, whole numbers, finite numbers,
booleans, and the optional dependency torch.

One place, so the API, the config loader and every CLI flag refuse the same bad values with the
same words: each failure is a ConfigError naming the field and the fix. Pure Python (no numpy):
`kvatlas plan` imports this module. numpy scalars are recognised by duck typing
(`__index__` for integers, `float()` for reals), so no import is needed to accept them.
"""

from __future__ import annotations

import math
import numbers

from .errors import ConfigError, KvatlasError

# The largest count anything accepts: token counts, requests, pages. Products of two such counts
# stay inside int64 (2**31 × 2**31 < 2**63), so numpy index arithmetic never wraps.
MAX_COUNT = 2**31 - 1
# The largest budget in bytes: 1 EiB, far past any device, still exact as an int64.
MAX_BYTES = 2**60

INSTALL_TORCH = "pip install torch==2.13.0 (or pip install 'kvatlas[torch]')"


class MissingDependencyError(KvatlasError):
    """An optional package that this call needs is not installed."""


def whole(field: str, value, low: int = 0, high: int = MAX_COUNT) -> int:
    """`value` as an int in [low, high]; bools, floats and strings are refused, not rounded."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(field, f"{value!r} is not a whole number", f"give an integer from {low:,} to {high:,}")
    value = int(value)
    if not low <= value <= high:
        raise ConfigError(field, f"{value:,} is out of range", f"give an integer from {low:,} to {high:,}")
    return value


def real(field: str, value, low: float = 0.0, high: float = math.inf, *, open_low: bool = False) -> float:
    """`value` as a finite float in [low, high] (or (low, high] with open_low); NaN and ±inf refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(field, f"{value!r} is not a number", "give a finite number")
    given, value = value, float(value)
    if not math.isfinite(value) or value < low or (open_low and value == low) or value > high:
        shown = int(given) if isinstance(given, numbers.Integral) else value   # (an int stays as given)
        raise ConfigError(field, f"{shown!r} is out of range", f"give a finite number {span(low, high, open_low)}")
    return value


def span(low: float, high: float = math.inf, open_low: bool = False) -> str:
    if not math.isfinite(high):
        return f"above {low:g}" if open_low else f"of at least {low:g}"
    return f"in {'(' if open_low else '['}{low:g}, {high:g}]"


def boolean(field: str, value) -> bool:
    """Only True or False: "no", 0 or None are refused rather than read as a truth value."""
    if not isinstance(value, bool):
        raise ConfigError(field, f"{value!r} is not a boolean", "give True or False")
    return value


def request_id(value):
    """A request id must be hashable (it keys the allocator's maps), not None (None means "no
    request" in the slot table) and not NaN (NaN != NaN: it could never be found again)."""
    if value is None:
        raise ConfigError("request_id", "None is not a request id", "give a string or integer id")
    try:
        hash(value)
    except TypeError:
        raise ConfigError("request_id", f"a {type(value).__name__} is not hashable",
                          "give a string or integer id") from None
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value):
        raise ConfigError("request_id", "NaN is not a request id (NaN never equals itself)",
                          "give a string or integer id")
    return value


def of_type(field: str, value, cls, what: str, fix: str):
    """`value` if it is a `cls`; else a ConfigError naming the field (never an AttributeError from
    deep inside when the wrong object is passed)."""
    if not isinstance(value, cls):
        raise ConfigError(field, f"{_kind(value)} is not {what}", fix)
    return value


def known_options(where: str, given, allowed) -> None:
    """Refuse keyword options a call does not take, naming the first and the ones it does."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(unknown[0], f"is not an option of {where}",
                          f"use {', '.join(sorted(allowed))}" if allowed else f"{where} takes no options")


def _kind(value) -> str:
    r = repr(value)
    return f"a {type(value).__name__} ({r if len(r) <= 40 else r[:30] + '…'})"


def require_torch(what: str):
    """Import torch, or say in one line how to install it."""
    try:
        import torch
    except ModuleNotFoundError:
        raise MissingDependencyError(f"torch: not installed, and {what} needs it; {INSTALL_TORCH}") from None
    return torch
