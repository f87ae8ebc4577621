"""Checkpoint policies: which captured resume points to keep, and which to evict first.

Every boundary a running request reaches is captured (it may turn out to be the request's end);
when the next one is reached, the policy decides about the previous. A policy is one small
object so the benchmark runs several side by side:

- "ends":       request ends and divergence points only (the first baseline);
- "every-page": every page boundary, plain LRU (the second baseline);
- "kvatlas":    every page boundary, but evict the resume points that are neither an end nor a
                divergence point first. With room, it is every-page; short of room, it sheds the
                intermediate points before a single end or divergence point, degrading to "ends"
                instead of below it. No fixed spacing is best at every budget (SPEC §8); this
                needs none.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    keep_intermediate: bool
    protect_marked: bool     # ends and divergence points leave after every intermediate one

    def keep(self, *, end: bool, divergence: bool) -> bool:
        return end or divergence or self.keep_intermediate

    def eviction_class(self, *, end: bool, divergence: bool) -> int:
        """Lower classes are evicted first; LRU within a class."""
        return 1 if self.protect_marked and (end or divergence) else 0


POLICIES = {
    "ends": Policy("ends", keep_intermediate=False, protect_marked=False),
    "every-page": Policy("every-page", keep_intermediate=True, protect_marked=False),
    "kvatlas": Policy("kvatlas", keep_intermediate=True, protect_marked=True),
}


def policy_named(name) -> Policy:
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise ConfigError("prefix_policy", f"{name!r} is not a checkpoint policy", f"use one of {', '.join(POLICIES)}")
    return POLICIES[name]
