"""Pictures of plans (matplotlib, imported only here)."""

from __future__ import annotations

from ..planning.capacity import capacity


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_plan(p, path: str) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    pools = p.pools()
    names = list(pools)
    gib = [sum(b.bytes for b in bufs) / 2**30 for bufs in pools.values()]
    dead = [sum(b.dead_bytes for b in bufs) / 2**30 for bufs in pools.values()]
    ax1.barh(names, gib, color="#4c72b0", label="allocated")
    ax1.barh(names, dead, color="#dd8452", label="dead (padding, null)")
    ax1.set_xlabel("GiB")
    ax1.set_title(f"{p.model.name}: memory by pool ({p.total_bytes / 2**30:.2f} GiB)")
    ax1.legend()
    ax1.invert_yaxis()
    contexts = [2**k for k in range(10, 21)]
    contexts = [c for c in contexts if c <= p.options.max_model_len]
    cap = capacity(p, contexts)
    ax2.plot(contexts, [cap.concurrency[c][0] for c in contexts], marker="o", label="fits in budget")
    ax2.plot(contexts, [cap.concurrency[c][1] for c in contexts], marker="s", label="in this plan")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("context tokens per request")
    ax2.set_ylabel("concurrent requests")
    ax2.set_title("concurrency vs context")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
