"""Metric samples written in one process and exported by another's Prometheus registry.

An engine whose /metrics lives in a different process from its KV cache (vLLM: the API server
serves /metrics, the engine core owns the scheduler) needs the values to cross. A board is two
files in a directory both processes know: `NAME.json`, written once, names every sample (metric,
label names, label values), and `NAME.bin` holds the values, a sequence counter and one float64
per sample, rewritten in place. The writer bumps the counter to odd, writes, bumps it to even;
a reader that sees an odd or changed counter reads again, so a scrape never mixes two writes.
A write is O(samples) with no allocation of files; the board of a process that has died is
skipped (its pid is in the file name).
"""

from __future__ import annotations

import json
import mmap
import os
import struct

_SEQ = struct.Struct("<Q")


class Board:
    """The writing side: one process, a fixed list of sample keys."""

    def __init__(self, directory: str, name: str, keys: list[tuple]) -> None:
        self.keys = [(n, tuple(ln), tuple(lv)) for n, ln, lv in keys]
        self._pack = struct.Struct(f"<{len(self.keys)}d")
        base = os.path.join(directory, f"{name}-{os.getpid()}")
        self.paths = (base + ".json", base + ".bin")
        size = _SEQ.size + self._pack.size
        with open(self.paths[1], "wb") as f:
            f.write(b"\0" * size)
        self._file = open(self.paths[1], "r+b")
        self._map = mmap.mmap(self._file.fileno(), size)
        self._seq = 0
        tmp = self.paths[0] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"schema": "kvatlas.board", "pid": os.getpid(), "keys": self.keys}, f)
        os.replace(tmp, self.paths[0])   # readers list .json files: a board appears whole

    def write(self, values) -> None:
        """`values`: one float per key, a sequence or a float64 array (written as its bytes)."""
        m = self._map
        self._seq += 1
        _SEQ.pack_into(m, 0, self._seq)
        if hasattr(values, "tobytes"):
            m[_SEQ.size:_SEQ.size + self._pack.size] = values.astype("<f8", copy=False).tobytes()
        else:
            self._pack.pack_into(m, _SEQ.size, *values)
        self._seq += 1
        _SEQ.pack_into(m, 0, self._seq)

    def close(self) -> None:
        for p in self.paths:
            try:
                os.unlink(p)
            except OSError:
                pass
        self._map.close()
        self._file.close()


def read_boards(directory: str) -> list[tuple[tuple, float]]:
    """Every live board's (key, value) pairs, oldest board first; boards of dead processes and torn
    files are skipped."""
    out = []
    try:
        names = sorted((n for n in os.listdir(directory) if n.endswith(".json")),
                       key=lambda n: os.stat(os.path.join(directory, n)).st_mtime_ns)
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                head = json.load(f)
            if not _alive(int(head["pid"])):
                continue
            keys = [(n, tuple(ln), tuple(lv)) for n, ln, lv in head["keys"]]
            values = _values(os.path.join(directory, name[:-5] + ".bin"), len(keys))
        except (OSError, ValueError, KeyError, struct.error):
            continue
        if values is not None:
            out.extend(zip(keys, values))
    return out


def _values(path: str, n: int):
    pack = struct.Struct(f"<{n}d")
    for _ in range(8):
        with open(path, "rb") as f:
            raw = f.read(_SEQ.size + pack.size)
        if len(raw) < _SEQ.size + pack.size:
            return None
        seq = _SEQ.unpack_from(raw)[0]
        values = pack.unpack_from(raw, _SEQ.size)
        with open(path, "rb") as f:
            again = _SEQ.unpack(f.read(_SEQ.size))[0]
        if seq == again and seq % 2 == 0 and seq:
            return values
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BoardCollector:
    """A prometheus_client collector exporting every live board in `directory` on each scrape:
    one gauge family per metric name, help texts from kvatlas's table."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def describe(self):
        return []   # families vary with the boards present: none claimed at registration

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from ..observing.metrics import HELP
        # one sample per series: where two live boards carry the same labels (two engines of one
        # rank in one directory), the newer board's value is exported
        latest = dict(read_boards(self.directory))
        fams: dict[str, object] = {}
        for (name, labelnames, labelvalues), value in latest.items():
            fam = fams.get(name)
            if fam is None:
                fam = fams[name] = GaugeMetricFamily(name, HELP.get(name, name), labels=labelnames)
            fam.add_metric(labelvalues, value)
        return list(fams.values())
