"""How a fleet operation goes through the devices: parallelism, batches, a failure budget.

No SSH and no numpy here: `edgeq profile` on a device parses these options too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from edgeq.errors import UsageError

T = TypeVar("T")


def _count(spec: str | None, total: int, what: str) -> int | None:
    """``N`` or ``P%`` of ``total`` devices (None: no limit)."""
    if spec is None:
        return None
    text = str(spec).strip()
    try:
        value = float(text[:-1]) * total / 100 if text.endswith("%") else int(text)
    except ValueError:
        raise UsageError(f"{what} takes N or P% (e.g. 5 or 10%), got {spec!r}") from None
    if value < 0:
        raise UsageError(f"{what} cannot be negative, got {spec!r}")
    return int(value)


@dataclass(frozen=True)
class Rollout:
    """How a fleet operation goes through the devices: ``parallel`` at a time, in batches of
    ``batch`` (N or P%); once more than ``max_fail`` (N or P% of all) have failed, the devices
    of later batches are not touched."""

    parallel: int = 4
    batch: str | None = None
    max_fail: str | None = None

    def batches(self, devices: Sequence[T]) -> list[Sequence[T]]:
        size = _count(self.batch, len(devices), "--batch")
        size = len(devices) if not size else max(1, size)
        return [devices[i : i + size] for i in range(0, len(devices), size)] or [devices]

    def budget(self, total: int) -> int | None:
        return _count(self.max_fail, total, "--max-fail")
