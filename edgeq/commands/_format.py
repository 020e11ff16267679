"""Small table printer shared by the commands (no third-party dependency)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(value, digits: int = 4) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)
