"""Errors users see. Every message names the field at fault and how to fix it."""

from __future__ import annotations


class KvatlasError(ValueError):
    """Base of every error kvatlas raises for bad input or an impossible request."""


class ConfigError(KvatlasError):
    """A model config or option is malformed or out of range."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}; {fix}")


class BudgetError(KvatlasError):
    """The memory budget cannot hold what was asked for."""


class PoolExhaustedError(KvatlasError):
    """A pool cannot hold a request; nothing was changed."""

    def __init__(self, pool: str, needed: int, free: int, unit: str, what: str = "") -> None:
        self.pool = pool
        self.needed = needed
        self.free = free
        self.missing = needed - free
        self.unit = unit
        lead = f"{what}: " if what else ""
        super().__init__(
            f"{lead}pool {pool!r} needs {needed} {unit} but only {free} are free "
            f"({self.missing} missing); finish running requests or plan a larger budget"
        )


class RequestStateError(KvatlasError):
    """An operation names an unknown request or one in the wrong state."""


class IntegrityError(RuntimeError):
    """An accounting invariant does not hold: a bug in kvatlas, reported with the numbers. Not a
    KvatlasError: nothing the caller passed is wrong (the CLI reports it as a bug, exit status 1)."""
