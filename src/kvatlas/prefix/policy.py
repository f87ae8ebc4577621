"""Checkpoint policies: which captured resume points to keep, and which to evict first.

Every boundary a running request reaches is captured (it may turn out to be the request's end);
when the next one is reached, the policy decides about the previous. A policy is one small
object so the benchmark runs several side by side:

- "ends":       request ends and divergence points only (the first baseline);
- "every-page": every page boundary, plain LRU (the second baseline);
- "kvatlas":    ends and divergence points, plus intermediate points spaced to fit the plan: one
                every `spacing` pages, the smallest power of two at which the intermediate points
                of a cache full of pages take at most half the checkpoint units; and the
                intermediate points are evicted first. Short of room it sheds them before a single
                end or divergence point, degrading to "ends" instead of below it. No fixed
                spacing is best at every budget (SPEC §8): the spacing follows the plan's ratio of
                pages to resume points.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    keep_intermediate: bool
    protect_marked: bool     # ends and divergence points leave after every intermediate one
    spacing_pages: int = 1   # intermediate points kept only every this many pages (0: fit the plan)

    def keep(self, divergence, page):
        """Which previous points to keep when their request reaches its next boundary (arrays of
        flags and page numbers). A request's end point is always kept."""
        if not self.keep_intermediate:
            return divergence
        return divergence | (page % self.spacing_pages == 0)

    def eviction_class(self, *, end: bool, divergence: bool) -> int:
        """Lower classes are evicted first; LRU within a class."""
        return 1 if self.protect_marked and (end or divergence) else 0


POLICIES = {
    "ends": Policy("ends", keep_intermediate=False, protect_marked=False),
    "every-page": Policy("every-page", keep_intermediate=True, protect_marked=False),
    "kvatlas": Policy("kvatlas", keep_intermediate=True, protect_marked=True, spacing_pages=0),
}


def fitted(policy: Policy, cached_pages: int, checkpoints: int) -> Policy:
    """A policy with spacing 0 gets the smallest power of two at which one intermediate point per
    `spacing` pages, over `cached_pages` pages, needs at most half of `checkpoints`."""
    if policy.spacing_pages:
        return policy
    spacing = 1
    while cached_pages // spacing > max(checkpoints // 2, 1):
        spacing *= 2
    return replace(policy, spacing_pages=spacing)


def policy_named(name) -> Policy:
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise ConfigError("prefix_policy", f"{name!r} is not a checkpoint policy", f"use one of {', '.join(POLICIES)}")
    return POLICIES[name]
