"""Prefixes in flight: prompts this router sent to a replica that the replica has not finished yet,
and what a later request could resume from there once they are computed.

The index (`index.py`) knows what a replica holds *now*, from its events. A prompt routed a moment
ago is not there yet: it waits in the replica's queue or is being prefilled, and under vLLM's
DeepSeek-V4 rule its prefix becomes resumable only once it has been computed to its end — the
sliding groups' tails (SWA, compressor states) are kept where a prompt's computation ends, so the
boundary a follower can resume from is the prompt's end rounded down to the full group's block
(256 tokens), not any 256-aligned point of a shared prefix. A request that extends a prompt in
flight on a replica (a session's next turn, the same document with a new question) resumes there
from that boundary if the replica computes the writer first.

So, per replica, the digest (`digest.py`: the same digest the index places blocks by) of each
in-flight prompt's aligned end. For a new prompt, `expected` walks its boundary digests once and
gives, per replica, the largest in-flight end it extends (at most n − 1 tokens, as vLLM caps a hit).
The policy counts what that adds beyond the exact resident prefix, weighted (`Weights.in_flight_prefix`:
it is an expectation — a follower admitted in the same engine step as the writer's last chunk gets
less).

An entry goes when the request completes (`finish`), when the index shows the prefix resident on
that replica (`stored`: from then on the index says it exactly), after `ttl_s` (a request whose end
the router never saw), or, oldest first, beyond `max_entries`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from ..errors import ConfigError
from .index import PromptKeys


@dataclass(frozen=True, slots=True)
class _Entry:
    replica: str
    end_key: int          # the digest of the prompt's prefix [0, end_tokens)
    end_tokens: int       # the prompt's end rounded down to the full group's block
    sent_s: float


class InFlightPrefixes:
    """Per replica, the aligned ends of the prompts routed there and not finished. Not thread-safe:
    one router's request path (one event loop, or one harness thread) owns it."""

    def __init__(self, align_tokens: int, *, ttl_s: float = 600.0, max_entries: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(align_tokens, int) or align_tokens < 1:
            raise ConfigError("align_tokens", f"{align_tokens!r}", "the model's hit alignment, e.g. 256")
        if not ttl_s > 0:
            raise ConfigError("ttl_s", f"{ttl_s!r} is not a positive number of seconds", "use e.g. 600")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError("max_entries", f"{max_entries!r}", "use a positive count, e.g. 65536")
        self.align_tokens, self.ttl_s, self.max_entries, self.clock = align_tokens, ttl_s, max_entries, clock
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()      # request → entry, oldest first
        self._by_end: dict[int, dict[str, set]] = {}                       # end digest → replica → requests
        self.counters = {"added": 0, "finished": 0, "stored": 0, "expired": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, replica: str, request: Hashable, prompt: PromptKeys) -> bool:
        """Record `request`, routed to `replica`; False when its prompt has no whole block (nothing a
        follower could resume). A request id already in flight is moved to `replica`."""
        self.expire()
        if request in self._entries:
            self._drop(request)
        blocks = min(len(prompt.keys), prompt.prompt_tokens // self.align_tokens)
        if prompt.block_tokens != self.align_tokens or blocks == 0:
            return False
        entry = _Entry(replica, int(prompt.keys[blocks - 1]), blocks * self.align_tokens, self.clock())
        self._entries[request] = entry
        self._by_end.setdefault(entry.end_key, {}).setdefault(replica, set()).add(request)
        self.counters["added"] += 1
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
            self.counters["evicted"] += 1
        return True

    def finish(self, request: Hashable) -> bool:
        """The request completed (or failed): its prompt is no longer in flight."""
        if request not in self._entries:
            return False
        self._drop(request)
        self.counters["finished"] += 1
        return True

    def stored(self, replica: str, end_key: int) -> int:
        """The index shows the prefix ending at `end_key` resident on `replica`: drop its entries
        there (the index says it exactly from now on); how many went."""
        self.expire()
        requests = self._by_end.get(end_key, {}).get(replica)
        if not requests:
            return 0
        gone = list(requests)
        for r in gone:
            self._drop(r)
        self.counters["stored"] += len(gone)
        return len(gone)

    def expire(self) -> int:
        """Drop entries older than `ttl_s`; how many."""
        if not self._entries:
            return 0
        cutoff = self.clock() - self.ttl_s
        n = 0
        while self._entries:
            request, entry = next(iter(self._entries.items()))
            if entry.sent_s > cutoff:
                break
            self._drop(request)
            n += 1
        self.counters["expired"] += n
        return n

    def _drop(self, request: Hashable) -> None:
        entry = self._entries.pop(request)
        replicas = self._by_end[entry.end_key]
        requests = replicas[entry.replica]
        requests.discard(request)
        if not requests:
            del replicas[entry.replica]
            if not replicas:
                del self._by_end[entry.end_key]

    def expected(self, prompt: PromptKeys, replicas: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
        """{replica: (tokens, end digest)}: the largest in-flight prompt end on each replica that
        `prompt` extends, at most prompt_tokens − 1; replicas with none are left out."""
        self.expire()
        if not self._by_end or prompt.block_tokens != self.align_tokens:
            return {}
        wanted = None if replicas is None else set(replicas)
        cap = min(len(prompt.keys), max(prompt.prompt_tokens - 1, 0) // self.align_tokens)
        out: dict[str, tuple[int, int]] = {}
        by_end, keys = self._by_end, prompt.keys
        for b in range(cap, 0, -1):
            found = by_end.get(keys[b - 1])
            if found is None:
                continue
            for replica in found:
                if replica not in out and (wanted is None or replica in wanted):
                    out[replica] = (b * self.align_tokens, int(keys[b - 1]))
        return out

    def state(self) -> dict:
        """JSON-able: entries per replica and the counters."""
        per: dict[str, int] = {}
        for e in self._entries.values():
            per[e.replica] = per.get(e.replica, 0) + 1
        return {"entries": len(self._entries), "by_replica": dict(sorted(per.items())), "ttl_s": self.ttl_s,
                **self.counters}

    def check(self) -> None:
        """Integrity: the by-end map holds exactly the entries (tests)."""
        seen = set()
        for key, replicas in self._by_end.items():
            for replica, requests in replicas.items():
                assert requests, (key, replica)
                for r in requests:
                    e = self._entries[r]
                    assert (e.end_key, e.replica) == (key, replica), (r, e, key, replica)
                    assert r not in seen
                    seen.add(r)
        assert seen == set(self._entries)
        times = [e.sent_s for e in self._entries.values()]
        assert times == sorted(times)
