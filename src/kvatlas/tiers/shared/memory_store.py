"""An in-process store for unit tests and single-process runs: a dict with the same contract as
the network stores (first writer wins, a capacity with least-recently-used eviction, a get into
given parts), and switches a test flips to play a store that is down or slow."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np

from ...errors import ConfigError
from ...units import parse_bytes
from .store import EXISTS, FULL, STORED, Store, StoreUnavailable, scatter

_NAMED: dict = {}


class MemoryStore(Store):
    name = "memory"

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.values: OrderedDict = OrderedDict()   # key -> bytes, least recently used first
        self.used_bytes = 0
        self.down = False          # every call raises StoreUnavailable
        self.delay_s = 0.0         # every call of the operations in `slow` takes this long first
        self.slow = {"put", "get", "exists", "remove"}
        self.evicted = 0
        self._lock = threading.Lock()

    @staticmethod
    def check(u, field: str = "shared_tier") -> None:
        unknown = set(u.options) - {"capacity"}
        if unknown:
            raise ConfigError(field, f"memory:// takes no option {sorted(unknown)[0]!r}",
                              "give memory://NAME or memory://NAME?capacity=BYTES")
        if u.username is not None or u.password is not None or u.port is not None:
            raise ConfigError(field, f"{u.text!r}: memory:// takes a name only", "give memory://NAME")
        if "capacity" in u.options:
            parse_bytes(u.options["capacity"], f"{field} capacity")

    @classmethod
    def named(cls, name: str, opts: dict) -> "MemoryStore":
        """One store per name in this process (memory://NAME?capacity=64MiB)."""
        if name not in _NAMED:
            cap = parse_bytes(opts["capacity"], "shared_tier capacity") if "capacity" in opts else None
            _NAMED[name] = cls(cap)
        return _NAMED[name]

    def describe(self) -> str:
        return f"memory ({len(self.values)} values, {self.used_bytes} B)"

    def _enter(self, op: str) -> None:
        if self.delay_s and op in self.slow:
            time.sleep(self.delay_s)
        if self.down:
            raise StoreUnavailable("memory store switched off")

    def put_many(self, keys, values) -> list[str]:
        self._enter("put")
        out = []
        with self._lock:
            for k, parts in zip(keys, values):
                if k in self.values:
                    out.append(EXISTS)
                    continue
                blob = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
                if self.capacity_bytes is not None and not self._room(len(blob)):
                    out.append(FULL)
                    continue
                self.values[k] = blob
                self.used_bytes += len(blob)
                out.append(STORED)
        return out

    def _room(self, n: int) -> bool:
        if n > self.capacity_bytes:
            return False
        while self.used_bytes + n > self.capacity_bytes:
            _, old = self.values.popitem(last=False)
            self.used_bytes -= len(old)
            self.evicted += 1
        return True

    def get_many(self, keys, dests) -> list[int]:
        self._enter("get")
        out = []
        with self._lock:
            for k, parts in zip(keys, dests):
                if k in self.values:
                    self.values.move_to_end(k)
                out.append(scatter(self.values.get(k), parts))
        return out

    def exists_many(self, keys) -> list[bool]:
        self._enter("exists")
        with self._lock:
            return [k in self.values for k in keys]

    def remove_many(self, keys) -> None:
        self._enter("remove")
        with self._lock:
            for k in keys:
                blob = self.values.pop(k, None)
                if blob is not None:
                    self.used_bytes -= len(blob)

    def raw_get(self, key: str) -> bytes | None:
        """Tests: the value's bytes as stored (None: absent)."""
        with self._lock:
            return self.values.get(key)

    def raw_remove(self, key: str) -> None:
        """Tests: remove a key whatever holds it."""
        self.remove_many([key])

    def raw_put(self, key: str, blob: bytes) -> None:
        """Tests: store any bytes under a key, replacing what is there (a damaged or foreign value)."""
        with self._lock:
            old = self.values.pop(key, None)
            self.used_bytes += len(blob) - (len(old) if old is not None else 0)
            self.values[key] = bytes(blob)
