"""SGLang's radix cache beside its DeepSeek-V4 pools: evictable pages and the SWA prefix-tail quota.

Pages SGLang's radix cache holds count as used by its allocators (`full_available_size()` and
`swa_available_size()` leave them out) whether or not a request reads them. The tree keeps the
unreferenced part as two counters (`full_evictable_size()`, `swa_evictable_size()`, tokens; page
aligned), so `evictable` is O(1) per stats interval: those tokens / page, times the bytes one page
holds in each pool that follows that page space.

A cached prefix is reusable only while the SWA KV of its last window is kept (SGLang keeps one
page of it, `ceil(max(window, page) / page)` pages). In cap mode the SWA pool is sized as the
running requests' worst case plus `swa_prefix_tails` tails of `window + page` tokens each (4 ×
max_running_requests by default); in ratio mode the pool is `ratio × full` and the tails get what
the running requests' worst case leaves. The quota is that headroom, in SWA tokens; in use is
the SWA the radix cache holds (evictable and locked). When the quota is used up while much of the
full pool is free, prefix hits are bounded by the quota, not by memory: one warning line says so
(again only after the state has cleared), naming the two settings that move it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

TARGET_TREE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.__init__"
LIMITED_FREE_SHARE = 0.25   # "much of the full pool": at least a quarter of its pages free
log = logging.getLogger("kvatlas.integrations.sglang")
_TREES: dict[int, object] = {}   # id(allocator) -> the radix cache built over it


@dataclass(frozen=True, slots=True, kw_only=True)
class TailPricing:
    """What the DSV4 configurator reserved for prefix tails (its own figures)."""

    prefix_tails: int        # swa_prefix_tails
    tail_tokens: int         # window + page: what one tail is priced at
    request_cap_tokens: int  # the running requests' worst-case SWA (compute_swa_request_cap)
    cap_mode: bool

    def quota_tokens(self, swa_pool_tokens: int) -> int:
        if self.cap_mode:
            return self.prefix_tails * self.tail_tokens
        return max(swa_pool_tokens - self.request_cap_tokens, 0)


def tail_pricing_of(cfgr) -> TailPricing:
    from sglang.srt.model_executor.pool_configurator import compute_swa_request_cap
    cap = compute_swa_request_cap(page_size=cfgr.page_size, window=cfgr.sliding_window_size,
                                  attn_dp_size=cfgr.attn_dp_size)
    return TailPricing(prefix_tails=int(cfgr.swa_prefix_tails), tail_tokens=cfgr.sliding_window_size + cfgr.page_size,
                       request_cap_tokens=int(cap), cap_mode=cfgr.swa_cap_tokens is not None)


def on_tree(result, tree, *args, **kwargs) -> None:
    """AFTER UnifiedRadixCache.__init__: remember the tree by the allocator it caches for."""
    alloc = getattr(tree, "token_to_kv_pool_allocator", None)
    if alloc is not None:
        _TREES[id(alloc)] = tree


class PrefixView:
    """One rank's radix cache as the ledger reads it (nothing until SGLang builds the tree)."""

    def __init__(self, alloc, pricing: TailPricing | None) -> None:
        self.alloc, self.pricing = alloc, pricing
        self.page = alloc.page_size
        self.limited = False

    @property
    def tree(self):
        return _TREES.get(id(self.alloc))

    def evictable_units(self) -> dict:
        tree = self.tree
        if tree is None or getattr(tree, "disable", False):
            return {}
        return {"full_pages": tree.full_evictable_size() // self.page, "swa_pages": tree.swa_evictable_size() // self.page}

    def quota(self) -> tuple[int, int] | None:
        """(SWA tokens the radix cache holds, the quota's tokens), or None without both."""
        tree = self.tree
        if tree is None or self.pricing is None or getattr(tree, "disable", False):
            return None
        used = tree.swa_evictable_size() + tree.swa_protected_size()
        return used, self.pricing.quota_tokens(self.alloc.size_swa)

    def extra_samples(self) -> tuple:
        q = self.quota()
        if q is None:
            return ()
        return (("kvatlas_prefix_tail_quota_tokens", {"state": "used"}, q[0]),
                ("kvatlas_prefix_tail_quota_tokens", {"state": "total"}, q[1]))

    def check(self, labels: dict) -> str | None:
        """The warning line, once per entry into the limited state (O(1))."""
        q = self.quota()
        full = self.alloc.size_full
        free_share = self.alloc.full_available_size() / full if full else 0.0
        limited = q is not None and q[1] > 0 and q[0] >= q[1] and free_share >= LIMITED_FREE_SHARE
        line = None
        if limited and not self.limited:
            p = self.pricing
            mode = (f"cap mode: {p.prefix_tails} tails of {p.tail_tokens} tokens" if p.cap_mode
                    else f"ratio mode: the SWA pool less {p.request_cap_tokens:,} tokens for running requests")
            line = (f"kvatlas: tp{labels.get('tp_rank')} prefix hits are limited by the SWA prefix-tail quota, not by "
                    f"memory: its radix cache holds {q[0]:,} SWA tokens of a {q[1]:,}-token quota ({mode}) while "
                    f"{free_share:.0%} of the full KV pool is free; raise --swa-prefix-tails or set "
                    f"--swa-full-tokens-ratio")
            log.warning(line)
        self.limited = limited
        return line
