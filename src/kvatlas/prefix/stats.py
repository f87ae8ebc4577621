"""Prefix-cache counters: what was asked, what hit, and why the rest missed."""

from __future__ import annotations

from dataclasses import dataclass

# Why a prompt token was not taken from the cache (each queried token has exactly one outcome):
MISS_REASONS = (
    "no_cached_prefix",   # its page was never cached (or keys were not given)
    "no_checkpoint",      # its page is cached, but no resume point at or after it before the match ends
    "evicted",            # its page, or the resume point that would have covered it, was evicted
    "not_written_yet",    # a running request will write its page (the same prefix) but had not yet
    "partial_page",       # rounded off: the prompt's partial last page, or the last token to compute
)


@dataclass(slots=True)
class PrefixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    # hit_tokens by the tier each page came from, counted at admission (where a hit is decided):
    # a page brought back from the host tier or the shared store counts there the first time an
    # admission reads it, and as a device page after that. They add up to hit_tokens.
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    shared_hit_tokens: int = 0
    missed_no_cached_prefix: int = 0
    missed_no_checkpoint: int = 0
    missed_evicted: int = 0
    missed_not_written_yet: int = 0
    missed_partial_page: int = 0
    evicted_pages: int = 0
    evicted_checkpoints: int = 0
    evicted_awaited_pages: int = 0   # of evicted_pages, those a waiting request would read (PrefixCache.enqueue)
    checkpoints_saved: int = 0       # resume points captured and kept by the policy
    checkpoints_dropped: int = 0     # captured, not kept (policy) or a duplicate
    writer_points_read: int = 0      # admissions that resumed at a running writer's latest point

    def missed(self) -> dict[str, int]:
        return {r: getattr(self, f"missed_{r}") for r in MISS_REASONS}

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def why_not(self) -> str:
        """One line: the hit ratio and, when tokens missed, the largest reason."""
        if not self.queried_tokens:
            return "no prompt queried the cache yet"
        missed = self.missed()
        top = max(missed, key=missed.get)
        share = missed[top] / self.queried_tokens
        return f"hit {self.hit_ratio:.1%}; most misses: {top} ({share:.1%} of queried tokens)"

    def as_dict(self) -> dict:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens,
                "hit_ratio": self.hit_ratio, "missed_tokens": self.missed(),
                "evicted_pages": self.evicted_pages, "evicted_awaited_pages": self.evicted_awaited_pages,
                "evicted_checkpoints": self.evicted_checkpoints,
                "checkpoints_saved": self.checkpoints_saved, "checkpoints_dropped": self.checkpoints_dropped,
                "summary": self.why_not()}
