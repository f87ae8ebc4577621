"""The one small interface every shared store backend implements, its URLs, and its probes.

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

URLs: `parse_url` checks a URL whole (scheme, host, port, path, credentials, options) without
connecting; each backend adds its own checks (`Store.check`). Opening a store with a bound, and
the factory that picks a backend by scheme, live a level above the backends (`opening`), so that
the backends import this module and nothing imports back. A client call that cannot be bounded in
this process (Mooncake's `setup` holds the interpreter lock while it retries) is first made by a
probe process that is killed at the bound (`run_probe`).
"""

from __future__ import annotations

import atexit
import os
import re
from dataclasses import dataclass
from dataclasses import field as _field
from urllib.parse import parse_qsl, unquote, urlsplit

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
    ready = True        # open and serving (an OpeningStore is not, until it is)

    @staticmethod
    def check(url: "StoreURL", field: str) -> None:
        """Refuse what this backend cannot take in a parsed URL (no connection made)."""

    def open(self, bound_s: float) -> None:
        """Connect and check the store answers, within `bound_s`: StoreUnavailable when it may
        yet (refused, no answer), a ConfigError when it answers and refuses."""

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


SCHEMES = ("mooncake", "redis", "rediss", "memory")


@dataclass(frozen=True)
class StoreURL:
    """A store URL parsed whole: credentials percent-decoded, `text` the URL with the password
    replaced by *** (the only form of it any message shows)."""

    scheme: str
    host: str | None
    port: int | None
    path: str
    options: dict = _field(hash=False)
    username: str | None = None
    password: str | None = None
    text: str = ""


def redact(url) -> str:
    """The URL with any password in it replaced by *** (for messages)."""
    if not isinstance(url, str):
        return repr(url)
    m = re.match(r"^([^:/]*://)(.*)@(.*)$", url, re.S)   # (greedy: up to the last @, whatever the password holds)
    if m is None or ":" not in m.group(2):
        return url
    return f"{m.group(1)}{m.group(2).split(':', 1)[0]}:***@{m.group(3)}"


def parse_url(url, field: str = "shared_tier") -> StoreURL:
    """The whole URL checked: scheme, host, port, path, credentials and options; bad input
    refused naming `field` (each backend checks its own path and options, without its client)."""
    forms = "give mooncake://HOST:PORT?metadata=URL, redis://[:PASSWORD@]HOST:PORT[/DB], rediss://... or memory://NAME"
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(field, f"{redact(url) if isinstance(url, str) else repr(url)} is not a store URL", forms)
    shown = redact(url)
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(field, f"{shown!r} has a space or a control character", "remove it (percent-encode it in a password)")
    if "#" in url:
        raise ConfigError(field, f"{shown!r} has a '#'", "percent-encode it (%23) where it is part of a password")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        problem = "has a bad port" if "port" in str(exc).lower() else f"is malformed ({exc})"
        raise ConfigError(field, f"{shown!r} {problem}",
                          "give a port in 1..65535 and an IPv6 host in brackets, e.g. redis://[::1]:6379") from None
    if parts.scheme not in SCHEMES:
        raise ConfigError(field, f"{parts.scheme!r} is not a shared store",
                          f"use one of {', '.join(s + '://' for s in SCHEMES)}")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ConfigError(field, f"{shown!r} has a malformed query", "give ?NAME=VALUE&NAME=VALUE") from None
    opts: dict = {}
    for k, v in pairs:
        if k in opts:
            raise ConfigError(field, f"{shown!r} gives {k!r} twice", f"give {k} once")
        opts[k] = v
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if port == 0 and parts.scheme != "memory":
        raise ConfigError(field, f"{shown!r}: port 0 is no server's port", f"give the port the store listens on, "
                          f"e.g. {parts.scheme}://127.0.0.1:6379")
    return StoreURL(parts.scheme, parts.hostname, port, parts.path, opts, user, password, shown)


_PROBES: set = set()      # child processes probing a store (killed at exit: none outlives its parent)


def run_probe(args: list, bound_s: float, what: str) -> str:
    """Run a probe process (a client call that cannot be bounded in this process: it holds the
    interpreter lock), killed when it is not done within `bound_s`: its stdout, or
    StoreUnavailable saying it did not answer."""
    import subprocess
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    _PROBES.add(proc)
    try:
        out, _ = proc.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise StoreUnavailable(f"{what}: no answer within {bound_s:g} s") from None
    finally:
        _PROBES.discard(proc)
    return out


def _kill(proc) -> None:
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.communicate(timeout=5)
    except Exception:   # noqa: BLE001 (already killed: nothing else to do)
        pass


@atexit.register
def kill_probes() -> None:
    """Kill every probe still running (at exit, and by a caller that leaves through os._exit,
    which skips atexit)."""
    for proc in list(_PROBES):
        _kill(proc)
