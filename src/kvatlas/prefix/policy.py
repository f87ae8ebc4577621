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
                pages to resume points, and, as it runs, the workload's (`refitted`: the pages
                the cache holds against the units its ends and divergence points leave). Its
                intermediate points leave by level (`thin`): a cache that kept a fine grid while
                small, and a coarser one as it fills, sheds the fine grid's points everywhere
                first instead of whole regions' points, least recently used first (62.53% ->
                64.50% of prompt tokens at 120 GiB on the Mooncake trace, bench/RESULTS.md).

vLLM's two rules, named so that the best of each runs beside kvatlas's in one bench:
- "junctions":  vLLM's retention interval 0: each request's replay boundary (its end) and the
                shared-prefix junctions (divergence points) only, plain LRU (the rule of "ends");
- "periodic-N": vLLM's retention interval N (tokens, a multiple of the page): the junctions plus
                a point every N tokens, plain LRU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError


MARKED = 64   # the eviction class of ends and divergence points: above every level


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    keep_intermediate: bool
    protect_marked: bool     # ends and divergence points leave after every intermediate one
    spacing_pages: int = 1   # intermediate points kept only every this many pages (0: fit the plan)
    every_tokens: int = 0    # periodic-N: the spacing in tokens (turned into pages by the cache)
    refit: bool = False      # spacing fitted again as the cache runs (refitted)
    thin: bool = False       # intermediate points leave by level: the finest grid's first (eviction_class)

    def keep(self, divergence, page):
        """Which previous points to keep when their request reaches its next boundary (arrays of
        flags and page numbers). A request's end point is always kept."""
        if not self.keep_intermediate:
            return divergence
        return divergence | (page % self.spacing_pages == 0)

    def eviction_class(self, *, end: bool, divergence: bool, page: int = 0) -> int:
        """Lower classes are evicted first; LRU within a class. With `thin`, an intermediate
        point's class is its level: the trailing zero bits of its page number, so the points of
        the finest spacing go first, then the next one's, and a cache whose spacing grew keeps
        an even coarser grid instead of losing its oldest regions' points altogether."""
        if not self.protect_marked:
            return 0
        if end or divergence:
            return MARKED
        return min((page & -page).bit_length() - 1, MARKED - 1) if self.thin and page > 0 else 0


POLICIES = {
    "ends": Policy("ends", keep_intermediate=False, protect_marked=False),
    "every-page": Policy("every-page", keep_intermediate=True, protect_marked=False),
    "kvatlas": Policy("kvatlas", keep_intermediate=True, protect_marked=True, spacing_pages=0, refit=True, thin=True),
    "kvatlas-plan": Policy("kvatlas-plan", keep_intermediate=True, protect_marked=True, spacing_pages=0),
    "junctions": Policy("junctions", keep_intermediate=False, protect_marked=False),
}
PERIODIC = "periodic-"


def fitted(policy: Policy, cached_pages: int, checkpoints: int, page_tokens: int = 0) -> Policy:
    """A policy with spacing 0 gets the smallest power of two at which one intermediate point per
    `spacing` pages, over `cached_pages` pages, needs at most half of `checkpoints`; a periodic
    one, its interval in pages (page_tokens given)."""
    if policy.every_tokens and page_tokens:
        return replace(policy, spacing_pages=max(policy.every_tokens // page_tokens, 1))
    if policy.spacing_pages:
        return policy
    spacing = 1
    while cached_pages // spacing > max(checkpoints // 2, 1):
        spacing *= 2
    return replace(policy, spacing_pages=spacing)


def refitted(policy: Policy, cached_pages: int, room: int) -> Policy:
    """The spacing again, from what the cache holds now: the smallest power of two at which one
    intermediate point per `spacing` of its `cached_pages` fits the `room` its ends and divergence
    points (and the running requests' captures) leave."""
    spacing = 1
    while cached_pages // spacing > max(room, 1):
        spacing *= 2
    return policy if spacing == policy.spacing_pages else replace(policy, spacing_pages=spacing)


def policy_named(name) -> Policy:
    if isinstance(name, Policy):
        return name
    if isinstance(name, str) and name.startswith(PERIODIC):
        tokens = name[len(PERIODIC):]
        if not tokens.isdigit() or int(tokens) < 1:
            raise ConfigError("prefix_policy", f"{name!r} names no interval", "give periodic-N, N tokens (e.g. periodic-8192)")
        return Policy(name, keep_intermediate=True, protect_marked=False, every_tokens=int(tokens))
    if name not in POLICIES:
        raise ConfigError("prefix_policy", f"{name!r} is not a checkpoint policy",
                          f"use one of {', '.join(POLICIES)}, or {PERIODIC}N (N tokens)")
    return POLICIES[name]
