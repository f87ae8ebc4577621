"""The shared tier: a store that every cache process of a deployment reads and writes, below each
one's host tier (DESIGN §6). `store` is the small interface; `opening` the factory above the
backends (`open_store(url)`); the backends (`mooncake_store`, `redis_store`, `memory_store`) are
the only modules that import a client;
`values` the keys, header and checksum; `tier` the client with deadlines and a breaker; `link`
the walk device → host → shared under the prefix cache."""

from __future__ import annotations

import re

from ...checks import known_options, of_type, real, whole
from ...errors import ConfigError, KvatlasError
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
    if not isinstance(store_or_url, (str, Store)):
        raise ConfigError("store", f"{type(store_or_url).__name__} is not a store",
                          "give a URL (redis://HOST:PORT, mooncake://..., memory://NAME) or a Store")
    return open_store(store_or_url, startup_s=startup_s) if isinstance(store_or_url, str) else store_or_url


def check_shared_args(namespace, writer, policy, deadline_s) -> None:
    """The API arguments every shared tier takes, refused naming the argument before anything
    is pinned or opened: the namespace is one non-empty key segment, the writer a rank number."""
    if not isinstance(namespace, str) or not namespace or not _SEGMENT.fullmatch(namespace):
        raise ConfigError("namespace", f"{namespace!r} is not a namespace",
                          "give a non-empty name of letters, digits, '.', '_' or '-' (it is one segment of every key)")
    whole("writer", writer, 0, 2**63 - 1)
    if policy not in POLICIES:
        raise ConfigError("policy", f"{policy!r} is not a policy", f"use one of {', '.join(POLICIES)}")
    real("deadline_s", deadline_s, 0.0, 3600.0, open_low=True)


_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,128}")


def attach_shared_tier(cache, host_memory_bytes, store, *, namespace: str = "default", policy: str = "finish",
                       deadline_s: float = DEFAULT_DEADLINE_S, outbox_bytes=DEFAULT_OUTBOX_BYTES, writer: int = 0,
                       breaker: Breaker | None = None, startup_s: float = DEFAULT_STARTUP_S,
                       **host_options) -> SharedLink:
    """A HostTier for `cache` with `store` (a Store or a URL) below it, wired under its prefix
    cache; `cache.host` reports both tiers. A URL is opened waiting at most `startup_s`; a store
    not open by then serves misses (`tier_unavailable`) until it is (opening.open_store)."""
    from ...cache.kvcache import KVCache
    from ...units import parse_bytes
    from ..host import HostTier
    from ..prefix_link import HOST_TIER_OPTIONS
    from .outbox import Outbox
    of_type("cache", cache, KVCache, "a KVCache", "give what kvatlas.allocate() returns")
    known_options("attach_shared_tier", host_options, HOST_TIER_OPTIONS)
    check_shared_args(namespace, writer, policy, deadline_s)
    if not isinstance(store, (str, Store)):
        _store(store, startup_s)
    if cache.prefix is None:
        SharedLink(None, None, None)      # the prefix cache's own refusal, before anything is pinned
    if cache.host is not None:
        raise KvatlasError("cache: a host tier is attached already (a shared tier comes with its own); attach "
                           "one per cache (close the cache to drop it)")
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
    check_shared_args(namespace, writer, policy, deadline_s)
    tier = SharedTier(_store(store, startup_s), layout_of(host_index.plan, host_index.device_plan, namespace, scale),
                      deadline_s=deadline_s, breaker=breaker, modeled_scale=scale, writer=writer, policy=policy)
    return SharedLink(prefix, host_index, tier, policy=policy)


__all__ = ["Breaker", "DEFAULT_STARTUP_S", "Entry", "Got", "Layout", "MISS_REASONS", "OpeningStore", "POLICIES",
           "SharedLink", "SharedTier", "Store", "StoreURL", "StoreUnavailable", "attach_shared_tier", "check_url",
           "layout_of", "modeled_shared_link", "open_store", "parse_url"]
