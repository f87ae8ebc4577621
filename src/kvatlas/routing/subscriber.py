"""One engine's KV-event stream: a ZMQ SUB socket on its own thread, per replica and DP rank.

vLLM's publisher binds PUB on `endpoint` (port + DP rank) when the endpoint has a wildcard host
(`tcp://*:5557`) and connects to it otherwise, so either side may bind: `bind=True` makes the
subscriber bind (e.g. on loopback, the publisher configured with `tcp://127.0.0.1:5557`). The
replay socket is always the publisher's ROUTER on `replay_endpoint` (port + DP rank), keeping its
last `buffer_steps` batches. The subscriber
- numbers what it gets: a batch whose seq is past the next expected one is a gap, answered by
  the replay socket (a DEALER sends the 8-byte start seq; the publisher answers each buffered
  batch from it, then seq -1), applied in order before the batch that revealed it;
- on a gap it cannot fill (no replay socket, the buffer no longer reaches back, a malformed
  batch dropped) calls `on_lost(reason)`: the engine's index is then stale until `on_reset`;
- a seq that goes back to 0 is a restarted publisher (a new engine, an empty cache): `on_reset`;
- joining late (the first batch seen is not seq 0) asks the replay socket for everything from 0;
- a batch lost at the end of a burst shows no gap until the next one arrives, so after
  `idle_probe_s` without traffic the subscriber asks the replay socket for anything past its last
  seq (an idle publisher answers with the end marker alone);
- reconnects are ZMQ's own (TCP reconnects with backoff); a ZMQ monitor reports connect and
  disconnect in `stats().connected`. A publisher that restarted may lose its first batches to
  the reconnection, and the first one seen can then carry exactly the next expected seq: so
  after a disconnect the subscriber asks the replay socket for the last batch it applied, and
  unless the answer is that very batch (its seq and timestamp) the publisher is a new one:
  `on_reset`, and its batches are taken from 0 (without a replay socket a reconnect is a reset);
- memory is bounded: the socket's receive high-water mark (`hwm` batches; past it ZMQ drops, which
  shows as a gap), and a replay is applied as it streams in, never held.
`on_batch` runs on the subscriber's thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import ConfigError
from .events import EventBatch, MalformedEventError
from .vllm_events import END_SEQ, decode_frames, decode_seq


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's rule: a tcp endpoint's port + DP rank (port 0 kept); inproc gets `_dp<rank>`."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ConfigError("endpoint", f"{endpoint!r} is not a ZMQ endpoint", "use tcp://host:port")
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError("endpoint", f"{endpoint!r} has no port", "use tcp://host:port")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriberStats:
    replica: str
    rank: int
    endpoint: str
    replay_endpoint: str | None
    connected: bool
    last_seq: int | None             # the last batch applied
    batches: int                     # applied, live and replayed
    events: int
    gaps: int                        # seq jumps seen
    replays: int                     # replay requests sent
    replayed_batches: int
    lost_batches: int                # batches known missed (not replayable)
    malformed: int
    resets: int                      # publisher restarts seen
    last_event_time: float | None    # unix time the last batch arrived
    last_batch_ts: float | None      # the engine's own time of that batch
    stale_reason: str | None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class Subscriber:
    """`Subscriber(endpoint, replay_endpoint=..., on_batch=...)`; `start()`, `stop()`, `stats()`."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 on_batch: Callable[[EventBatch], None], replica: str = "", dp_rank: int = 0, topic: str = "",
                 on_lost: Callable[[str], None] | None = None, on_reset: Callable[[], None] | None = None,
                 hwm: int = 100_000, replay_timeout_s: float = 5.0, poll_interval_s: float = 0.05,
                 stale_after_s: float | None = None, idle_probe_s: float | None = 1.0, bind: bool = False,
                 context: zmq.Context | None = None) -> None:
        if not callable(on_batch):
            raise ConfigError("on_batch", "is not callable", "pass a function taking an EventBatch")
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ConfigError("dp_rank", f"{dp_rank!r} is not a rank", "use 0, 1, ...")
        self.replica, self.rank = replica, dp_rank
        self.endpoint = rank_endpoint(endpoint, dp_rank)
        self.replay_endpoint = rank_endpoint(replay_endpoint, dp_rank) if replay_endpoint else None
        self.topic = topic.encode()
        self.on_batch, self.on_lost, self.on_reset = on_batch, on_lost, on_reset
        self.hwm, self.replay_timeout_s, self.poll_interval_s = hwm, replay_timeout_s, poll_interval_s
        self.stale_after_s = stale_after_s
        self.idle_probe_s = idle_probe_s if replay_endpoint else None
        self.bind = bind
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connected = False
        self._rejoined = False   # disconnected since the last batch: the publisher may be a new one
        self._last_seq: int | None = None
        self._counts = dict(batches=0, events=0, gaps=0, replays=0, replayed_batches=0, lost_batches=0,
                            malformed=0, resets=0)
        self._last_event_time: float | None = None
        self._last_batch_ts: float | None = None
        self._stale: str | None = None

    # ---- life ------------------------------------------------------------------------------------

    def start(self) -> "Subscriber":
        if self._thread is not None:
            raise ConfigError("start", "the subscriber is already running", "call stop() first")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"kvatlas-sub-{self.replica}-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> SubscriberStats:
        with self._lock:
            stale = self._stale
            if stale is None and self.stale_after_s is not None and self._last_event_time is not None \
                    and time.time() - self._last_event_time > self.stale_after_s:
                stale = f"silent for more than {self.stale_after_s:g} s"
            return SubscriberStats(replica=self.replica, rank=self.rank, endpoint=self.endpoint,
                                   replay_endpoint=self.replay_endpoint, connected=self._connected,
                                   last_seq=self._last_seq, last_event_time=self._last_event_time,
                                   last_batch_ts=self._last_batch_ts, stale_reason=stale, **self._counts)

    # ---- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.bind(self.endpoint) if self.bind else sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sub.close(0)
            monitor.close(0)
            self._lost(f"cannot {'bind' if self.bind else 'connect'} {self.endpoint}: {exc}")
            return
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        timeout_ms = max(1, int(self.poll_interval_s * 1000))
        quiet_since = time.monotonic()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout_ms))
                if monitor in ready:
                    self._monitor(monitor)
                if sub in ready:
                    quiet_since = time.monotonic()
                    while not self._stop.is_set():
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(frames)
                elif self.idle_probe_s is not None and time.monotonic() - quiet_since > self.idle_probe_s:
                    self._probe()
                    quiet_since = time.monotonic()
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    def _monitor(self, monitor) -> None:
        while True:
            try:
                msg = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                self._connected = msg["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED)
                if msg["event"] == zmq.EVENT_DISCONNECTED:
                    self._rejoined = True

    def _receive(self, frames) -> None:
        try:
            seq = decode_seq(frames[1]) if len(frames) == 3 else None
            batch = decode_frames(frames)
        except MalformedEventError as exc:
            with self._lock:
                self._counts["malformed"] += 1
                if seq is not None and (self._last_seq is None or seq > self._last_seq):
                    self._last_seq = seq
            self._lost(f"malformed batch dropped ({exc})")
            return
        self._check_rejoined()
        expected = 0 if self._last_seq is None else self._last_seq + 1
        # A publisher that restarted counts from 0 again. Its first batch may be lost (published
        # before this socket reconnected), so a later one going back is a restart too when it is
        # newer than the last batch applied: a duplicate (a replay overlapping live traffic) is a
        # copy of a batch already applied, never newer than it.
        if self._last_seq is not None and (
                batch.seq == 0 and self._last_seq > 0 or batch.seq < expected and self._last_batch_ts is not None
                and batch.ts > self._last_batch_ts):
            self._reset()
            expected = 0
        if batch.seq < expected:
            return                                   # a duplicate (a replay overlapping live traffic)
        if batch.seq > expected:
            with self._lock:
                self._counts["gaps"] += 1
            self._replay(expected, batch.seq)
        self._apply(batch)

    def _reset(self) -> None:
        """A new publisher: what the index holds of this engine is gone with the old one."""
        with self._lock:
            self._counts["resets"] += 1
            self._stale, self._last_seq = None, None
        if self.on_reset is not None:
            self.on_reset()

    def _check_rejoined(self) -> None:
        """After a disconnect (module doc): the same publisher still holds the last batch applied,
        with its timestamp; anything else is a new publisher."""
        with self._lock:
            rejoined, self._rejoined = self._rejoined, False
        if not rejoined or self._last_seq is None:
            return
        same = False
        if self.replay_endpoint is not None:
            for got in self._replayed(self._last_seq):
                same = got.seq == self._last_seq and got.ts == self._last_batch_ts
                break
        if not same:
            self._reset()

    def _apply(self, batch: EventBatch, replayed: bool = False) -> None:
        """Count the batch, then hand it to on_batch: whoever sees what it changed (another
        thread reading the index) finds it in stats() too. One that on_batch finds malformed, or
        that raises, is taken back out of the counts."""
        with self._lock:
            before = (self._last_seq, self._last_event_time, self._last_batch_ts)
            self._count(batch, replayed, 1)
            self._last_seq = batch.seq
            self._last_event_time = time.time()
            self._last_batch_ts = batch.ts
        try:
            self.on_batch(batch)
        except MalformedEventError as exc:      # token ids decoded only when applied: dropped whole
            with self._lock:
                self._count(batch, replayed, -1)
                self._counts["malformed"] += 1
                self._last_event_time, self._last_batch_ts = before[1:]   # (its seq stays the last seen)
            self._lost(f"malformed batch dropped ({exc})")
        except BaseException:
            with self._lock:
                self._count(batch, replayed, -1)
                self._last_seq, self._last_event_time, self._last_batch_ts = before
            raise

    def _count(self, batch: EventBatch, replayed: bool, sign: int) -> None:
        self._counts["batches"] += sign
        self._counts["events"] += sign * len(batch.events)
        if replayed:
            self._counts["replayed_batches"] += sign

    def _replay(self, start: int, stop: int) -> None:
        """Apply batches [start, stop) from the replay socket; what it cannot give is lost."""
        got_to = start
        if self.replay_endpoint is not None:
            with self._lock:
                self._counts["replays"] += 1
            got_to = self._ask_replay(start, stop)
        if got_to < stop:
            with self._lock:
                self._counts["lost_batches"] += stop - got_to
            self._lost(f"batches {got_to}..{stop - 1} missed and not replayable")

    def _probe(self) -> None:
        """Ask the replay socket for anything past the last batch seen (nothing, usually)."""
        self._check_rejoined()   # (a restarted publisher whose batches were all lost, then quiet)
        start = 0 if self._last_seq is None else self._last_seq + 1
        self._ask_replay(start, None, found=self._probe_found)

    def _probe_found(self) -> None:
        """A probe found batches past the last one seen: a gap, counted before the first of them
        is applied (as a gap live traffic reveals is)."""
        with self._lock:
            self._counts["gaps"] += 1
            self._counts["replays"] += 1

    def _ask_replay(self, start: int, stop: int | None, found=None) -> int:
        next_seq = start
        for batch in self._replayed(start):
            if batch.seq != next_seq or (stop is not None and batch.seq >= stop):
                if batch.seq < next_seq:
                    continue
                break                            # the buffer no longer reaches back, or done
            if found is not None and next_seq == start:
                found()
            self._apply(batch, replayed=True)
            next_seq += 1
        return next_seq

    def _replayed(self, start: int):
        """The batches the replay socket answers from `start`, as they come, until its end marker,
        a malformed one or `replay_timeout_s`."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while time.monotonic() < deadline and not self._stop.is_set():
                if not dealer.poll(50):
                    continue
                frames = dealer.recv_multipart()
                if len(frames) == 4 and decode_seq(frames[2]) == END_SEQ:
                    return
                try:
                    batch = decode_frames(frames)
                except MalformedEventError:
                    with self._lock:
                        self._counts["malformed"] += 1
                    return
                yield batch
        finally:
            dealer.close(0)

    def _lost(self, reason: str) -> None:
        with self._lock:
            self._stale = reason
        if self.on_lost is not None:
            self.on_lost(reason)
