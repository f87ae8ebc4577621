"""A simulation's timeline as a CSV and a PNG of memory by pool and measure over time.
matplotlib is imported inside the plotting function only (it is slow to import)."""

from __future__ import annotations

import csv

from ..cache.ledger import MEASURES


def timeline_columns(timeline) -> list[str]:
    pools = list(timeline[0].snapshot.pools) if timeline else []
    cols = ["t_s", "step", "running_requests", "waiting_requests", "finished_requests"]
    cols += [f"total_{m}_bytes" for m in MEASURES]
    cols += [f"{p}_{m}_bytes" for p in pools for m in MEASURES]
    return cols + ["prefix_queried_tokens", "prefix_hit_tokens"]


def timeline_rows(timeline):
    for pt in timeline:
        s = pt.snapshot
        row = [f"{pt.t_s:.6f}", pt.step, pt.running, pt.waiting, pt.finished]
        row += [getattr(s, f"{m}_bytes") for m in MEASURES]
        row += [getattr(u.measures, f"{m}_bytes") for u in s.pools.values() for m in MEASURES]
        yield row + [pt.prefix_queried_tokens, pt.prefix_hit_tokens]


def write_csv(path: str, timeline) -> None:
    """One row per forward pass: time, request counts, every measure in total and per pool (bytes)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(timeline_columns(timeline))
        w.writerows(timeline_rows(timeline))


def write_png(path: str, timeline, title: str = "") -> None:
    """Six panels (one per measure), each stacked by pool, plus running/waiting requests."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [pt.t_s for pt in timeline]
    pools = list(timeline[0].snapshot.pools) if timeline else []
    fig, axes = plt.subplots(2, 5, figsize=(22, 8), sharex=True)
    books_only = bool(timeline) and timeline[0].snapshot.backend == "none"
    for ax, m in zip(axes.flat, MEASURES):
        ax.set_title(f"{m} (MiB)")
        if books_only and m in ("tensor", "reserved", "physical"):   # an empty panel would read as "0 used"
            ax.text(0.5, 0.5, "not allocated\n(backend none: allocator\nand ledger only)", ha="center",
                    va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        series = [[getattr(pt.snapshot.pools[p].measures, f"{m}_bytes") / 2**20 for pt in timeline] for p in pools]
        if t:
            ax.stackplot(t, *series, labels=pools)
    axes.flat[0].legend(loc="upper left", fontsize=7)
    ax = axes.flat[len(MEASURES)]
    ax.plot(t, [pt.running for pt in timeline], label="running")
    ax.plot(t, [pt.waiting for pt in timeline], label="waiting")
    ax.set_title("requests")
    ax.legend(fontsize=7)
    ax = axes.flat[len(MEASURES) + 1]
    ax.plot(t, [pt.snapshot.occupied_bytes / max(pt.snapshot.addressable_bytes, 1) * 100 for pt in timeline])
    ax.set_title("occupied / addressable (%)")
    ax = axes.flat[len(MEASURES) + 2]   # cumulative: hits / prompt tokens queried so far
    ax.plot(t, [pt.prefix_hit_tokens / max(pt.prefix_queried_tokens, 1) * 100 for pt in timeline])
    ax.set_title("prefix-cache hit ratio so far (%)")
    for ax in axes[1]:
        ax.set_xlabel("time (s)")
    fig.suptitle(title or "kvatlas: KV memory over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
