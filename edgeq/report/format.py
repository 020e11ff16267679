"""How the report writes a number: percentages, signed changes, sizes, each metric in its unit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeq.tasks.metrics import metric


@dataclass(frozen=True)
class Check:
    ok: bool | None  # None: a fact, not a pass or a failure
    text: str


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def pct(value: Any) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.2%}"


def signed(value: Any, digits: int = 2) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:+.{digits}f}"


def fixed(value: Any, digits: int = 1) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.{digits}f}"


def size(value: Any) -> str:
    v = _num(value)
    if v is None:
        return "-"
    return f"{v / 1024:.1f} KiB" if v < 1024 * 1024 else f"{v / 1024 / 1024:.2f} MiB"


def _name(path: Any) -> str:
    return Path(str(path)).name


def _metric(name: str, value: Any) -> str:
    return metric(name).show(_num(value))


def metric_value(value: Any, name: str | None) -> str:
    """A value of metric ``name`` as a person reads it (a share in %, an error in its units)."""
    return metric(name or "accuracy").show(_num(value))


def metric_change(value: Any, name: str | None) -> str:
    """How much worse, in the metric's change unit ("0.83 pp worse", "4.3 % RMSE worse")."""
    return metric(name or "accuracy").show_change(_num(value))


def metric_label(name: str | None) -> str:
    return metric(name or "accuracy").label


def change_label(name: str | None) -> str:
    return metric(name or "accuracy").change_label
