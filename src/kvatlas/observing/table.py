"""Plain-text tables: fast to import (no rich on the plan path), aligned, right-justified numbers."""

from __future__ import annotations


def render(headers: list[str], rows: list[list], title: str = "") -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(_is_num(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric)).rstrip()

    out = [title] if title else []
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out += [line(r) for r in cells]
    return "\n".join(out)


def _is_num(text: str) -> bool:
    t = text.replace(",", "").replace("%", "").replace(" ", "").rstrip("BKMGTi×")
    try:
        float(t)
        return True
    except ValueError:
        return text in ("", "-")
