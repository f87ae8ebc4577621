"""The one small interface every shared store backend implements, and `open_store(url)`.

    store = open_store("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata")
    store.register(array)                      # host memory values are read from / written into
    store.put_many(keys, values)               # values: per key its parts (uint8 arrays), in order
    store.get_many(keys, dests)                # into given parts; a status per key
    store.exists_many(keys)                    # a hint only: a hit is a read of the expected size
    store.remove_many(keys)

Statuses are per key: a put is STORED, EXISTS (first writer wins: nothing was written), FULL (the
store had no room; not a failure of the store) or FAILED; a get returns the bytes read (the
value's whole length, equal to the parts' total), ABSENT, WRONG_SIZE (the value exists with
another length; nothing usable was read) or FAILED. A store that cannot be reached at all raises
StoreUnavailable. Backends never retry and never sleep: deadlines and the circuit breaker are the
tier's (kvatlas.tiers.shared.tier). Network clients live only in the backend modules; nothing
above `tiers/` knows which store it is.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from ...errors import ConfigError

STORED, EXISTS, FULL, FAILED = "stored", "exists", "full", "failed"
ABSENT, WRONG_SIZE = -1, -2
GET_FAILED = -3


class StoreUnavailable(ConnectionError):
    """The store cannot be reached (connection refused, reset, timed out, not set up): the
    tier counts it and serves misses; never an error of the caller's input."""


def scatter(blob, parts) -> int:
    """Copy one value read whole (`blob`, None when absent) into its parts: the get status."""
    if blob is None:
        return ABSENT
    if len(blob) != sum(p.nbytes for p in parts):
        return WRONG_SIZE
    import numpy as np
    at = 0
    for p in parts:
        p[:] = np.frombuffer(blob, np.uint8, p.nbytes, at)
        at += p.nbytes
    return len(blob)


class Store:
    """Base of the backends; see the module doc for the contract."""

    name = "store"
    zero_copy = False   # reads and writes go straight between the store and registered memory

    def register(self, array) -> None:
        """Host memory (a uint8 array) that values are read from and written into."""

    def put_many(self, keys: list[str], values: list[list]) -> list[str]:
        raise NotImplementedError

    def get_many(self, keys: list[str], dests: list[list]) -> list[int]:
        raise NotImplementedError

    def exists_many(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def remove_many(self, keys: list[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return self.name


SCHEMES = ("mooncake", "redis", "memory")


def parse_url(url: str, field: str = "shared_tier"):
    """(scheme, host, port, path, options) of a store URL; bad input refused naming `field`."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(field, f"{url!r} is not a store URL",
                          "give mooncake://HOST:PORT?metadata=URL, redis://HOST:PORT or memory://NAME")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(field, f"{parts.scheme!r} is not a shared store",
                          f"use one of {', '.join(s + '://' for s in SCHEMES)}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(field, f"{url!r} has a bad port", "give a port in 1..65535") from None
    opts = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return parts.scheme, parts.hostname, port, parts.path.lstrip("/"), opts


def open_store(url: str, field: str = "shared_tier") -> Store:
    """The backend a URL names; its client library is imported only here, on demand."""
    scheme, host, port, path, opts = parse_url(url, field)
    if scheme == "memory":
        from .memory_store import MemoryStore
        return MemoryStore.named(host or path or "default", opts)
    if host is None or port is None:
        raise ConfigError(field, f"{url!r} names no host and port", f"give {scheme}://127.0.0.1:PORT")
    if scheme == "redis":
        from .redis_store import RedisStore
        return RedisStore(host, port, path, opts, field)
    from .mooncake_store import MooncakeStore
    return MooncakeStore(host, port, opts, field)
