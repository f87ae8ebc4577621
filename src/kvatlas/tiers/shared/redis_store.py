"""Redis / Valkey as the shared store (`redis://[[USER]:PASSWORD@]HOST:PORT[/DB][?timeout=0.5]`,
`rediss://...[&ca=CA_FILE]` for TLS; the `redis` extra: `pip install 'kvatlas[redis]'`). The one anyone can run: `redis-server --bind 127.0.0.1
--save "" --appendonly no`, with `maxmemory` and `allkeys-lru` for a bounded store.

A put is SET NX (first writer wins) in one pipeline per batch; a get is MGET, each value copied
into the given parts. redis-py's pure-Python command packer sends large values as they are (the
hiredis packer spends 8-10 ms packing each 0.9 MB value), and the client never retries: a
connection that fails raises StoreUnavailable at once, and the tier's breaker decides when to
try again. Nothing here is zero-copy: the value is joined into one buffer to send.

At start-up `open` PINGs with the URL's credentials and database: a password the server wants
(NOAUTH) or refuses, a database it does not have, a server that is not Redis (an HTTP server on
the port) are refused with what is wrong; refused connections and no answer may pass (the tier
serves misses meanwhile and keeps trying). Any error of the client after that is a miss
(`tier_unavailable`), never raised to the caller.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ...errors import ConfigError
from .store import EXISTS, FAILED, FULL, STORED, Store, StoreUnavailable, scatter


MAX_DB = (1 << 31) - 1
FIX_AUTH = ("give them in the URL: redis://:PASSWORD@HOST:PORT, or redis://USER:PASSWORD@HOST:PORT with an ACL "
            "user (percent-encode @ : / # % in them)")


def _redis():
    try:
        import redis
    except ImportError:
        raise ConfigError("shared_tier", "redis:// needs the redis client", "pip install 'kvatlas[redis]'") from None
    return redis


def _db(u, field: str) -> int:
    path = u.path[1:] if u.path.startswith("/") else u.path
    if path == "":
        return 0
    if not (path.isascii() and path.isdigit()) or int(path) > MAX_DB:
        raise ConfigError(field, f"{u.text!r}: database {path!r} is not a number from 0 to {MAX_DB:,}",
                          "give redis://HOST:PORT/DB with DB a database number (0 by default)")
    return int(path)


def _timeout(u, field: str) -> float:
    text = u.options.get("timeout", "1")
    try:
        t = float(text)
    except ValueError:
        t = math.nan
    if not (math.isfinite(t) and 0 < t <= 60):
        raise ConfigError(field, f"{u.text!r}: timeout {text!r} is not a number of seconds in (0, 60]",
                          "give ?timeout=SECONDS, e.g. ?timeout=0.5")
    return t


class RedisStore(Store):
    name = "redis"

    @staticmethod
    def check(u, field: str = "shared_tier") -> None:
        """The URL's host, port, database, credentials and options (no connection made)."""
        allowed = {"timeout", "ca"} if u.scheme == "rediss" else {"timeout"}
        unknown = set(u.options) - allowed
        if unknown:
            bad = sorted(unknown)[0]
            raise ConfigError(field, f"{u.scheme}:// takes no option {bad!r}" +
                              (" (a CA file is for TLS)" if bad == "ca" else ""),
                              f"give {u.scheme}://[:PASSWORD@]HOST:PORT[/DB][?timeout=SECONDS"
                              + ("][&ca=CA_FILE]" if u.scheme == "rediss" else "]")
                              + (" (rediss:// for TLS)" if bad == "ca" else ""))
        if u.host is None or u.port is None:
            raise ConfigError(field, f"{u.text!r} names no host and port", f"give {u.scheme}://127.0.0.1:PORT")
        if u.username is not None and u.password is None:
            raise ConfigError(field, f"{u.text!r} gives a user and no password",
                              "give redis://USER:PASSWORD@HOST:PORT (or redis://:PASSWORD@HOST:PORT)")
        _db(u, field)
        _timeout(u, field)
        ca = u.options.get("ca")
        if ca is not None and not os.path.isfile(ca):
            raise ConfigError(field, f"CA file {ca!r} does not exist", "give ?ca=PATH of a PEM file of CA certificates")

    def __init__(self, u, field: str = "shared_tier") -> None:
        self.check(u, field)
        self.url, self.field = u, field
        self.db, self.timeout = _db(u, field), _timeout(u, field)
        self.tls = u.scheme == "rediss"
        host = f"[{u.host}]" if ":" in u.host else u.host
        self.address = f"{host}:{u.port}/{self.db}"
        self.ready = False
        self._redis = _redis()
        self.r = self._client(self.timeout)

    def _client(self, timeout: float):
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        u = self.url
        kw = dict(host=u.host, port=u.port, db=self.db, username=u.username, password=u.password,
                  socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                  health_check_interval=0)
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=u.options.get("ca"))
        return self._redis.Redis(**kw)

    def describe(self) -> str:
        return f"redis {self.address}" + (" (TLS)" if self.tls else "")

    def open(self, bound_s: float) -> None:
        """PING with the URL's credentials and database, waiting at most `bound_s`: refused and no
        answer may pass (StoreUnavailable); credentials, a database the server does not have and
        a server that does not speak Redis are refused (ConfigError naming the field and the fix)."""
        r = self._client(min(self.timeout, bound_s))
        try:
            r.ping()
        except self._redis.exceptions.RedisError as exc:
            raise self._diagnose(exc) from None
        except OSError as exc:
            raise StoreUnavailable(f"{self.describe()}: {exc}") from None
        finally:
            r.close()
        self.ready = True

    def _diagnose(self, exc) -> Exception:
        """What a failed PING at start-up means: StoreUnavailable (may pass) or a ConfigError."""
        redis, msg = self._redis.exceptions, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        at = f"{self.describe()}"
        auth = tuple(getattr(redis, n) for n in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError",
                                                  "AuthorizationError", "NoPermissionError") if hasattr(redis, n))
        if isinstance(exc, auth) or any(w in msg for w in ("NOAUTH", "WRONGPASS", "authenticated", "AUTH")):
            if self.url.password is None:
                return ConfigError(self.field, f"{at} needs a password (NOAUTH)", FIX_AUTH)
            return ConfigError(self.field, f"{at} refused the credentials ({msg})", FIX_AUTH)
        if "CERTIFICATE_VERIFY_FAILED" in msg or "certificate verify failed" in msg:
            return ConfigError(self.field, f"{at}: the server's TLS certificate is not trusted ({msg})",
                               "give the CA that signed it: rediss://HOST:PORT?ca=CA_FILE (a PEM file)")
        if "DB index" in msg or "invalid DB" in msg:
            return ConfigError(self.field, f"{at}: the server has no database {self.db} ({msg})",
                               "give a database number below the server's `databases` setting (16 by default)")
        if isinstance(exc, (redis.TimeoutError, redis.BusyLoadingError)) or "refused" in msg.lower():
            return StoreUnavailable(f"{at}: {msg}")
        answer = self._first_answer()
        if answer is not None and answer[:1] not in b"+-:$*_,#!=(%~>|":
            return ConfigError(self.field, f"{at} is not Redis: it answered {answer[:40]!r}",
                               "give the port redis-server (or Valkey) listens on")
        if isinstance(exc, redis.ConnectionError):
            return StoreUnavailable(f"{at}: {msg}")
        return ConfigError(self.field, f"{at} answered PING with an error ({type(exc).__name__}: {msg})",
                           "check that the server is Redis or Valkey and takes this client's commands")

    def _first_answer(self) -> bytes | None:
        """The first bytes the server sends back to an inline PING (None: nothing, or TLS)."""
        if self.tls:
            return None
        import socket
        try:
            with socket.create_connection((self.url.host, self.url.port), timeout=min(self.timeout, 2.0)) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64) or None
        except OSError:
            return None

    def _call(self, fn):
        try:
            return fn()
        except Exception as exc:   # noqa: BLE001 (every error of the client, whatever its class: a miss, never raised)
            raise StoreUnavailable(f"{self.describe()}: {type(exc).__name__}: {exc}") from None

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
