"""What `kvatlas route` asks for each request: the replicas best first, from part 1's index, fleet
of subscribers and policy (`index.py`, `fleet.py`, `policy.py`), with what a live router adds:

- replicas taken out (routing.replicas) go last, in the policy's order: they are the last resort;
- a rank's events are **stale** — its replica scored from load alone — when the fleet says its
  events were lost (a gap nothing could replay, a malformed batch), when they arrive more than
  `stale_after_s` late (lag: the batch's arrival time minus the engine's own time stamp), or when
  the replica answered a request that must have stored a new block (DeepSeek-V4 publishes one for
  every 256 new prompt tokens) more than `stale_after_s` ago and no event has arrived since — which
  is also how a replica whose events never arrive is caught. Silence alone is not staleness: an idle
  replica publishes nothing. The flag the router sets on the index is cleared when the events come
  back, and never one the fleet set;
- ties (no replica holds any of a prompt, equal loads) go round the replicas in turn;
- the DP rank: a request goes to the rank whose cache holds the most of it (vLLM's
  `X-data-parallel-rank`); with no hit anywhere vLLM's own balancing picks the rank;
- per replica, the first answer that must have published with no event seen since, for the rule above;
- the prefixes in flight (kvatlas's policy, `inflight.py`): the router tells the policy each prompt
  it sends (`sent`) and each request that ends, answered or failed (`done`);
- holding a follower (`hold`, `kvatlas route --hold-s`): a request whose chosen replica is computing
  a prompt it shares more of than is resident there waits, before it is sent, until the index shows
  that prefix resident (the writer computed it and published), the writer ends, or `hold_s` passes —
  then the prediction made as it is sent is what the engine reports, and the engine computes the
  shared prefix once instead of twice. Held requests count as in flight for routing (a later
  follower goes to the same replica) but not as writers (they have computed nothing).

Everything here runs on the router's event loop; the subscribers run on their own threads and the
index locks per engine, so nothing on the request path waits on the network.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from .fleet import Fleet
from .index import PrefixIndex, PromptKeys
from .policy import ReplicaLoad, make_policy

ROUTER_STALE = "router: "          # the prefix of every stale reason the router sets itself
CONFIRM_SLACK_S = 1.0              # an event this long before an answer confirms it (publish, then answer)
REFRESH_EVERY_S = 0.05             # the request path re-reads the stale flags at most this often (they move in seconds)
HOLD_POLL_S = 0.005                # a held request looks again this often (predicting only once its replica's events moved)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    replica: str
    dp_rank: int | None             # the rank to pin to (None: let the replica choose)
    reason: str                     # prefix, load, policy
    predicted_tokens: int | None    # what the router counts as resumable there now (None: nothing predicted)
    cost: float
    in_flight_tokens: int = 0       # beyond that, what prefixes in flight there add once computed


class Chooser:
    def __init__(self, model, specs, policy: str, *, stale_after_s: float = 10.0, index: PrefixIndex | None = None,
                 weights=None) -> None:
        self.specs = {s.name: s for s in specs}
        self.index = index if index is not None else PrefixIndex(model)
        self.align_tokens = self.index.rule.align_tokens
        self.policy = make_policy(policy, index=self.index, weights=weights)
        self.policy_name = policy
        self.stale_after_s = stale_after_s
        self.fleet = Fleet(self.index)
        for s in specs:
            if s.ranks[0].events_endpoint is not None:
                self.fleet.add(s.name, s.ranks[0].events_endpoint, replay_endpoint=s.ranks[0].replay_endpoint,
                               dp_size=s.dp_size, bind=s.bind)
        self.subs = {(sub.replica, sub.rank): sub for sub in self.fleet.subscribers()}
        # (replica, rank) → the first answer that must have published, with no event seen since
        self.unconfirmed_s: dict[tuple[str, int], float] = {}
        self._turn = itertools.count()
        self._refreshed_s = float("-inf")
        self._sent = itertools.count()
        self.held: set[int] = set()          # handles of the requests held now
        self.held_total = 0
        self._finished = 0                   # requests done: a writer ending is news to a held request

    async def start(self) -> None:
        self.fleet.start()

    async def stop(self) -> None:
        self.fleet.stop()

    # --- staleness -------------------------------------------------------------------------------
    def _subscriber_stats(self) -> dict:
        return {(s.replica, s.rank): s.stats() for s in self.fleet.subscribers()}

    def _router_reason(self, key, st, now_s: float) -> str | None:
        if st.last_event_time is not None and st.last_batch_ts is not None:
            lag = st.last_event_time - st.last_batch_ts
            if lag > self.stale_after_s:
                return f"{ROUTER_STALE}events arrive {lag:.1f} s late (more than --stale-after-s {self.stale_after_s:g})"
        waiting = self.unconfirmed_s.get(key)
        if waiting is not None and st.last_event_time is not None and st.last_event_time >= waiting - CONFIRM_SLACK_S:
            del self.unconfirmed_s[key]
            waiting = None
        if waiting is not None and now_s - waiting > self.stale_after_s:
            return (f"{ROUTER_STALE}no events since it answered a request that stored new blocks "
                    f"{now_s - waiting:.1f} s ago" + ("" if st.connected else "; not connected to its publisher"))
        return None

    def refresh_stale(self) -> dict:
        """Set or clear the router's own stale flags on the index; {(replica, rank): stats}."""
        now = time.time()
        stats = self._subscriber_stats()
        states = self.index.state()["engines"]
        for key, st in stats.items():
            reason = self._router_reason(key, st, now)
            current = states.get(key[0], {}).get(str(key[1]), {}).get("stale_reason")
            if reason is not None and (current is None or current.startswith(ROUTER_STALE)):
                self.index.mark_stale(key[0], key[1], reason)
            elif reason is None and current is not None and current.startswith(ROUTER_STALE):
                self.index.mark_stale(key[0], key[1], None)
        return stats

    def answered(self, replica: str, dp_rank: int | None, prompt_tokens: int, cached_tokens: int) -> None:
        """An answer's usage: when its prompt had a full block beyond the cached prefix, the engine
        stored (and published) it; no event within `stale_after_s` after that is staleness. (An
        event that arrived just before the answer confirms it: the engine publishes, then answers.)"""
        if (prompt_tokens // self.align_tokens) * self.align_tokens <= cached_tokens:
            return
        if dp_rank is None and self.specs[replica].dp_size > 1:
            return                    # vLLM chose the rank: which stream must show it is unknown
        key = (replica, dp_rank or 0)
        sub = self.subs.get(key)
        if sub is None:
            return
        now = time.time()
        last = sub.stats().last_event_time
        if last is None or last < now - CONFIRM_SLACK_S:
            self.unconfirmed_s.setdefault(key, now)

    # --- prefixes in flight ------------------------------------------------------------------------
    def prompt(self, token_ids):
        """What `rank` and `sent` take: the prompt's digests when the policy keeps prefixes in
        flight (computed once), else the token ids."""
        keys = self.policy.keys(token_ids)
        return token_ids if keys is None else keys

    def sent(self, replica: str, prompt) -> int:
        """A request with this prompt (`prompt(...)`) goes to `replica`; the handle for `done`."""
        handle = next(self._sent)
        self.policy.routed(replica, handle, prompt)
        return handle

    def done(self, handle: int) -> None:
        """That request ended (answered, failed, or the client went away)."""
        self.policy.finished(handle)
        self._finished += 1

    # --- holding a follower for its writer --------------------------------------------------------
    def waits(self, replica: str, prompt, handle: int) -> bool:
        """Whether a request sent (and not held) to `replica` shares more of `prompt` than the index
        shows resident there. A stale replica is never waited on: its progress cannot be seen."""
        in_flight = self.policy.in_flight
        if in_flight is None or not isinstance(prompt, PromptKeys):
            return False
        pending = in_flight.expected(prompt, [replica], exclude=self.held | {handle}).get(replica)
        if pending is None:
            return False
        p = self.index.predict(prompt, [replica]).get(replica)
        return p is not None and not p.stale and pending[0] > p.device_tokens

    async def hold(self, replica: str, prompt, handle: int, hold_s: float) -> float:
        """Wait while `waits` (at most `hold_s`); the seconds waited (0: sent at once)."""
        if hold_s <= 0 or not self.waits(replica, prompt, handle):
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.held.add(handle)
        self.held_total += 1
        try:
            seen = None
            while loop.time() - t0 < hold_s:
                await asyncio.sleep(HOLD_POLL_S)
                now = (self.index.version(replica), self._finished, len(self.held))
                if now != seen:
                    seen = now
                    if not self.waits(replica, prompt, handle):
                        break
        finally:
            self.held.discard(handle)
        return loop.time() - t0

    def refreshed(self, cand: Candidate, prompt, handle: int) -> Candidate:
        """`cand` predicted again as it is sent (after a hold)."""
        p = self.index.predict(prompt, [cand.replica]).get(cand.replica)
        if p is None or p.stale:
            return cand
        pending = (self.policy.in_flight.expected(prompt, [cand.replica], exclude=self.held | {handle})
                   .get(cand.replica, (0, 0))[0] if self.policy.in_flight is not None else 0)
        pin = p.rank if p.device_tokens > 0 else None
        if self.specs[cand.replica].dp_size == 1:
            pin = 0 if pin is not None else None
        return dataclasses.replace(cand, predicted_tokens=p.device_tokens, dp_rank=pin,
                                   in_flight_tokens=max(0, pending - p.device_tokens))

    # --- ranking ---------------------------------------------------------------------------------
    def rank(self, token_ids, states, *, advance: bool = True) -> list[Candidate]:
        """The replicas best first. `advance=False` (POST /score) answers as the next request would be
        routed without taking its turn: ties and round_robin still go round for the requests."""
        if not advance:
            self._turn, turn = _peeked(self._turn)
            self.policy._turn, policy_turn = _peeked(self.policy._turn)
            try:
                return self.rank(token_ids, states)
            finally:
                self._turn, self.policy._turn = turn, policy_turn
        now = time.monotonic()
        if now - self._refreshed_s >= REFRESH_EVERY_S:   # a third of a request's routing time when done every time
            self._refreshed_s = now
            self.refresh_stale()
        # the policy breaks ties by the order of `loads`: rotated per request, so equal replicas share
        # the work in turn instead of the first listed taking every request nobody holds (round_robin
        # turns on its own: rotating its input too would step two replicas a request)
        k = 0 if self.policy_name == "round_robin" else next(self._turn) % len(states)
        loads = {s.spec.name: ReplicaLoad(in_flight=s.in_flight, running=s.running or 0, waiting=s.waiting or 0)
                 for s in list(states[k:]) + list(states[:k])}
        choices = self.policy.choose(token_ids, loads)
        up = {s.spec.name: s.up for s in states}
        out = []
        for c in sorted(choices, key=lambda c: not up[c.replica]):       # stable: the policy's order within
            p = c.prediction
            predicted = None if p is None or p.stale else p.device_tokens
            if self.policy_name in ("round_robin", "least_loaded"):
                reason = "policy"
            else:
                reason = "prefix" if c.predicted_tokens > 0 or c.in_flight_tokens > 0 else "load"
            pin = p.rank if p is not None and not p.stale and p.device_tokens > 0 else None
            if self.specs[c.replica].dp_size == 1:
                pin = 0 if pin is not None else None
            out.append(Candidate(replica=c.replica, dp_rank=pin, reason=reason, predicted_tokens=predicted,
                                 cost=c.cost, in_flight_tokens=c.in_flight_tokens))
        self._last_choices = choices
        return out

    def score(self, token_ids, states) -> dict:
        cands = self.rank(token_ids, states, advance=False)
        by_name = {c.replica: c for c in self._last_choices}
        st = {s.spec.name: s for s in states}
        rows = []
        for c in cands:
            p = by_name[c.replica].prediction
            s = st[c.replica]
            device = p.device_tokens if p is not None and not p.stale else 0
            rows.append({"replica": c.replica, "dp_rank": p.rank if p is not None else None, "up": s.up,
                         "stale": p is None or p.stale,
                         "device_tokens": p.device_tokens if p else 0,
                         "in_flight_tokens": c.in_flight_tokens, "expected_tokens": device + c.in_flight_tokens,
                         "cpu_tokens": p.cpu_tokens if p else 0,
                         "storage_tokens": p.storage_tokens if p else 0,
                         "recompute_tokens": p.recompute_tokens if p else len(token_ids),
                         "main_group_tokens": p.main_group_tokens if p else 0,
                         "load": {"in_flight": s.in_flight, "running": s.running, "waiting": s.waiting},
                         "cost": c.cost})
        first = cands[0]
        return {"prompt_tokens": len(token_ids), "policy": self.policy_name,
                "choice": {"replica": first.replica, "dp_rank": first.dp_rank, "reason": first.reason},
                "candidates": rows}

    # --- /state and /metrics ---------------------------------------------------------------------
    def event_stats(self) -> list[dict]:
        out = []
        stats = self.refresh_stale()
        engines = self.index.state()["engines"]
        for (replica, rank), st in sorted(stats.items()):
            reason = engines.get(replica, {}).get(str(rank), {}).get("stale_reason") or st.stale_reason
            out.append({"replica": replica, "dp_rank": rank, "lag_s": _lag(st), "batches": st.batches,
                        "gaps": st.gaps, "replays": st.replays, "malformed": st.malformed, "stale": reason is not None,
                        "stale_reason": reason, "resets": st.resets, "lost_batches": st.lost_batches,
                        "last_seq": st.last_seq, "connected": st.connected})
        return out

    def rank_state(self) -> dict:
        """{(replica, rank): {"events": …, "index": …}} for /state."""
        engines = self.index.state()["engines"]
        out = {}
        for e in self.event_stats():
            idx = engines.get(e["replica"], {}).get(str(e["dp_rank"]), {})
            out[(e["replica"], e["dp_rank"])] = {"events": {k: v for k, v in e.items() if k not in ("replica", "dp_rank")},
                                                 "index": idx}
        return out

    def state(self) -> dict:
        return {"rule": self.index.rule.to_dict()}


def _peeked(counter: itertools.count) -> tuple[itertools.count, itertools.count]:
    """Two counters at `counter`'s next value: one to use, one to put back."""
    n = next(counter)
    return itertools.count(n), itertools.count(n)


def _lag(st) -> float | None:
    if st.last_event_time is None or st.last_batch_ts is None:
        return None
    return max(0.0, st.last_event_time - st.last_batch_ts)
