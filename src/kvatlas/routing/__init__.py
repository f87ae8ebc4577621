"""Routing across vLLM replicas by an exact DeepSeek-V4 prefix index built from the engines' own KV
events. Pure Python (numpy, pyzmq, msgspec: `pip install kvatlas[routing]`); it reads engines'
event streams, never their objects, and imports nothing of the cache.

Public API (stable; docs/routing.md has the guide):

    from kvatlas.routing import PrefixIndex, Fleet, make_policy, ReplicaLoad, Weights
    index = PrefixIndex("deepseek-v4-flash")          # the model: its groups' windows and hit rule
    fleet = Fleet(index)
    fleet.add("a", "tcp://10.0.0.1:5557", replay_endpoint="tcp://10.0.0.1:5558", dp_size=1)
    fleet.start()                                     # one SUB thread per replica and DP rank
    preds = index.predict(token_ids)                  # {replica: Prediction}
    preds["a"].device_tokens                          # exact resumable prefix on the device
    policy = make_policy("kvatlas", index=index, weights=Weights())
    ranked = policy.choose(token_ids, {"a": ReplicaLoad(in_flight=1, running=3, waiting=0), ...})
    ranked[0].replica, ranked[0].cost                 # best first
    fleet.state()                                     # JSON-able: rule, engines, subscribers
    fleet.stop()

Modules:
- `events`: kvatlas's event dataclasses (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`,
  `EventBatch`), `MalformedEventError`, `hash_key`.
- `vllm_events`: vLLM's wire → those (`decode_frames`, `decode_payload`, `decode_seq`,
  `encode_batch`; a decoded `BlockStored`'s token ids are a `WireTokens`, parsed when first read);
  all of vLLM's wire format is there.
- `subscriber`: `Subscriber(endpoint, *, replay_endpoint=None, on_batch, replica, dp_rank, topic,
  on_lost, on_reset, hwm, replay_timeout_s, stale_after_s, idle_probe_s, bind)` with `start()`,
  `stop()`, `stats()` →
  `SubscriberStats` (last_seq, batches, events, gaps, replays, replayed_batches, lost_batches,
  malformed, resets, connected, last_event_time, last_batch_ts, stale_reason); `rank_endpoint`.
- `rule`: `HitRule.for_model(model)` (family, alignment, sliding windows), `GroupSpec`,
  `groups_from_metadata(rule, EngineCore.get_kv_cache_group_metadata())`.
- `index`: `PrefixIndex(rule_or_model)`: `apply(replica, rank, batch)`, `predict(token_ids |
  keys(token_ids), replicas=None)` → {replica: `Prediction`(replica, rank, prompt_tokens,
  device_tokens, cpu_tokens, storage_tokens, recompute_tokens, main_group_tokens, stale)},
  `keys(token_ids)` (digest once, predict many), `mark_stale`, `clear`, `add_engine`,
  `remove_engine`, `engines()`, `state()`.
- `policy`: `make_policy(name, index=, weights=, oracle=, in_flight=)` for name in `POLICIES`
  (kvatlas, main_group_prefix, round_robin, least_loaded, oracle); `Policy.choose(token_ids | keys,
  loads)` → [`Choice`(replica, cost, predicted_tokens, prediction, in_flight_tokens)] best first;
  `Policy.routed(replica, request, prompt)` / `Policy.finished(request)` keep its prefixes in flight;
  `ReplicaLoad`, `Weights`.
- `inflight`: `InFlightPrefixes(align_tokens, ttl_s=, max_entries=, max_keys=, clock=)`: per replica the
  aligned ends of prompts sent there and not finished; `add`, `finish`, `stored`, `expire`,
  `expected(keys, replicas)` → {replica: (tokens, end digest)}, `state()`.
- `fleet`: `Fleet(index)`: `add(replica, endpoint, replay_endpoint=, dp_size=, groups=)`,
  `start()`, `stop()`, `remove(replica)`, `subscribers()`, `state()`.
"""

from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MalformedEventError
from .fleet import Fleet
from .index import Prediction, PrefixIndex, PromptKeys
from .inflight import InFlightPrefixes
from .policy import POLICIES, Choice, Policy, ReplicaLoad, Weights, make_policy
from .rule import GroupSpec, HitRule, groups_from_metadata
from .subscriber import Subscriber, SubscriberStats, rank_endpoint

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Choice", "EventBatch", "Fleet", "GroupSpec",
           "HitRule", "InFlightPrefixes", "MalformedEventError", "POLICIES", "Policy", "Prediction", "PrefixIndex", "PromptKeys",
           "ReplicaLoad", "Subscriber", "SubscriberStats", "Weights", "groups_from_metadata", "make_policy",
           "rank_endpoint"]
