"""check_integrity(): the allocator's arrays, its free lists and the ledger agree."""

from __future__ import annotations

import numpy as np

from ..planning.buffers import CHECKPOINTS, FULL_PAGES, REQUEST_SLOTS, SWA_PAGES
from ..errors import IntegrityError
from ..units import cdiv
from .entries import ratio_key
from .sharing import CACHE_OWNER


def allocator_problems(a) -> list[str]:
    problems = a.slots.check("request_slots")
    live = sorted(a.slot_of.values())
    if [s for s in range(1, len(a.rid_of)) if a.rid_of[s] is not None] != live:
        problems.append("request table: slot map and rid map disagree")
    if a.full is not None:
        problems += a.full.check("full_pages")
        problems += _owned(a, live, "full_pages", a.full, lambda s: a.full_table[s, a.full_shared[s]: a.full_held[s]])
        cached = int(np.count_nonzero(a.full.owner == CACHE_OWNER))
        if int((a.full_held - a.full_shared)[live].sum()) + cached != a.full.used:
            problems.append("full_pages: held pages + cached pages != used pages")
        for s in live:
            if np.any(a.full.owner[a.full_table[s, : a.full_shared[s]]] != CACHE_OWNER):
                problems.append(f"slot {s}: a shared page is not held by the cache")
        outstanding = int(np.maximum(a.reserved - a.full_held, 0).sum())
        if outstanding != a.outstanding or a.outstanding > a.full.free:
            problems.append(f"full_pages: outstanding reservations {a.outstanding} (recount {outstanding}, "
                            f"free {a.full.free})")
        for s in live:
            if a.full_held[s] < cdiv(int(a.length[s]), a.P):
                problems.append(f"slot {s}: {int(a.length[s])} tokens in {int(a.full_held[s])} pages")
    if a.swa is not None:
        problems += a.swa.check("swa_pages")
        def own(s):
            pages = a.window_swa_pages(s)
            return pages[a.swa.owner[pages] != CACHE_OWNER]
        problems += _owned(a, live, "swa_pages", a.swa, own)
        cached = int(np.count_nonzero(a.swa.owner == CACHE_OWNER))
        held = sum(int(a.swa_hi[s] - a.swa_lo[s]) - a.swa_cached_pages(s) for s in live)
        if held + cached != a.swa.used:
            problems.append("swa_pages: held pages + cached pages != used pages")
        for s in live:
            if a.swa_hi[s] < cdiv(int(a.length[s]), a.Ps) or a.swa_hi[s] - a.swa_lo[s] > a.ring:
                problems.append(f"slot {s}: SWA pages [{a.swa_lo[s]}, {a.swa_hi[s]}) do not cover its window")
    problems += a.cached_swa_check(live)
    if a.backing is not None:   # lazily backed: every live unit's chunks mapped, refs recounted
        live = {REQUEST_SLOTS: a.slots.live_ids()}
        for group, fl in ((FULL_PAGES, a.full), (SWA_PAGES, a.swa), (CHECKPOINTS, a.ckpt)):
            if fl is not None:
                live[group] = fl.live_ids()
        problems += a.backing.problems(live)
    return problems


def _owned(a, live, name, freelist, ids_of) -> list[str]:
    """Every page a live request lists is owned by that request, and listed once."""
    out, seen = [], []
    for s in live:
        ids = ids_of(s)
        if np.any(freelist.owner[ids] != s + 1) or np.any(ids == 0):
            out.append(f"{name}: slot {s} lists a page it does not own")
        seen.append(ids)
    allids = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    if len(allids) and np.bincount(allids).max() > 1:
        out.append(f"{name}: a page is listed twice")
    return out


def ledger_problems(a, ledger) -> list[str]:
    live = list(a.slot_of.values())
    want: dict[str, int] = {}
    for s in live:
        for k, v in a._private_entries(s, int(a.length[s])).items():
            want[k] = want.get(k, 0) + v
    if a.prefix_on:   # pages the cache holds are complete: every entry of them is live
        for r in a.ratios:
            k = ratio_key(r)
            want[k] = want.get(k, 0) + int(np.count_nonzero(a.full.owner == CACHE_OWNER)) * (a.P // r)
        if a.swa is not None:
            want["swa"] = want.get("swa", 0) + int(np.count_nonzero(a.swa.owner == CACHE_OWNER)) * a.Ps
    out = [f"ledger entries {k}: {ledger.entries_used.get(k, 0)} != {v}" for k, v in want.items()
           if ledger.entries_used.get(k, 0) != v]
    return out + counter_problems(a, ledger)


def counter_problems(a, ledger) -> list[str]:
    """The counters that must agree, each read in O(1) (the simulator's check after every pass):
    the ledger's units and running requests against the free lists and the slot table, and the
    outstanding reservations within the free pages."""
    used = {REQUEST_SLOTS: a.slots.used, FULL_PAGES: a.full.used if a.full else 0,
            SWA_PAGES: a.swa.used if a.swa else 0, CHECKPOINTS: a.ckpt.used if a.ckpt else 0}
    out = [f"ledger units {g}: {ledger.units_used[g]} != {n}" for g, n in used.items() if ledger.units_used[g] != n]
    if ledger.running_requests != len(a.slot_of):
        out.append(f"ledger running {ledger.running_requests} != {len(a.slot_of)}")
    if a.full is not None and not 0 <= a.outstanding <= a.full.free:
        out.append(f"full_pages: outstanding reservations {a.outstanding} outside [0, free {a.full.free}]")
    return out


def check(a, ledger=None, extra=()) -> None:
    """extra: problems found by the layers above (the prefix cache's recount)."""
    problems = allocator_problems(a) + (ledger_problems(a, ledger) if ledger is not None else []) + list(extra)
    if problems:
        raise IntegrityError("cache invariants broken: " + "; ".join(problems))
