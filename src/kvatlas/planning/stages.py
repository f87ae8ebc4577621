"""Which layers a pipeline stage runs: the one split every sizing (KV pools, weights) agrees on."""

from __future__ import annotations

from ..errors import ConfigError
from .model import LayerSpec, ModelSpec


def rank_layers(model: ModelSpec, opts) -> tuple[LayerSpec, ...]:
    """The layers pipeline stage `opts.pp_rank` of `opts.pp` runs (`opts`: ServeOptions or anything with
    those and `draft_layers`): main layers split evenly, draft layers on the last."""
    main = [l for l in model.layers() if not l.is_draft]
    per, extra = divmod(len(main), opts.pp)
    start = opts.pp_rank * per + min(opts.pp_rank, extra)
    mine = main[start:start + per + (1 if opts.pp_rank < extra else 0)]
    if opts.draft_layers and opts.pp_rank == opts.pp - 1:
        mine += [l for l in model.layers(draft=True) if l.is_draft]
    if not mine:
        raise ConfigError("pp", f"pp={opts.pp} leaves stage {opts.pp_rank} without layers",
                          f"use pp ≤ {len(main)}")
    return tuple(mine)
