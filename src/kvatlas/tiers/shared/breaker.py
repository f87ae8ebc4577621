"""The circuit breaker in front of a shared store: a store that fails or misses a deadline is
not asked again for `cooloff_s`, so serving goes on with misses (reason `tier_unavailable`)
instead of waiting on it; then one call is let through (half open) and its outcome closes the
breaker or opens it for another cool-off. A store that comes back is used again by itself."""

from __future__ import annotations

import time

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(self, *, failures: int = 1, cooloff_s: float = 1.0, clock=time.monotonic) -> None:
        self.threshold, self.cooloff_s, self.clock = failures, cooloff_s, clock
        self.state = CLOSED
        self.failures = 0        # consecutive
        self.opened_at = 0.0
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        """Open or trying one call: the gauge's 1."""
        return self.state != CLOSED

    def allow(self) -> bool:
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self.clock() >= self.opened_at + self.cooloff_s:
            self.state = HALF_OPEN
            return True
        return False     # open, or a half-open call is already out

    def success(self) -> None:
        self.state, self.failures = CLOSED, 0

    def failure(self, *, at_once: bool = False) -> None:
        """A failed call; `at_once` (a deadline missed: the store's one thread is still stuck in
        it) opens the breaker whatever the count."""
        self.failures += 1
        if at_once or self.state == HALF_OPEN or self.failures >= self.threshold:
            if self.state != OPEN:
                self.times_opened += 1
            self.state, self.opened_at = OPEN, self.clock()
