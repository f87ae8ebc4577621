"""The copy engine: moves cached pages and checkpoints between device buffers and the host tier.

Every transfer goes through one device staging buffer, on one copy stream of its own:
- to host: the device units are gathered into staging (`index_select`, one kernel per buffer and
  chunk), then each run of consecutive host rows is one device-to-host copy;
- to device: each run of consecutive host rows is one host-to-device copy into staging, then one
  `index_copy_` per buffer and chunk scatters it to the device units.
Copying page by page instead costs one `cudaMemcpyAsync` per page per buffer (3 for V4-Flash,
one of them 34 KB): per-call overhead then rivals the transfer. Through staging, a restore of a
chain evicted together (consecutive host slots) is a few large copies. Host slots are handed out
lowest first, so a chain evicted together lands in consecutive slots. Bridging small gaps
between scattered host rows (copying the rows between, then gathering the wanted ones on the
device) was tried and measured slower on the H200 (0.57× against 0.63× of a plain copy for a
random half of the host slots): the extra bytes cost more than the copy calls they save.

Ordering (why it is safe without locks): the copy stream first waits for the compute stream (a
transfer sees every write issued before it); every transfer runs on the same copy stream, so a
host slot freed by a restore is only overwritten after that restore read it, and the staging
buffer is never used by two transfers at once. A move to host ends by making the compute stream
wait for it, so a device page given back right after is not rewritten before it was read. A
restore is ready when its end event has fired (`Transfer.done()`); `Transfer.wait()` makes the
compute stream wait for it before the request's first forward pass.

On a CPU device the same code runs synchronously (no stream, no events).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class UnitMove:
    """Whole device units ↔ host rows: `host` [rows, row_bytes], `device` [units, row_bytes] uint8."""

    host: object
    device: object
    host_rows: np.ndarray
    device_units: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.host_rows) * self.host.shape[1]


@dataclass(frozen=True, slots=True)
class RowMove:
    """Consecutive ring rows of every layer of one device unit ↔ one host unit.
    `host` [units, layers, span], `device` [units, layers, ring_bytes] uint8; item i moves
    device[device_units[i], :, first_bytes[i]:first_bytes[i] + span] ↔ host[host_units[i]]."""

    host: object
    device: object
    host_units: np.ndarray
    device_units: np.ndarray
    first_bytes: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.host_units) * self.host.shape[1] * self.host.shape[2]


class Transfer:
    """One batch of copies in one direction. Ready when done(); latency known once done."""

    def __init__(self, direction: str, nbytes: int, items: int, start, end, issued_s: float) -> None:
        self.direction, self.nbytes, self.items = direction, nbytes, items
        self._start, self._end, self._issued_s = start, end, issued_s
        self.modeled_s = 0.0   # the H200 time model's seconds for this move (set by the host tier)
        self._latency_s = None if end is not None else time.perf_counter() - issued_s

    def done(self) -> bool:
        return self._end is None or self._end.query()

    def wait(self, stream=None) -> None:
        """Make `stream` (default: the current one) wait for this transfer; returns at once."""
        if self._end is not None:
            import torch
            (stream or torch.cuda.current_stream(self._end.device)).wait_event(self._end)

    def synchronize(self) -> None:
        if self._end is not None:
            self._end.synchronize()

    @property
    def latency_s(self) -> float | None:
        """Seconds from issue to the last copy landing (device clock); None while in flight."""
        if self._latency_s is None and self.done():
            self._latency_s = self._start.elapsed_time(self._end) / 1e3
        return self._latency_s


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(first host row, length, offset in the chunk) of each run of consecutive rows."""
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(rows)]))
    return [(int(rows[a]), int(b - a), int(a)) for a, b in zip(starts.tolist(), ends.tolist())]


class CopyEngine:
    def __init__(self, device, staging_bytes: int, largest_row_bytes: int) -> None:
        import torch
        if staging_bytes < largest_row_bytes:
            raise ConfigError("staging_bytes", f"{staging_bytes} B cannot hold one unit of the largest host "
                              f"buffer ({largest_row_bytes} B)", f"give at least {largest_row_bytes} B")
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    def run(self, direction: str, moves: list) -> Transfer:
        """Issue `moves` (UnitMove / RowMove) to "host" or to "device"; returns at once on CUDA."""
        import torch
        issued = time.perf_counter()
        if not self.cuda:
            self._issue(direction, moves)
            return Transfer(direction, sum(m.nbytes for m in moves), len(moves), None, None, issued)
        compute = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(compute)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._issue(direction, moves)
        end.record(self.stream)
        if direction == "host":   # the device units may be handed out again right after
            compute.wait_event(end)
        return Transfer(direction, sum(m.nbytes for m in moves), len(moves), start, end, issued)

    def _issue(self, direction: str, moves: list) -> None:
        for m in moves:
            if isinstance(m, UnitMove):
                self._units(m, direction == "host")
            else:
                self._rows(m, direction == "host")

    def _units(self, m: UnitMove, to_host: bool) -> None:
        import torch
        order = np.argsort(m.host_rows, kind="stable")
        rows, units = m.host_rows[order], m.device_units[order]
        row_bytes = m.host.shape[1]
        per_chunk = self.staging_bytes // row_bytes
        for c in range(0, len(rows), per_chunk):
            hr, du = rows[c:c + per_chunk], units[c:c + per_chunk]
            idx = torch.from_numpy(np.ascontiguousarray(du)).to(self.device, non_blocking=True)
            st = self.staging[: len(hr) * row_bytes].view(len(hr), row_bytes)
            if to_host:
                torch.index_select(m.device, 0, idx, out=st)
                for h0, n, off in _runs(hr):
                    m.host[h0:h0 + n].copy_(st[off:off + n], non_blocking=True)
            else:
                for h0, n, off in _runs(hr):
                    st[off:off + n].copy_(m.host[h0:h0 + n], non_blocking=True)
                m.device.index_copy_(0, idx, st)

    def _rows(self, m: RowMove, to_host: bool) -> None:
        layers, span = m.host.shape[1], m.host.shape[2]
        st = self.staging[: layers * span].view(layers, span)
        for h, u, b in zip(m.host_units.tolist(), m.device_units.tolist(), m.first_bytes.tolist()):
            dev = m.device[u, :, b:b + span]
            if to_host:
                st.copy_(dev)
                m.host[h].copy_(st, non_blocking=True)
            else:
                st.copy_(m.host[h], non_blocking=True)
                dev.copy_(st)
