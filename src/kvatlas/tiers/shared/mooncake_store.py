"""Mooncake Store as the shared store (the `mooncake` extra; the CPU wheel on machines without a
GPU driver: `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`, the CUDA wheel
`mooncake-transfer-engine` on GPU hosts: both install the same `mooncake` module).

    mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata[&protocol=tcp][&local=127.0.0.1]
              [&segment=0][&buffer=64MiB][&device=]

`segment` is the memory this process contributes to the store (0: none; a `mooncake_client`
daemon contributes it), `buffer` the client's local transfer buffer. Values move zero-copy: the
host memory they live in is registered once (`register`), and a page — one range per host
buffer plus its header — is put with `batch_put_from_multi_buffers` and read back into the same
ranges with `batch_get_into_multi_buffers`, one call per batch.

What the codes mean (measured, kvatlas's L3 notes): -704 is an absent key; a get into parts of
another total length fails (-600 smaller, -800 larger), so a failed get asks `get_size` whether
the value has another length (WRONG_SIZE) or the transfer failed (the memory daemon is gone:
-800 at once); a master that is gone stalls each call about 4 s, then -900 (the tier's deadline
stops waiting long before). A put of an existing key returns 0 and moves nothing (first writer
wins); -200 is no room (under pressure, or segments not mounted again yet after a restart).

Opening is bounded (`open`): Mooncake's `setup` retries 20 times for up to 30 s each when the
master does not answer, and holds the interpreter lock meanwhile (no thread of this process
runs, signals wait), so the same setup is first made by a probe process killed at the start-up
bound; this process sets up only after the probe succeeded.
"""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlsplit

from ...errors import ConfigError
from ...units import parse_bytes
from .store import ABSENT, FAILED, FULL, GET_FAILED, STORED, WRONG_SIZE, Store, StoreUnavailable, run_probe

NOT_FOUND = -704
NO_ROOM = -200
_OPTIONS = {"metadata", "protocol", "local", "segment", "buffer", "device"}


def _store_class():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError("shared_tier", f"mooncake:// needs Mooncake's client ({exc})",
                          "pip install 'kvatlas[mooncake]' (CPU machines: mooncake-transfer-engine-non-cuda; "
                          "its import needs libibverbs1)") from None
    return MooncakeDistributedStore


# A probe process: Mooncake's setup, then close; it prints setup's return code. (Its own module
# only: it imports neither kvatlas nor torch, so it starts in a fraction of a second.)
_PROBE = """
import ctypes, json, sys
try:
    ctypes.CDLL(None).prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL: never outlives the process that asked
except Exception:
    pass
import os
if os.getppid() != int(sys.argv[2]):   # the parent left before the signal was armed
    sys.exit(3)
from mooncake.store import MooncakeDistributedStore
a = json.loads(sys.argv[1])
s = MooncakeDistributedStore()
rc = s.setup(a["local"], a["metadata"], 0, 16 << 20, a["protocol"], a["device"], a["master"])
print("rc", rc, flush=True)
if rc == 0:
    s.close()
"""


class MooncakeStore(Store):
    name = "mooncake"
    zero_copy = True

    @staticmethod
    def check(u, field: str = "shared_tier") -> None:
        """The URL's host, port and options (no connection made)."""
        unknown = set(u.options) - _OPTIONS
        if unknown:
            raise ConfigError(field, f"mooncake:// takes no option {sorted(unknown)[0]!r}",
                              f"give only {', '.join(sorted(_OPTIONS))}")
        if u.host is None or u.port is None:
            raise ConfigError(field, f"{u.text!r} names no host and port", "give mooncake://127.0.0.1:PORT")
        if u.username is not None or u.password is not None or u.path not in ("", "/"):
            raise ConfigError(field, f"{u.text!r}: mooncake:// takes no credentials and no path",
                              "give mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata")
        if "metadata" not in u.options:
            raise ConfigError(field, "mooncake:// needs the metadata server",
                              "add ?metadata=http://HOST:PORT/metadata (the master's --enable_http_metadata_server)")
        meta = urlsplit(u.options["metadata"])
        try:
            meta_port = meta.port
        except ValueError:
            meta_port = None
        if meta.scheme not in ("http", "https") or not meta.hostname or not meta_port:
            raise ConfigError(field, f"metadata {u.options['metadata']!r} is not an http://HOST:PORT/PATH URL",
                              "give ?metadata=http://HOST:PORT/metadata")
        for opt in ("protocol", "local"):
            if opt in u.options and not u.options[opt]:
                raise ConfigError(field, f"mooncake:// option {opt!r} is empty", f"drop {opt}= or give a value")
        if u.options.get("segment", "0") != "0":
            parse_bytes(u.options["segment"], f"{field} segment")
        parse_bytes(u.options.get("buffer", "64MiB"), f"{field} buffer")

    def __init__(self, u, field: str = "shared_tier") -> None:
        self.check(u, field)
        opts = u.options
        self.master = f"{u.host}:{u.port}"
        self.segment = 0 if opts.get("segment", "0") == "0" else parse_bytes(opts["segment"], f"{field} segment")
        self.buffer = parse_bytes(opts.get("buffer", "64MiB"), f"{field} buffer")
        self.args = {"local": opts.get("local", "127.0.0.1"), "metadata": opts["metadata"],
                     "protocol": opts.get("protocol", "tcp"), "device": opts.get("device", ""), "master": self.master}
        self._class = _store_class()
        self.s = None
        self.ready = False
        self._registered: list = []

    def open(self, bound_s: float) -> None:
        """Mooncake's `setup` retries for minutes when the master does not answer, holding the
        interpreter lock: a probe process makes the same setup first (killed at `bound_s`), and
        only after it succeeded does this process set up (then in well under a second)."""
        out = run_probe([sys.executable, "-c", _PROBE, json.dumps(self.args), str(os.getpid())], bound_s, self.describe())
        rc = next((line.split()[1] for line in out.splitlines() if line.startswith("rc ")), None)
        if rc != "0":
            raise StoreUnavailable(f"{self.describe()}: setup " + (f"returned {rc}" if rc else "did not finish")
                                   + " (is the master up, and its metadata server?)")
        s = self._class()
        rc = s.setup(self.args["local"], self.args["metadata"], self.segment, self.buffer, self.args["protocol"],
                     self.args["device"], self.master)
        if rc != 0:
            raise StoreUnavailable(f"{self.describe()}: setup returned {rc}")
        self.s, self.ready = s, True

    def describe(self) -> str:
        return f"mooncake master {self.master}"

    def register(self, array) -> None:
        if array.nbytes and self.s.register_buffer(array.ctypes.data, array.nbytes) != 0:
            raise StoreUnavailable(f"mooncake: registering {array.nbytes} B of host memory failed")
        self._registered.append(array)

    @staticmethod
    def _ranges(values) -> tuple[list, list]:
        return [[p.ctypes.data for p in v] for v in values], [[p.nbytes for p in v] for v in values]

    def put_many(self, keys, values) -> list[str]:
        ptrs, sizes = self._ranges(values)
        codes = self.s.batch_put_from_multi_buffers(keys, ptrs, sizes)
        out = [STORED if c == 0 else FULL if c == NO_ROOM else FAILED for c in codes]
        if out and all(o == FAILED for o in out):
            raise StoreUnavailable(f"mooncake master {self.master}: put failed ({codes[0]})")
        return out

    def get_many(self, keys, dests) -> list[int]:
        ptrs, sizes = self._ranges(dests)
        codes = self.s.batch_get_into_multi_buffers(keys, ptrs, sizes)
        out = []
        for k, c, sz in zip(keys, codes, sizes):
            if c >= 0:
                out.append(c)
            elif c == NOT_FOUND:
                out.append(ABSENT)
            else:
                have = self.s.get_size(k)
                out.append(ABSENT if have == NOT_FOUND else
                           WRONG_SIZE if have >= 0 and have != sum(sz) else GET_FAILED)
        if out and all(o == GET_FAILED for o in out):
            raise StoreUnavailable(f"mooncake master {self.master}: get failed ({codes[0]})")
        return out

    def exists_many(self, keys) -> list[bool]:
        codes = self.s.batch_is_exist(keys)
        if codes and all(c < 0 for c in codes):
            raise StoreUnavailable(f"mooncake master {self.master}: existence check failed ({codes[0]})")
        return [c == 1 for c in codes]

    def remove_many(self, keys) -> None:
        if keys:
            self.s.batch_remove(keys)   # a key read in the last seconds is leased: it stays, as a value may

    def raw_get(self, key: str) -> bytes | None:
        """Tests: the value's bytes as stored (None: absent)."""
        n = self.s.get_size(key)
        return None if n < 0 else bytes(self.s.get(key))

    def raw_remove(self, key: str) -> None:
        """Tests: remove a key whatever holds it."""
        self.s.remove(key, True)

    def raw_put(self, key: str, blob: bytes) -> None:
        """Tests: store any bytes under a key, replacing what is there (a forced remove first)."""
        self.s.remove(key, True)
        self.s.put(key, blob)

    def close(self) -> None:
        if self.s is None:
            return
        for a in self._registered:
            self.s.unregister_buffer(a.ctypes.data)
        self._registered.clear()
        self.s.close()
