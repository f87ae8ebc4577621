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

Start-up is bounded. `parse_url`/`check_url` check a URL whole (scheme, host, port, path,
credentials, options) without connecting; `open_store(url, startup_s=5)` then opens the store on
a thread of its own and waits at most `startup_s`: the backend, open; or, when the store did not
answer in time (down, blackholed, slow), an OpeningStore that keeps trying in the background
(one attempt at a time, each bounded, backing off to 30 s) while the tier serves misses
(`tier_unavailable`); or a ConfigError when the store answered and refused (credentials, a
database it does not have, not that kind of server). A client call that cannot be bounded in
this process (Mooncake's `setup` holds the interpreter lock while it retries) is first made by
a probe process that is killed at the bound (`run_probe`).
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from dataclasses import dataclass
from dataclasses import field as _field
from urllib.parse import parse_qsl, unquote, urlsplit

from ...checks import real
from ...errors import ConfigError, KvatlasError

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
DEFAULT_STARTUP_S = 5.0
MAX_STARTUP_S = 600.0
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0   # a store that did not open is tried again, backing off to this


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


def _backend(scheme: str):
    """The backend class of a scheme (its module imports its client only when it opens)."""
    if scheme == "memory":
        from .memory_store import MemoryStore
        return MemoryStore
    if scheme in ("redis", "rediss"):
        from .redis_store import RedisStore
        return RedisStore
    from .mooncake_store import MooncakeStore
    return MooncakeStore


def check_url(url, field: str = "shared_tier") -> StoreURL:
    """parse_url, then the backend's own checks of host, path, credentials and options: every
    input error of a URL, found without connecting to anything."""
    u = parse_url(url, field)
    _backend(u.scheme).check(u, field)
    return u


def check_startup(startup_s, field: str = "startup_s") -> float:
    return real(field, startup_s, 0.0, MAX_STARTUP_S, open_low=True)


def open_store(url, field: str = "shared_tier", *, startup_s: float = DEFAULT_STARTUP_S,
               startup_field: str = "startup_s") -> Store:
    """The backend a URL names, open: waits at most `startup_s` (on a thread of its own, so a
    store that does not answer never holds the caller longer). Returns the backend once it is
    open; a store that has not opened by then comes back as an OpeningStore that keeps trying in
    the background (misses, `tier_unavailable`, until it is open). A store that answers and
    refuses (credentials, database, not that kind of server) is a ConfigError naming `field`."""
    u = check_url(url, field)
    bound = check_startup(startup_s, startup_field)
    if u.scheme == "memory":
        from .memory_store import MemoryStore
        return MemoryStore.named(u.host or u.path.lstrip("/") or "default", u.options)
    opening = OpeningStore(_backend(u.scheme)(u, field), bound, field)
    opening.tried.wait(bound)        # the first attempt's outcome, or the bound
    if opening.refused is not None:
        raise opening.refused
    return opening.backend if opening.ready else opening


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
def _kill_probes() -> None:
    for proc in list(_PROBES):
        _kill(proc)


class OpeningStore(Store):
    """A store still opening: a thread of its own tries `backend.open(bound_s)`, and again after a
    back-off (RETRY_FIRST_S doubling to RETRY_MAX_S) while it fails for a reason that may pass
    (refused, no answer), one attempt at a time. Until it is open every call raises
    StoreUnavailable (the tier counts `tier_unavailable` misses without calling); memory
    registered meanwhile is registered with the backend before it serves. A store that answers
    and refuses (credentials, database, not that kind of server) is not tried again: `refused`
    holds the ConfigError, and `describe()` says what is wrong either way."""

    def __init__(self, backend, bound_s: float, field: str = "shared_tier", on_change=None,
                 retry_s: tuple = (RETRY_FIRST_S, RETRY_MAX_S)) -> None:
        self.backend, self.bound_s, self.field, self.retry_s = backend, bound_s, field, retry_s
        self.name, self.zero_copy = backend.name, backend.zero_copy
        self.problem = f"no answer yet within {bound_s:g} s"
        self.refused: Exception | None = None
        self.attempts = 0
        self.on_change = on_change     # called (from the opening thread) once it is open or refused
        self._open = False
        self._lock = threading.Lock()
        self._registered: list = []
        self._done = threading.Event()
        self.tried = threading.Event()    # set when the first attempt has ended, whatever its outcome
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvatlas-shared-open", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._open

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until it is open or refused (at most `timeout_s`): whether it is open."""
        self._done.wait(timeout_s)
        return self._open

    def _run(self) -> None:
        delay = self.retry_s[0]
        while not self._closed.is_set():
            self.attempts += 1
            try:
                self.backend.open(self.bound_s)
                with self._lock:
                    for array in self._registered:
                        self.backend.register(array)
                    self._open = True
                self.problem = None
            except StoreUnavailable as exc:
                self.problem = str(exc).removeprefix(f"{self.backend.describe()}: ")
                self.tried.set()
                if self._closed.wait(delay):
                    break
                delay = min(2 * delay, self.retry_s[1])
                continue
            except KvatlasError as exc:
                self.refused, self.problem = exc, str(exc)
            except Exception as exc:   # noqa: BLE001 (a client's own error: reported, never raised here)
                self.refused = ConfigError(self.field, f"{self.backend.describe()} failed to open "
                                           f"({type(exc).__name__}: {exc})", "check the store and its URL")
                self.problem = str(self.refused)
            self.tried.set()
            self._done.set()
            if self.on_change is not None:
                self.on_change(self)
            break
        if self._closed.is_set() and self._open:
            self.backend.close()

    def describe(self) -> str:
        what = self.backend.describe()
        if self._open:
            return what
        if self.refused is not None:
            return f"{what} (refused: {self.refused})"
        return f"{what} (not open: {self.problem}; trying again in the background)"

    def register(self, array) -> None:
        with self._lock:
            if self._open:
                self.backend.register(array)
            else:
                self._registered.append(array)

    def _backend_or_raise(self):
        if not self._open:
            raise StoreUnavailable(self.describe())
        return self.backend

    def put_many(self, keys, values):
        return self._backend_or_raise().put_many(keys, values)

    def get_many(self, keys, dests):
        return self._backend_or_raise().get_many(keys, dests)

    def exists_many(self, keys):
        return self._backend_or_raise().exists_many(keys)

    def remove_many(self, keys):
        return self._backend_or_raise().remove_many(keys)

    def __getattr__(self, name):
        """What else the backend offers (the tests' raw_get, raw_put, ...), once it is open."""
        if name.startswith("raw_"):
            return getattr(self._backend_or_raise(), name)
        raise AttributeError(name)

    def close(self) -> None:
        """Stops the retries; closes the backend (now, or when an attempt in flight ends)."""
        self._closed.set()
        with self._lock:
            if self._open:
                self._open = False
                self.backend.close()
