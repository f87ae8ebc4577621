"""The index wired to its subscribers: one `Subscriber` per replica and DP rank feeding one
`PrefixIndex`. A lost batch marks the engine stale; a cleared cache (`AllBlocksCleared`) or a
restarted publisher makes the index exact again and unmarks it."""

from __future__ import annotations

import threading

from ..errors import ConfigError
from .events import AllBlocksCleared, EventBatch
from .index import PrefixIndex
from .subscriber import Subscriber


class Fleet:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._subs: dict[tuple[str, int], Subscriber] = {}
        self._lock = threading.Lock()

    def add(self, replica: str, endpoint: str, *, replay_endpoint: str | None = None, dp_size: int = 1,
            groups=(), **subscriber_options) -> list[Subscriber]:
        """Subscribe to every DP rank of `replica` (ports endpoint + rank); not started yet."""
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ConfigError("dp_size", f"{dp_size!r} is not a rank count", "use 1 or more")
        out = []
        with self._lock:
            for rank in range(dp_size):
                if (replica, rank) in self._subs:
                    raise ConfigError("replica", f"{replica!r} rank {rank} is already subscribed", "use another name")
                self.index.add_engine(replica, rank, groups)
                sub = Subscriber(endpoint, replay_endpoint=replay_endpoint, replica=replica, dp_rank=rank,
                                 on_batch=self._on_batch(replica, rank), on_lost=self._on_lost(replica, rank),
                                 on_reset=self._on_reset(replica, rank), **subscriber_options)
                self._subs[(replica, rank)] = sub
                out.append(sub)
        return out

    def _on_batch(self, replica: str, rank: int):
        def apply(batch: EventBatch) -> None:
            self.index.apply(replica, rank, batch)
            if any(isinstance(e, AllBlocksCleared) for e in batch.events):
                self.index.mark_stale(replica, rank, None)
        return apply

    def _on_lost(self, replica: str, rank: int):
        return lambda reason: self.index.mark_stale(replica, rank, reason)

    def _on_reset(self, replica: str, rank: int):
        def reset() -> None:
            self.index.clear(replica, rank)
            self.index.mark_stale(replica, rank, None)
        return reset

    def start(self) -> "Fleet":
        for sub in self._subs.values():
            if not sub.running:
                sub.start()
        return self

    def stop(self) -> None:
        for sub in self._subs.values():
            sub.stop()

    def remove(self, replica: str) -> None:
        with self._lock:
            for key in [k for k in self._subs if k[0] == replica]:
                self._subs.pop(key).stop()
                self.index.remove_engine(*key)

    def subscribers(self) -> list[Subscriber]:
        return list(self._subs.values())

    def state(self) -> dict:
        """index.state() plus each subscriber's stats, JSON-able (for a router's /state)."""
        out = self.index.state()
        out["subscribers"] = [s.stats().to_dict() for s in self._subs.values()]
        return out
