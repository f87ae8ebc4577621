"""`kvatlas compare --plot`: memory by pool per engine, and concurrency against context.
matplotlib is imported inside the function so `kvatlas compare` without --plot stays fast."""

from __future__ import annotations

from .base import CURVE_CONTEXTS

GIB = 2**30
# tab20: enough distinct colours that no two pools of one picture share one
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
            "#dbdb8d", "#9edae5")


def _label(r) -> str:
    return f"{r.engine}\n{r.variant}" + ("\nREFUSED on this GPU" if r.refused else "")


def _pool_bars(ax, results) -> None:
    """One stacked bar per engine; a pool keeps its colour across engines, dead bytes hatched on top."""
    pools: list[str] = []
    for r in results:
        pools += [p for p in r.pools() if p not in pools]
    labels = [_label(r) for r in results]
    left = [0.0] * len(results)
    for i, pool in enumerate(pools):
        widths = [r.pools().get(pool, 0) / GIB for r in results]
        ax.barh(labels, widths, left=left, color=_COLOURS[i % len(_COLOURS)], label=pool, edgecolor="white", lw=0.3)
        left = [a + b for a, b in zip(left, widths)]
    dead = [r.dead_bytes / GIB for r in results]
    ax.barh(labels, dead, left=[a - d for a, d in zip(left, dead)], fill=False, hatch="///", edgecolor="black",
            lw=0, label="dead (of the above)")
    budget = results[0].budget_bytes / GIB
    ax.axvline(budget, color="black", ls="--", lw=1)
    ax.text(budget, -0.6, " budget", va="bottom", fontsize=8)
    ax.set_xlabel("GiB allocated from the KV budget")
    ax.set_title(f"{results[0].model}: memory by pool")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)


def _curves(ax, results) -> None:
    for i, r in enumerate(results):
        xs = [c for c in CURVE_CONTEXTS if r.concurrency.get(c, 0) > 0]
        ax.plot(xs, [r.concurrency[c] for c in xs], marker="o", ms=3, color=_COLOURS[i % len(_COLOURS)],
                label=_label(r).replace("\n", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens per request")
    ax.set_ylabel("requests held at once")
    ax.set_title(f"concurrency vs context (max running {results[0].max_running_requests})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_compare(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 1.2 * len(results) + 3.5))
    _pool_bars(ax1, results)
    _curves(ax2, results)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
