"""The shared tier: a store that every cache process of a deployment reads and writes, below each
one's host tier (DESIGN §6). `store` is the small interface; `opening` the factory above the
backends (`open_store(url)`); the backends (`mooncake_store`, `redis_store`, `memory_store`) are
the only modules that import a client;
`values` the keys, header and checksum; `tier` the client with deadlines and a breaker; `link`
the walk device → host → shared under the prefix cache."""

from __future__ import annotations

from .breaker import Breaker
from .link import POLICIES, SharedLink
from .opening import DEFAULT_STARTUP_S, OpeningStore, check_startup, check_url, open_store
from .store import Store, StoreUnavailable, StoreURL, parse_url
from .tier import Entry, Got, SharedTier
from .values import MISS_REASONS, Layout, layout_of

DEFAULT_DEADLINE_S = 0.5
DEFAULT_OUTBOX_BYTES = 64 << 20
MODELED_SCALE = 1024     # bookkeeping runs: a value's payload is 1/1024 of its bytes (zeros)


def _store(store_or_url, startup_s):
    return open_store(store_or_url, startup_s=startup_s) if isinstance(store_or_url, str) else store_or_url


def attach_shared_tier(cache, host_memory_bytes, store, *, namespace: str = "default", policy: str = "finish",
                       deadline_s: float = DEFAULT_DEADLINE_S, outbox_bytes=DEFAULT_OUTBOX_BYTES, writer: int = 0,
                       breaker: Breaker | None = None, startup_s: float = DEFAULT_STARTUP_S,
                       **host_options) -> SharedLink:
    """A HostTier for `cache` with `store` (a Store or a URL) below it, wired under its prefix
    cache; `cache.host` reports both tiers. A URL is opened waiting at most `startup_s`; a store
    not open by then serves misses (`tier_unavailable`) until it is (opening.open_store)."""
    from ...units import parse_bytes
    from ..host import HostTier
    from .outbox import Outbox
    if cache.prefix is None:
        SharedLink(None, None, None)      # the prefix cache's own refusal, before anything is pinned
    outbox_n = parse_bytes(outbox_bytes, "outbox_bytes")
    if isinstance(store, str):    # a bad URL or bound refused before any host memory is pinned
        check_url(store)
        check_startup(startup_s)
    host = HostTier(cache, host_memory_bytes, **host_options)
    s = _store(store, startup_s)
    outbox = Outbox(host, outbox_n)
    s.register(host.memory.slab.numpy())
    s.register(outbox.array())
    tier = SharedTier(s, layout_of(host.plan, cache.plan, namespace), deadline_s=deadline_s, breaker=breaker,
                      writer=writer, policy=policy)
    link = SharedLink(cache.prefix, host, tier, policy=policy, outbox=outbox)
    cache.host = link
    return link


def modeled_shared_link(prefix, host_index, store, *, namespace: str = "default", policy: str = "finish",
                        deadline_s: float = DEFAULT_DEADLINE_S, scale: int = MODELED_SCALE, writer: int = 0,
                        breaker: Breaker | None = None, startup_s: float = DEFAULT_STARTUP_S) -> SharedLink:
    """Bookkeeping only: a modeled host tier (no memory) over a real store that holds the real
    keys and headers, each payload zeros of 1/`scale` of its bytes (see tier.SharedTier), under
    a layout tag of their own (a real run of the same plan and namespace never meets them)."""
    tier = SharedTier(_store(store, startup_s), layout_of(host_index.plan, host_index.device_plan, namespace, scale),
                      deadline_s=deadline_s, breaker=breaker, modeled_scale=scale, writer=writer, policy=policy)
    return SharedLink(prefix, host_index, tier, policy=policy)


__all__ = ["Breaker", "DEFAULT_STARTUP_S", "Entry", "Got", "Layout", "MISS_REASONS", "OpeningStore", "POLICIES",
           "SharedLink", "SharedTier", "Store", "StoreURL", "StoreUnavailable", "attach_shared_tier", "check_url",
           "layout_of", "modeled_shared_link", "open_store", "parse_url"]
