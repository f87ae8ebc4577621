"""One workload through one plan on the bookkeeping backend (no pool memory), reduced to the
figures `kvatlas tune` compares settings by: prefix-hit ratio, queueing, time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    hit_ratio: float               # prompt tokens served by the prefix cache / prompt tokens asked
    hit_tokens: int
    prefill_tokens: int            # prompt tokens computed
    passes: int
    blocked_passes: int            # passes where the head of the queue waited for a slot or memory
    peak_running: int
    virtual_s: float               # the run's length on the simulator's clock
    finished: int
    rejected: int                  # longer than max_model_len

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def replay(p, requests, **simulator):
    """Run `requests` through plan `p` offline (backend none: the allocator and ledger only),
    every book checked at the end: the cache and the simulator after the run. `simulator`: the
    Simulator's keyword arguments (nothing is recorded per pass)."""
    import kvatlas
    from .sim import Simulator
    cache = kvatlas.allocate(p, backend="none")
    sim = Simulator(cache, list(requests), **{**simulator, "record": False})
    sim.run_offline()
    cache.check_integrity()
    return cache, sim


def measure(p, requests, time_model) -> Measured:
    """Run `requests` through plan `p` offline (replay) and reduce the run to tune's figures."""
    cache, sim = replay(p, requests, time_model=time_model)
    s = sim.stats
    pc = cache.prefix.stats if cache.prefix is not None else None
    asked = pc.queried_tokens if pc is not None else sum(r.prompt_tokens for r in requests)
    hits = pc.hit_tokens if pc is not None else 0
    return Measured(hit_ratio=hits / asked if asked else 0.0, hit_tokens=hits, prefill_tokens=s.prefill_tokens,
                    passes=s.steps, blocked_passes=s.blocked_steps, peak_running=s.peak_running,
                    virtual_s=sim.clock_s, finished=s.finished, rejected=s.rejected_too_long)
