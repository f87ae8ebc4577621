"""Routing policies, by name, each `choose(token_ids, loads)` → candidates ranked best first.

- `kvatlas`: cost = tokens left to prefill under the exact rule (prompt − predicted resumable on the
  device, with CPU/STORAGE restores priced per token), less the expected resumable tokens of
  prefixes in flight there (prompts this router sent to the replica and it has not finished: once
  computed, a prompt that extends one resumes from its end; `inflight.py`), weighted by
  `Weights.in_flight_prefix`, less `Weights.fork_prefix` of the full group's resident prefix
  beyond those (a fork: resumable for later requests once a second prompt through it is computed
  there), plus the replica's load in tokens: requests in flight (sent by this
  router, not yet finished), running and waiting (as the replica reports them), each with its
  weight (`Weights`). A stale replica's prediction counts as nothing. The caller tells the policy
  what it sent and what finished (`routed`, `finished`); a policy never told sees no prefix in flight.
- `main_group_prefix`: the same cost with the full group's prefix alone as the prediction — what
  Dynamo's KV router, SGLang's model gateway and llm-d score for DeepSeek-V4.
- `round_robin`: in turn; `least_loaded`: the load term alone.
- `oracle`: kvatlas's objective with each engine's own KV cache manager's answer for the hit it
  would give now in place of the index's prediction (tests and benchmarks only: it needs a callable
  into the engines); the prefixes in flight are counted as kvatlas counts them.
Ties go to the replica listed first in `loads` (a stable order the caller controls).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..errors import ConfigError
from .index import Prediction, PrefixIndex, PromptKeys
from .inflight import InFlightPrefixes

POLICIES = ("kvatlas", "main_group_prefix", "round_robin", "least_loaded", "oracle")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaLoad:
    """What a replica is doing: `in_flight` counted by the router, the rest as the replica reports."""

    in_flight: int = 0
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Weights:
    """Cost weights, in prefill tokens: each token to compute costs `prefill_token`; restoring a
    token from CPU or STORAGE costs `cpu_token` / `storage_token`; each request ahead costs its
    weight: `in_flight` (sent by this router, not finished), `running` and `waiting` (as the replica
    reports them). `in_flight_prefix`: the share of a prefix in flight (a prompt this router sent to
    the replica, not finished, that the request extends) counted as resumable there beyond what is
    resident now: 0 ignores prefixes in flight, 1 counts them as if already computed (a follower
    admitted in the same engine step as its writer's last chunk resumes from less, so it is an
    expectation). `fork_prefix`: the share of the full group's resident prefix beyond that (a prefix
    the prompt shares with a prompt computed there and forks from before that prompt's end: nothing
    resumable now) counted as if resumable. It is worth something later, not now: vLLM keeps the
    sliding tails at the fork point once a second prompt through it has been computed there, so
    later requests sharing the prefix resume from it on that replica.

    The defaults are the choice of a sweep on vLLM's engine cores over a Mooncake slice
    (bench/routing_cluster.py; docs/routing.md and bench/RESULTS.md have the figures): load
    weights of 256/64/512 tokens a request (16 times lighter than before), `in_flight_prefix` 1
    and `fork_prefix` 0.5 hit the most there at N = 2, 4 and 8. At these weights load decides between
    replicas whose resumable prefixes differ by less than a few requests' worth (a few thousand
    tokens) and wherever nothing is resumable; a replica holding a prefix that many requests share
    takes them all. Raise the load weights where queueing costs more than prefill."""

    prefill_token: float = 1.0
    cpu_token: float = 0.1
    storage_token: float = 0.3
    in_flight_prefix: float = 1.0
    fork_prefix: float = 0.5
    in_flight: float = 256.0
    running: float = 64.0
    waiting: float = 512.0

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or value != value:
                raise ConfigError(f"weights.{name}", f"{value!r} is not a non-negative number", "use e.g. 1.0")

    def load(self, load: ReplicaLoad) -> float:
        return self.in_flight * load.in_flight + self.running * load.running + self.waiting * load.waiting


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    replica: str
    cost: float
    predicted_tokens: int            # the resumable prefix the policy assumed (0 when it assumes none)
    prediction: Prediction | None = None
    in_flight_tokens: int = 0        # beyond the resident prefix, what prefixes in flight there would add


@dataclass(slots=True, kw_only=True)
class Policy:
    """A named policy. `index` for the prediction-based ones, `oracle(replica, token_ids) -> hit
    tokens` for `oracle`. `in_flight` (kvatlas and oracle, made from the index when not given)
    holds the prefixes in flight the caller reports through `routed` and `finished`."""

    name: str
    index: PrefixIndex | None = None
    weights: Weights = field(default_factory=Weights)
    oracle: Callable[[str, Sequence[int]], int] | None = None
    in_flight: InFlightPrefixes | None = None
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError("policy", f"{self.name!r} is not a policy", f"use one of {', '.join(POLICIES)}")
        if self.name in ("kvatlas", "main_group_prefix") and self.index is None:
            raise ConfigError("index", f"policy {self.name} needs a PrefixIndex", "pass index=PrefixIndex(model)")
        if self.name == "oracle" and self.oracle is None:
            raise ConfigError("oracle", "policy oracle needs a callable into the engines", "tests and benchmarks only")
        if self.in_flight is None and self.index is not None and self.name in ("kvatlas", "oracle"):
            self.in_flight = InFlightPrefixes(self.index.rule.align_tokens)

    # --- what the caller tells the policy ----------------------------------------------------------
    def keys(self, prompt) -> PromptKeys | None:
        """The prompt's digests when this policy tracks prefixes in flight (compute once, pass to
        `choose` and `routed`), else None."""
        if isinstance(prompt, PromptKeys):
            return prompt
        return self.index.keys(prompt) if self.in_flight is not None else None

    def routed(self, replica: str, request, prompt) -> None:
        """`request` (any hashable id) was sent to `replica` with this prompt (token ids or `keys`)."""
        if self.in_flight is not None:
            self.in_flight.add(replica, request, self.keys(prompt))

    def finished(self, request) -> None:
        """`request` completed, failed or was given up: its prompt is no longer in flight."""
        if self.in_flight is not None:
            self.in_flight.finish(request)

    # --- ranking -------------------------------------------------------------------------------------
    def choose(self, token_ids, loads: Mapping[str, ReplicaLoad]) -> list[Choice]:
        """The replicas of `loads`, best first, with their costs. `token_ids` may be `keys(...)`
        (not for `oracle`, which passes the tokens to the engines)."""
        if not loads:
            raise ConfigError("loads", "no replica to route to", "register at least one replica")
        names = list(loads)
        if self.name == "round_robin":
            k = next(self._turn) % len(names)
            order = names[k:] + names[:k]
            return [Choice(replica=r, cost=float(i), predicted_tokens=0) for i, r in enumerate(order)]
        keys = token_ids if isinstance(token_ids, PromptKeys) else None
        n = keys.prompt_tokens if keys is not None else len(token_ids)
        w = self.weights
        out = []
        if self.name == "least_loaded":
            out = [Choice(replica=r, cost=w.load(loads[r]), predicted_tokens=0) for r in names]
        elif self.name == "oracle":
            if keys is not None:
                raise ConfigError("token_ids", "the oracle asks the engines with the prompt's tokens",
                                  "pass the token ids, not keys")
            keys = self.keys(token_ids)
            pending = self._pending(keys, names)
            # the full group's prefix (for the fork term) from the index, when there is one
            preds = self.index.predict(keys, names) if keys is not None and w.fork_prefix else {}
            for r in names:
                hit = self.oracle(r, token_ids)
                extra = self._extra(r, hit, pending)
                fork = self._fork(n, preds[r].main_group_tokens, hit + extra) if r in preds else 0
                out.append(Choice(replica=r, cost=w.prefill_token * (n - hit - w.in_flight_prefix * extra
                                                                     - w.fork_prefix * fork)
                                  + w.load(loads[r]), predicted_tokens=hit, in_flight_tokens=extra))
        else:
            keys = keys if keys is not None else self.index.keys(token_ids)
            preds = self.index.predict(keys, names)
            pending = self._pending(keys, names) if self.name == "kvatlas" else {}
            for r in names:
                out.append(self._priced(r, n, preds.get(r), loads[r], pending))
        order = {r: i for i, r in enumerate(names)}
        return sorted(out, key=lambda c: (c.cost, order[c.replica]))

    def _pending(self, keys: PromptKeys | None, names) -> dict:
        """{replica: (tokens, end digest)} of the prefixes in flight the prompt extends (none looked
        up when their weight is 0: `in_flight_tokens` then reads 0)."""
        if self.in_flight is None or keys is None or not self.weights.in_flight_prefix:
            return {}
        return self.in_flight.expected(keys, names)

    def _extra(self, replica: str, resident: int, pending: dict) -> int:
        """What the prefixes in flight on `replica` add beyond `resident` tokens; an entry the
        resident prefix already covers is dropped (the events showed it stored)."""
        found = pending.get(replica)
        if found is None:
            return 0
        tokens, end_key = found
        if tokens <= resident:
            self.in_flight.stored(replica, end_key)
            return 0
        return tokens - resident

    def _fork(self, n: int, main_group_tokens: int, expected: int) -> int:
        """The full group's resident prefix beyond what is expected resumable (at most n − 1, aligned)."""
        align = self.index.rule.align_tokens
        return max(0, min(main_group_tokens, (n - 1) // align * align) - expected)

    def _priced(self, replica: str, n: int, p: Prediction | None, load: ReplicaLoad, pending: dict) -> Choice:
        w = self.weights
        if p is None or p.stale:
            extra = pending.get(replica, (0, 0))[0]
            return Choice(replica=replica, cost=w.prefill_token * (n - w.in_flight_prefix * extra) + w.load(load),
                          predicted_tokens=0, prediction=p, in_flight_tokens=extra)
        if self.name == "main_group_prefix":
            hit = min(p.main_group_tokens, n)
            return Choice(replica=replica, cost=w.prefill_token * (n - hit) + w.load(load), predicted_tokens=hit,
                          prediction=p)
        extra = self._extra(replica, p.device_tokens, pending)
        beyond = max(0, extra - p.cpu_tokens - p.storage_tokens)    # what no restore would give either
        fork = self._fork(n, p.main_group_tokens, p.device_tokens + extra) if w.fork_prefix else 0
        cost = (w.prefill_token * (p.recompute_tokens - w.in_flight_prefix * beyond - w.fork_prefix * fork)
                + w.cpu_token * p.cpu_tokens + w.storage_token * p.storage_tokens + w.load(load))
        return Choice(replica=replica, cost=cost, predicted_tokens=p.device_tokens, prediction=p,
                      in_flight_tokens=extra)


def make_policy(name: str, *, index: PrefixIndex | None = None, weights: Weights | None = None,
                oracle: Callable[[str, Sequence[int]], int] | None = None,
                in_flight: InFlightPrefixes | None = None) -> Policy:
    return Policy(name=name, index=index, weights=weights or Weights(), oracle=oracle, in_flight=in_flight)
