"""`kvatlas models`: the bundled presets and their layer mix."""

from __future__ import annotations

import json

from ..planning.model import LayerKind, load_model, preset_names
from ..observing.table import render


def add_parser(p) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    rows = []
    for name in preset_names():
        m = load_model(name)
        kinds = {k.value: m.count(k) for k in LayerKind if m.count(k)}
        rows.append({"name": name, "family": m.family, "layers": m.num_hidden_layers,
                     "draft_layers": m.num_draft_layers, "kinds": kinds, "window": m.sliding_window,
                     "max_position_embeddings": m.max_position_embeddings})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(render(["model", "family", "layers", "draft", "layer kinds", "window", "max context"],
                 [[r["name"], r["family"], r["layers"], r["draft_layers"],
                   " ".join(f"{k}:{v}" for k, v in r["kinds"].items()), r["window"], r["max_position_embeddings"]]
                  for r in rows]))
    return 0
