"""Prefixes in flight: prompts this router sent to a replica that the replica has not finished yet,
and what a later request could resume from there once they are computed.

The index (`index.py`) knows what a replica holds *now*, from its events. A prompt routed a moment
ago is not there yet: it waits in the replica's queue or is being prefilled. A follower that shares
whole blocks with it can resume there once the replica has computed them: from the prompt's end
rounded down to 256 tokens (vLLM keeps DeepSeek-V4's sliding tails where a computation ends), and
often from the boundary where it forks from the prompt. Measured on vLLM 0.34's engine cores over
the Mooncake trace (bench/routing_cluster.py, 200 requests, 2 replicas): all 15 requests the router
then predicted nothing for and that resumed from a prefix resumed at the boundary where they forked
from a prompt in flight on their replica, none at that prompt's end. It is not certain: a fork
point only one prompt has been computed through may hold no tails
(tests/vllm_plugin/test_routing_replica.py).

So, per replica, the digest (`digest.py`: the same digest the index places blocks by) of every
whole-block boundary of each in-flight prompt. For a new prompt, `expected` walks its boundary
digests once, deepest first, and gives per replica the deepest boundary it shares with a prompt in
flight there (at most n − 1 tokens, as vLLM caps a hit). The policy counts what that adds beyond
the exact resident prefix, weighted (`Weights.in_flight_prefix`): an expectation. A router that
holds the follower until the index shows that boundary resident, or the writer ends (`kvatlas
route --hold-s`, `Chooser.hold`), sends it when its prediction is exact; `exclude` leaves out the
requests held (they have computed nothing) and the prompt's own entry.

An entry goes when the request completes (`finish`), when the index shows its end resident on that
replica (`stored`: from then on the index says it exactly), after `ttl_s` (a request whose end the
router never saw), or, oldest first, beyond `max_entries` requests or `max_keys` boundaries in all (a
bound on memory whatever the prompts' lengths: about 0.3 KB a boundary).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Container, Hashable, Iterable

from ..errors import ConfigError
from .index import PromptKeys


@dataclass(frozen=True, slots=True)
class _Entry:
    replica: str
    end_key: int          # the digest of the prompt's prefix [0, end_tokens)
    end_tokens: int       # the prompt's end rounded down to the full group's block
    sent_s: float
    keys: tuple           # the digest at each whole-block boundary, the last one end_key


class InFlightPrefixes:
    """Per replica, the aligned ends of the prompts routed there and not finished. Not thread-safe:
    one router's request path (one event loop, or one harness thread) owns it."""

    def __init__(self, align_tokens: int, *, ttl_s: float = 600.0, max_entries: int = 65536,
                 max_keys: int = 1 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(align_tokens, int) or align_tokens < 1:
            raise ConfigError("align_tokens", f"{align_tokens!r}", "the model's hit alignment, e.g. 256")
        if not ttl_s > 0:
            raise ConfigError("ttl_s", f"{ttl_s!r} is not a positive number of seconds", "use e.g. 600")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError("max_entries", f"{max_entries!r}", "use a positive count, e.g. 65536")
        if not isinstance(max_keys, int) or max_keys < 1:
            raise ConfigError("max_keys", f"{max_keys!r}", "use a positive count, e.g. 1048576")
        self.align_tokens, self.ttl_s, self.max_entries, self.clock = align_tokens, ttl_s, max_entries, clock
        self.max_keys = max_keys
        self._keys_total = 0
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()      # request → entry, oldest first
        self._by_end: dict[int, dict[str, set]] = {}                       # end digest → replica → requests
        self._by_key: dict[int, dict[str, set]] = {}                       # any boundary's digest → the same
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
        keys = tuple(prompt.keys[:blocks]) if isinstance(prompt.keys, list) else tuple(prompt.keys[:blocks].tolist())
        entry = _Entry(replica, keys[-1], blocks * self.align_tokens, self.clock(), keys)
        self._entries[request] = entry
        self._by_end.setdefault(entry.end_key, {}).setdefault(replica, set()).add(request)
        by_key = self._by_key
        for k in keys:
            found = by_key.get(k)
            if found is None:
                by_key[k] = {replica: {request}}
            else:
                found.setdefault(replica, set()).add(request)
        self._keys_total += len(keys)
        self.counters["added"] += 1
        while len(self._entries) > self.max_entries or (self._keys_total > self.max_keys and len(self._entries) > 1):
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
        self._keys_total -= len(entry.keys)
        _unlist(self._by_end, entry.end_key, entry.replica, request)
        for k in entry.keys:
            _unlist(self._by_key, k, entry.replica, request)

    def expected(self, prompt: PromptKeys, replicas: Iterable[str] | None = None,
                 exclude: Container = ()) -> dict[str, tuple[int, int]]:
        """{replica: (tokens, digest there)}: per replica, the deepest whole-block boundary `prompt`
        shares with a prompt in flight there, at most prompt_tokens − 1; replicas with none are left
        out. `exclude`: requests whose prompts do not count (the prompt's own while it is in flight,
        requests a router holds)."""
        self.expire()
        if not self._by_end or prompt.block_tokens != self.align_tokens:
            return {}
        wanted = None if replicas is None else set(replicas)
        cap = min(len(prompt.keys), max(prompt.prompt_tokens - 1, 0) // self.align_tokens)
        out: dict[str, tuple[int, int]] = {}
        by_key, keys = self._by_key, prompt.keys
        for b in range(cap, 0, -1):
            found = by_key.get(keys[b - 1])
            if found is None:
                continue
            for replica, requests in found.items():
                if exclude and all(r in exclude for r in requests):
                    continue
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
        """Integrity: the by-end and by-boundary maps hold exactly the entries (tests)."""
        listed = {(k, e.replica, r) for r, e in self._entries.items() for k in e.keys}
        assert self._keys_total == sum(len(e.keys) for e in self._entries.values()) == len(listed)
        assert listed == {(k, rep, r) for k, reps in self._by_key.items() for rep, rs in reps.items() for r in rs}
        assert all(rs for reps in self._by_key.values() for rs in reps.values())
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


def _unlist(table: dict, key: int, replica: str, request: Hashable) -> None:
    replicas = table[key]
    requests = replicas[replica]
    requests.discard(request)
    if not requests:
        del replicas[replica]
        if not replicas:
            del table[key]
