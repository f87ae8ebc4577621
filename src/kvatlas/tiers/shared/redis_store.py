"""Redis / Valkey as the shared store (`redis://HOST:PORT[/DB][?timeout=0.5]`; the `redis`
extra: `pip install 'kvatlas[redis]'`). The one anyone can run: `redis-server --bind 127.0.0.1
--save "" --appendonly no`, with `maxmemory` and `allkeys-lru` for a bounded store.

A put is SET NX (first writer wins) in one pipeline per batch; a get is MGET, each value copied
into the given parts. redis-py's pure-Python command packer sends large values as they are (the
hiredis packer spends 8-10 ms packing each 0.9 MB value), and the client never retries: a
connection that fails raises StoreUnavailable at once, and the tier's breaker decides when to
try again. Nothing here is zero-copy: the value is joined into one buffer to send.
"""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from .store import EXISTS, FAILED, FULL, STORED, Store, StoreUnavailable, scatter


def _client(host, port, db, timeout):
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError("shared_tier", "redis:// needs the redis client", "pip install 'kvatlas[redis]'") from None
    return redis.Redis(host=host, port=port, db=db, socket_timeout=timeout, socket_connect_timeout=timeout,
                       retry=Retry(NoBackoff(), 0), health_check_interval=0), redis


class RedisStore(Store):
    name = "redis"

    def __init__(self, host: str, port: int, path: str, opts: dict, field: str = "shared_tier") -> None:
        unknown = set(opts) - {"timeout"}
        if unknown:
            raise ConfigError(field, f"redis:// takes no option {sorted(unknown)[0]!r}",
                              "give redis://HOST:PORT[/DB][?timeout=SECONDS]")
        try:
            db = int(path or 0)
            timeout = float(opts.get("timeout", 1.0))
        except ValueError:
            raise ConfigError(field, f"redis://{host}:{port}/{path}: bad database or timeout",
                              "give a database number and a timeout in seconds") from None
        self.address = f"{host}:{port}/{db}"
        self.r, self._redis = _client(host, port, db, timeout)

    def describe(self) -> str:
        return f"redis {self.address}"

    def _call(self, fn):
        try:
            return fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as exc:
            raise StoreUnavailable(f"redis {self.address}: {exc}") from None

    def put_many(self, keys, values) -> list[str]:
        def run():
            pipe = self.r.pipeline(transaction=False)
            for k, parts in zip(keys, values):
                pipe.set(k, b"".join(memoryview(np.ascontiguousarray(p)) for p in parts), nx=True)
            return pipe.execute(raise_on_error=False)
        out = []
        for res in self._call(run):
            if res is True:
                out.append(STORED)
            elif res is None:
                out.append(EXISTS)
            elif isinstance(res, self._redis.exceptions.OutOfMemoryError):
                out.append(FULL)    # maxmemory with noeviction: refused, the store is fine
            else:
                out.append(FAILED)
        return out

    def get_many(self, keys, dests) -> list[int]:
        blobs = self._call(lambda: self.r.mget(keys))
        return [scatter(blob, parts) for blob, parts in zip(blobs, dests)]

    def exists_many(self, keys) -> list[bool]:
        def run():
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return pipe.execute()
        return [bool(x) for x in self._call(run)]

    def remove_many(self, keys) -> None:
        if keys:
            self._call(lambda: self.r.delete(*keys))

    def raw_get(self, key: str) -> bytes | None:
        """Tests: the value's bytes as stored (None: absent)."""
        return self._call(lambda: self.r.get(key))

    def raw_remove(self, key: str) -> None:
        """Tests: remove a key whatever holds it."""
        self.remove_many([key])

    def raw_put(self, key: str, blob: bytes) -> None:
        """Tests: store any bytes under a key, replacing what is there."""
        self._call(lambda: self.r.set(key, blob))

    def close(self) -> None:
        self.r.close()
