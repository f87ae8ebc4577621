"""Opening a shared store by its URL, with a bound: the factory above the backends.

    store = open_store("redis://127.0.0.1:6379", startup_s=5)

`check_url` checks a URL whole (`store.parse_url`, then the backend's own checks) without
connecting; `open_store(url, startup_s=5)` then opens the store on a thread of its own and waits
at most `startup_s`: the backend, open; or, when the store did not answer in time (down,
blackholed, slow), an OpeningStore that keeps trying in the background (one attempt at a time,
each bounded, backing off to 30 s) while the tier serves misses (`tier_unavailable`); or a
ConfigError when the store answered and refused (credentials, a database it does not have, not
that kind of server). This module imports the backends (each only when its scheme is asked for);
they import `store`, never this module.
"""

from __future__ import annotations

import threading

from ...checks import real
from ...errors import ConfigError, KvatlasError
from .store import Store, StoreUnavailable, StoreURL, parse_url

DEFAULT_STARTUP_S = 5.0
MAX_STARTUP_S = 600.0
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0   # a store that did not open is tried again, backing off to this


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
